// Dot products of float weight rows (bf16 or fp32) with activation rows of the same dtype, shared
// by the dense GEMV (gemv.cpp) and the fused MoE experts (moe.cpp):
//
//   sums[r][m] = w[r] . x[m],   x[m] = x + m * K,  r < R, m < M
//
// for R weight rows (pointers, or adjacent rows w + r * K). The R weight rows share each
// activation load; each row is streamed once with a software prefetch ahead of it (unless the
// caller knows them cached). Each (r, m) sum runs over k in the same lanes and order whatever M
// and R are, so a row's output has the same bits in a call of 1 activation row or 32 (the
// engine's verifying steps rely on it).
//
// One pair of types, Bf16 and F32, per ISA (the compiler's target macros, -march=native):
// - AVX-512 F + BW + VL: 16 fp32 lanes; bf16 by vdpbf16ps (32 exact pair products summed in
//   fp32) with AVX512_BF16, else widened to fp32 (its 16 bits shifted up: exact) and FMA.
// - AVX2 + FMA: 8 fp32 lanes, bf16 widened likewise.
// - elsewhere (x86-64 baseline, aarch64): plain loops gcc -O3 vectorizes, 8 independent fp32
//   partial sums per dot product (a vectorizable reduction without -ffast-math).
// A bf16 product is exact in fp32 on every path; the paths differ only in their fp32 sums' order.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <cstring>

#include "simd.h"
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace zcode_float_dot {

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Rounds to nearest even, as vcvtneps2bf16 (a NaN stays a quiet NaN).
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// Weight rows are streamed with software prefetches this far ahead into L2: one core's hardware
// prefetchers alone keep too few misses in flight (SmolLM2's bf16 linears in model order, 2
// threads: 19 GB/s without, 27 GB/s with, the rate of a plain fp32 sum here).
constexpr int64_t PREFETCH_BYTES = 12 << 10;
inline void prefetch_l2(const void* p) {
#if defined(__SSE__)
  _mm_prefetch(static_cast<const char*>(p) + PREFETCH_BYTES, _MM_HINT_T1);
#else
  __builtin_prefetch(static_cast<const char*>(p) + PREFETCH_BYTES, 0, 2);  // L2, as _MM_HINT_T1
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ZCODE_FLOAT_DOT_VECTORS 1
using Acc = __m512;
inline Acc zero() { return _mm512_setzero_ps(); }
inline float sum(Acc v) { return _mm512_reduce_add_ps(v); }

struct F32 {
  using T = float;
  using V = __m512;
  static constexpr c10::ScalarType DTYPE = c10::kFloat;
  static constexpr int64_t LANES = 16;
  static V load(const T* p) { return _mm512_loadu_ps(p); }
  static V load(const T* p, int64_t left) {  // 0 < left < LANES
    return _mm512_maskz_loadu_ps((1u << left) - 1, p);
  }
  static Acc madd(Acc acc, V w, V x) { return _mm512_fmadd_ps(w, x, acc); }
};
#if defined(__AVX512BF16__)
struct Bf16 {
  using T = uint16_t;
  using V = __m512bh;
  static constexpr c10::ScalarType DTYPE = c10::kBFloat16;
  static constexpr int64_t LANES = 32;
  static V load(const T* p) { return (V)_mm512_loadu_si512(p); }
  static V load(const T* p, int64_t left) {  // 0 < left < LANES
    return (V)_mm512_maskz_loadu_epi16((1u << left) - 1, p);
  }
  static Acc madd(Acc acc, V w, V x) { return _mm512_dpbf16_ps(acc, w, x); }
};
#else
struct Bf16 {
  using T = uint16_t;
  using V = __m512;
  static constexpr c10::ScalarType DTYPE = c10::kBFloat16;
  static constexpr int64_t LANES = 16;
  static V widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static V load(const T* p) {
    return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static V load(const T* p, int64_t left) {  // 0 < left < LANES
    return widen(_mm256_maskz_loadu_epi16((1u << left) - 1, p));
  }
  static Acc madd(Acc acc, V w, V x) { return _mm512_fmadd_ps(w, x, acc); }
};
#endif

#elif defined(__AVX2__) && defined(__FMA__)
#define ZCODE_FLOAT_DOT_VECTORS 1
using Acc = __m256;
inline Acc zero() { return _mm256_setzero_ps(); }
inline float sum(Acc v) { return zcode_simd::hsum(v); }

// A K tail of 0 < left < 8 elements through a zero-filled buffer (AVX2 has no masked 16-bit load).
template <typename T>
struct Tail {
  alignas(32) T values[8] = {};
  Tail(const T* p, int64_t left) { std::memcpy(values, p, left * sizeof(T)); }
};

struct F32 {
  using T = float;
  using V = __m256;
  static constexpr c10::ScalarType DTYPE = c10::kFloat;
  static constexpr int64_t LANES = 8;
  static V load(const T* p) { return _mm256_loadu_ps(p); }
  static V load(const T* p, int64_t left) { return load(Tail<T>(p, left).values); }
  static Acc madd(Acc acc, V w, V x) { return _mm256_fmadd_ps(w, x, acc); }
};
struct Bf16 {
  using T = uint16_t;
  using V = __m256;
  static constexpr c10::ScalarType DTYPE = c10::kBFloat16;
  static constexpr int64_t LANES = 8;
  static V load(const T* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static V load(const T* p, int64_t left) { return load(Tail<T>(p, left).values); }
  static Acc madd(Acc acc, V w, V x) { return _mm256_fmadd_ps(w, x, acc); }
};

#else
constexpr int LANES = 8;
struct F32 {
  using T = float;
  static constexpr c10::ScalarType DTYPE = c10::kFloat;
  static float widen(T v) { return v; }
};
struct Bf16 {
  using T = uint16_t;
  static constexpr c10::ScalarType DTYPE = c10::kBFloat16;
  static float widen(T h) { return bf16_to_float(h); }
};
#endif

#if defined(ZCODE_FLOAT_DOT_VECTORS)
// Whole vectors load unmasked and only the K tail masked: a masked load in the main loop halved
// the rate at 2-4 activation rows (AVX-512, L2-resident 512 x 576 bf16, one thread, 4 rows:
// 55.9 -> 27.4 ns a weight row).
template <typename F, int M, int R, bool PREFETCH = true>
inline void dot_rows(const typename F::T* x, const typename F::T* const (&w)[R],
                     float (&sums)[R][M], int64_t K) {
  Acc acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = zero();
  int64_t k = 0;
  for (; k + F::LANES <= K; k += F::LANES) {
    typename F::V xv[M];
    for (int m = 0; m < M; ++m) xv[m] = F::load(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      if constexpr (PREFETCH) prefetch_l2(w[r] + k);
      const typename F::V wv = F::load(w[r] + k);
      for (int m = 0; m < M; ++m) acc[r][m] = F::madd(acc[r][m], wv, xv[m]);
    }
  }
  if (k < K) {
    typename F::V xv[M];
    for (int m = 0; m < M; ++m) xv[m] = F::load(x + m * K + k, K - k);
    for (int r = 0; r < R; ++r) {
      const typename F::V wv = F::load(w[r] + k, K - k);
      for (int m = 0; m < M; ++m) acc[r][m] = F::madd(acc[r][m], wv, xv[m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) sums[r][m] = sum(acc[r][m]);
}
#else
template <typename F, int M, int R, bool PREFETCH = true>
inline void dot_rows(const typename F::T* x, const typename F::T* const (&w)[R],
                     float (&sums)[R][M], int64_t K) {
  float acc[R][M][LANES] = {};
  int64_t k = 0;
  for (; k + LANES <= K; k += LANES) {
    float xv[M][LANES];
    for (int m = 0; m < M; ++m)
      for (int l = 0; l < LANES; ++l) xv[m][l] = F::widen(x[m * K + k + l]);
    for (int r = 0; r < R; ++r) {
      if constexpr (PREFETCH) prefetch_l2(w[r] + k);
      float wv[LANES];
      for (int l = 0; l < LANES; ++l) wv[l] = F::widen(w[r][k + l]);
      for (int m = 0; m < M; ++m)
        for (int l = 0; l < LANES; ++l) acc[r][m][l] += wv[l] * xv[m][l];
    }
  }
  for (; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m][0] += F::widen(w[r][k]) * F::widen(x[m * K + k]);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      float total = 0.f;
      for (int l = 0; l < LANES; ++l) total += acc[r][m][l];
      sums[r][m] = total;
    }
}
#endif

// The same for R adjacent rows w + r * K.
template <typename F, int M, int R>
inline void dot_rows(const typename F::T* x, const typename F::T* w, float (&sums)[R][M],
                     int64_t K) {
  const typename F::T* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = w + r * K;
  dot_rows<F, M, R>(x, rows, sums, K);
}

}  // namespace zcode_float_dot
