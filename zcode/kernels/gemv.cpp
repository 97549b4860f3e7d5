// Decode GEMV kernels for any CPU: out[m, n] = sum_k x[m, k] * w[n, k] for a few rows of x
// (M <= MAX_ROWS; bf16 and fp32 M <= MAX_FLOAT_ROWS). Decode is memory-bound, so each thread
// streams a contiguous slice of weight rows exactly once and keeps all M activation rows in L1.
//
// bf16:  x, w bf16 [N, K]; each product exact in fp32 (vdpbf16ps, or both widened), fp32 sums.
// fp32:  x, w fp32 [N, K]; FMA (on AVX-512 2-3% faster than MKL's sgemv over SmolLM2's linears,
//        from float_dot.h's prefetch).
// w4a8:  zcode.quant.int4's W4A8 format: w = (q - 8) * scale + zero per group of k (qweight uint8
//        [N_pad, K / 2], low nibble = even k), x = xq * x_scale with int8 codes per token. vpdpbusd
//        sums 64 nibble x int8 products exactly in int32 lanes of 8 k each, so
//        out = x_scale * (sum_g scale_g sum_{k in g} q_k xq_k + sum_g (zero_g - 8 scale_g) sum_{k in g} xq_k)
//        is exact up to the fp32 sums over chunks. The kernel quantizes x itself (one call).
// w8a8:  zcode.quant.int8's W8A8 format, int8 weights per row scale; vpdpbusd of the int8
//        codes shifted to unsigned, the shift taken back with each row's code sum: exact.
//
// ISA paths: the float kernels (bf16, fp32) are float_dot.h's (AVX-512, with vdpbf16ps where
// AVX512_BF16 is; AVX2 + FMA; portable loops). W4A8 / W8A8 and the activation quantization use
// AVX-512 F + BW + VL + VNNI (vpdpbusd) where the compiler targets them (-march=native); without
// them the portable path: plain loops gcc -O3 vectorizes for the target, the same integer dot
// products exactly, fp32 sums in independent lanes (a different order).
//
// Each op takes a list of weights that share the input (q/k/v, gate/up) and returns their
// outputs side by side, [M, N_0 + N_1 + ...]: one call, one activation quantization and one
// parallel region for the group. Per call each op pays ~3 us (dispatch, set-up, waking the
// second thread), and a 192-row k or v matrix alone is too small to split across threads.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "float_dot.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ZCODE_GEMV_AVX512 1
#if defined(__AVX512VNNI__)
#define ZCODE_GEMV_AVX512_VNNI 1
#endif
#endif

namespace {

constexpr int64_t MAX_ROWS = 4;  // the int8-activation kernels' (W4A8, W8A8)
// The float kernels (bf16, fp32) take up to MAX_FLOAT_ROWS rows, TILE_ROWS at a time: a step
// verifying drafts of 16 sequences multiplies up to 32 rows, where oneDNN's bf16 GEMM still ran
// 1.2-1.5x slower than these loops (zcode.quant.formats.FLOAT_GEMV_MAX_ROWS).
constexpr int64_t MAX_FLOAT_ROWS = 32;
constexpr int64_t TILE_ROWS = 4;
// A parallel_for task reads at least this many weight bytes: forking the second thread costs
// microseconds, as much as streaming ~64 KB, so small matrices run on one thread.
constexpr int64_t GRAIN_BYTES = 64 << 10;

inline int64_t grain_rows(int64_t row_bytes) { return std::max<int64_t>(16, GRAIN_BYTES / row_bytes); }

// The rows of a list of weight matrices numbered one after another: matrix s's row r is output
// column offsets[s] + r.
struct Rows {
  std::vector<int64_t> offsets;  // [S + 1]: each matrix's first output column, then the total

  explicit Rows(const std::vector<int64_t>& rows_per_matrix) : offsets{0} {
    for (int64_t n : rows_per_matrix) offsets.push_back(offsets.back() + n);
  }
  int64_t total() const { return offsets.back(); }

  // Splits rows [0, total) over threads (at::parallel_for, `grain` rows at least per task) and
  // calls fn(s, r0, r1) for each matrix s's rows r0..r1 (indices within s) in a task. (Fixed
  // halves: threads taking chunks from a shared counter were 5-15% slower over SmolLM2's W4A8
  // GEMVs in model order.)
  template <typename Fn>
  void parallel(int64_t grain, const Fn& fn) const {
    at::parallel_for(0, total(), grain, [&](int64_t n0, int64_t n1) { split(n0, n1, fn); });
  }

 private:
  template <typename Fn>
  void split(int64_t n0, int64_t n1, const Fn& fn) const {
    size_t s = std::upper_bound(offsets.begin(), offsets.end(), n0) - offsets.begin() - 1;
    for (; n0 < n1; ++s) {
      const int64_t end = std::min(n1, offsets[s + 1]);
      if (end > n0) fn(s, n0 - offsets[s], end - offsets[s]);
      n0 = end;
    }
  }
};

using zcode_float_dot::bf16_to_float;
using zcode_float_dot::prefetch_l2;
using Bf16Kernel = zcode_float_dot::Bf16;
using F32Kernel = zcode_float_dot::F32;

// Sum of w[i] * x[i] over n int8 x int8 (or uint8) codes: an integer sum, so gcc vectorizes it.
template <typename W, typename X>
inline int32_t dot_codes(const W* w, const X* x, int64_t n) {
  int32_t sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<int32_t>(w[i]) * static_cast<int32_t>(x[i]);
  return sum;
}

// out[m * N + r] = wn[r] . x[m] for R weight rows from wn and M activation rows.
template <typename F, int M, int R>
inline void float_dot_rows(const typename F::T* x, const typename F::T* wn, float* out, int64_t K,
                           int64_t N) {
  float sums[R][M];
  zcode_float_dot::dot_rows<F, M, R>(x, wn, sums, K);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) out[m * N + r] = sums[r][m];
}

// R weight rows against the M activation rows of x, TILE_ROWS at a time (the last tile takes the
// rest): each tile's sums fit in registers, and the R weight rows stay in L1 across tiles.
template <typename F, int R>
inline void float_dot_tiles(const typename F::T* x, int64_t M, const typename F::T* wn, float* o,
                            int64_t K, int64_t N) {
  for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {
    const typename F::T* xt = x + m0 * K;
    float* ot = o + m0 * N;
    switch (std::min<int64_t>(TILE_ROWS, M - m0)) {
      case 1: float_dot_rows<F, 1, R>(xt, wn, ot, K, N); break;
      case 2: float_dot_rows<F, 2, R>(xt, wn, ot, K, N); break;
      case 3: float_dot_rows<F, 3, R>(xt, wn, ot, K, N); break;
      default: float_dot_rows<F, 4, R>(xt, wn, ot, K, N); break;
    }
  }
}

template <typename F>
void gemv_float_rows(const typename F::T* x, int64_t M, const std::vector<const typename F::T*>& ws,
                     const Rows& rows, float* out, int64_t K) {
  // Weight rows per step, sharing each activation load: 4 against 2, SmolLM2's bf16 linears in
  // model order, 2 threads: 1 row 9.1 -> 8.7 ms, 4 rows 9.5 -> 8.5, 16 rows 17.2 -> 16.2.
  constexpr int R = 4;
  const int64_t N = rows.total();
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(typename F::T));
  rows.parallel(grain_rows(row_bytes), [&](size_t s, int64_t r0, int64_t r1) {
    const typename F::T* w = ws[s];
    float* o = out + rows.offsets[s];
    int64_t r = r0;
    for (; r + R <= r1; r += R) float_dot_tiles<F, R>(x, M, w + r * K, o + r, K, N);
    for (; r < r1; ++r) float_dot_tiles<F, 1>(x, M, w + r * K, o + r, K, N);
  });
}

// int8 activation codes rearranged for the W4A8 loop: per 128-k chunk (64 bytes of nibbles), the even
// k then the odd k, matching the low and high nibbles; and the sum of codes per group.
struct W4A8Activations {
  std::vector<int8_t> deinterleaved;  // [M, K]
  std::vector<float> group_sums;      // [M, G_pad]: G rounded up to 16 for masked vector reads
  int64_t G_pad;
  // Floats per weight row in a kernel's scratch of unpacked scales: + 4, as a chunk reads up to
  // 4 groups' scales.
  int64_t scales_stride() const { return G_pad + 4; }
};

#if defined(ZCODE_GEMV_AVX512)
// 16 activations as fp32 from fp32 or bf16 storage (masked past `count`).
inline __m512 load_f32(const float* x, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, x); }
inline __m512 load_f32(const at::BFloat16* x, __mmask16 mask) {
  const __m256i h = _mm256_maskz_loadu_epi16(mask, x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// x [M, K_in] -> int8 codes [M, K] per token, as zcode.quant.formats.quantize_per_token does:
// scale = max(amax / 127, min_scale), q = round-half-even(x / scale) (IEEE division, as torch),
// zero-padded to K.
template <typename T>
std::vector<int8_t> quantize_per_token(const T* x, int64_t M, int64_t K_in, int64_t K,
                                       double min_scale, float* x_scale) {
  std::vector<int8_t> codes(M * K, 0);
  const __m512 qmax = _mm512_set1_ps(127.f), qmin = _mm512_set1_ps(-127.f);
  for (int64_t m = 0; m < M; ++m) {
    const T* xr = x + m * K_in;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K_in; k += 16) {
      const __mmask16 mask = K_in - k >= 16 ? 0xFFFF : (1u << (K_in - k)) - 1;
      amax = _mm512_max_ps(amax, _mm512_abs_ps(load_f32(xr + k, mask)));
    }
    const float scale = std::max(_mm512_reduce_max_ps(amax) / 127.f, static_cast<float>(min_scale));
    x_scale[m] = scale;
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t k = 0; k < K_in; k += 16) {
      const __mmask16 mask = K_in - k >= 16 ? 0xFFFF : (1u << (K_in - k)) - 1;
      __m512 q = _mm512_roundscale_ps(_mm512_div_ps(load_f32(xr + k, mask), sv),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q = _mm512_min_ps(_mm512_max_ps(q, qmin), qmax);
      _mm512_mask_cvtepi32_storeu_epi8(codes.data() + m * K + k, mask, _mm512_cvtps_epi32(q));
    }
  }
  return codes;
}
#else
// quantize_per_token in plain loops: the same IEEE division and rounding, the same codes.
template <typename T>
std::vector<int8_t> quantize_per_token(const T* x, int64_t M, int64_t K_in, int64_t K,
                                       double min_scale, float* x_scale) {
  std::vector<int8_t> codes(M * K, 0);
  for (int64_t m = 0; m < M; ++m) {
    const T* xr = x + m * K_in;
    float amax = 0.f;
    for (int64_t k = 0; k < K_in; ++k) amax = std::max(amax, std::fabs(static_cast<float>(xr[k])));
    const float scale = std::max(amax / 127.f, static_cast<float>(min_scale));
    x_scale[m] = scale;
    for (int64_t k = 0; k < K_in; ++k) {
      const float q = std::nearbyint(static_cast<float>(xr[k]) / scale);
      codes[m * K + k] = static_cast<int8_t>(std::min(std::max(q, -127.f), 127.f));
    }
  }
  return codes;
}
#endif

// x [M, K_in] fp32 or bf16 -> per-token int8 codes [M, K] and their scales.
std::vector<int8_t> quantize_rows(const torch::Tensor& x, int64_t K, double min_scale,
                                  float* x_scale) {
  const int64_t M = x.size(0), K_in = x.size(1);
  if (x.scalar_type() == at::kBFloat16)
    return quantize_per_token(x.data_ptr<at::BFloat16>(), M, K_in, K, min_scale, x_scale);
  auto xf = x.to(at::kFloat).contiguous();
  return quantize_per_token(xf.data_ptr<float>(), M, K_in, K, min_scale, x_scale);
}

W4A8Activations rearrange_for_w4a8(const std::vector<int8_t>& codes, int64_t M, int64_t K,
                                   int64_t group) {
  const int64_t G_pad = (K / group + 15) / 16 * 16;
  W4A8Activations a{std::vector<int8_t>(M * K), std::vector<float>(M * G_pad, 0.f), G_pad};
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* cr = codes.data() + m * K;
    int8_t* dr = a.deinterleaved.data() + m * K;
    for (int64_t c = 0; c < K; c += 128) {
      const int64_t half = std::min<int64_t>(128, K - c) / 2;
      for (int64_t j = 0; j < half; ++j) {
        dr[c + j] = cr[c + 2 * j];
        dr[c + half + j] = cr[c + 2 * j + 1];
      }
    }
    for (int64_t g = 0; g < K / group; ++g) {
      int32_t sum = 0;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) sum += cr[k];
      a.group_sums[m * G_pad + g] = static_cast<float>(sum);
    }
  }
  return a;
}

#if defined(ZCODE_GEMV_AVX512_VNNI)
// out[m * N + r] for R consecutive W4A8 rows from row n of one matrix (pairs: its scale and
// zero words, q: its nibbles): R rows at a time share the activation loads and give the core
// independent chains to overlap.
template <int M, int R>
inline void w4a8_dot_rows(const W4A8Activations& a, const float* x_scale, const int32_t* pairs,
                          const uint8_t* q, float* out, int64_t K, int64_t N, int64_t G,
                          int group_shift, __m512i lane_group, float* scales) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i high16 = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m512 bias[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) bias[r][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g += 16) {
    const __mmask16 mask = G - g >= 16 ? 0xFFFF : (1u << (G - g)) - 1;
    for (int r = 0; r < R; ++r) {
      prefetch_l2(pairs + r * G + g);
      const __m512i v = _mm512_maskz_loadu_epi32(mask, pairs + r * G + g);
      const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(v, high16));
      _mm512_storeu_ps(scales + r * a.scales_stride() + g, scale);
      const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), scale, zero);  // zero - 8 scale
      for (int m = 0; m < M; ++m)
        bias[r][m] = _mm512_fmadd_ps(
            offset, _mm512_loadu_ps(a.group_sums.data() + m * a.G_pad + g), bias[r][m]);
    }
  }
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < K; c += 128) {
    const int64_t half = std::min<int64_t>(128, K - c) / 2;  // bytes of nibbles: 64, 32 or 16
    const __mmask64 mask = half == 64 ? ~0ull : (1ull << half) - 1;
    __m512i xlo[M], xhi[M];
    for (int m = 0; m < M; ++m) {
      const int8_t* xr = a.deinterleaved.data() + m * K + c;
      xlo[m] = _mm512_maskz_loadu_epi8(mask, xr);
      xhi[m] = _mm512_maskz_loadu_epi8(mask, xr + half);
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* qr = q + r * (K / 2) + c / 2;
      prefetch_l2(qr);
      const __m512i bytes = _mm512_maskz_loadu_epi8(mask, qr);
      const __m512i lo = _mm512_and_si512(bytes, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
      const __m512 scale = _mm512_permutexvar_ps(
          lane_group, _mm512_castps128_ps512(
                          _mm_loadu_ps(scales + r * a.scales_stride() + (c >> 5 >> group_shift))));
      for (int m = 0; m < M; ++m) {
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo[m]);
        dot = _mm512_dpbusd_epi32(dot, hi, xhi[m]);
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m)
      out[m * N + r] = x_scale[m] * _mm512_reduce_add_ps(_mm512_add_ps(acc[r][m], bias[r][m]));
}

template <int M>
void gemv_w4a8_rows(const W4A8Activations& a, const float* x_scale,
                    const std::vector<const uint8_t*>& qs, const std::vector<const uint16_t*>& szs,
                    const Rows& rows, float* out, int64_t K, int64_t group) {
  // Weight rows per step: at one activation row 8 (L2-resident 3072 x 576, one thread: 24.2 ns a
  // row one at a time, 19.8 by 2, 17.4 by 4, 16.4 by 8); fewer as M's accumulators take registers.
  constexpr int R = M == 1 ? 8 : (M == 2 ? 4 : 2);
  const int64_t G = K / group, N = rows.total();
  const int group_shift = __builtin_ctzll(group / 32);  // group = 32 << group_shift
  // Lane i of a 128-k chunk sums k in [c + 8i, c + 8i + 8): group c / group + (i / 4 >> shift).
  alignas(64) int32_t lane_group_idx[16];
  for (int i = 0; i < 16; ++i) lane_group_idx[i] = (i / 4) >> group_shift;
  const __m512i lane_group = _mm512_load_si512(lane_group_idx);
  rows.parallel(grain_rows(K / 2), [&](size_t s, int64_t r0, int64_t r1) {
    std::vector<float> scales(R * a.scales_stride(), 0.f);
    // One (scale, zero) bf16 pair per group is one 32-bit word: scale low, zero high.
    const int32_t* pairs = reinterpret_cast<const int32_t*>(szs[s]);
    float* o = out + rows.offsets[s];
    int64_t n = r0;
    for (; n + R <= r1; n += R)
      w4a8_dot_rows<M, R>(a, x_scale, pairs + n * G, qs[s] + n * (K / 2), o + n, K, N, G,
                          group_shift, lane_group, scales.data());
    for (; n < r1; ++n)
      w4a8_dot_rows<M, 1>(a, x_scale, pairs + n * G, qs[s] + n * (K / 2), o + n, K, N, G,
                          group_shift, lane_group, scales.data());
  });
}

// W8A8: x codes shifted to unsigned (xq + 128) times int8 weights by vpdpbusd, 64 per
// instruction; out = x_scale * scale_n * (sum_k (xq_k + 128) q_k - 128 * sum_k q_k).
template <int M>
void gemv_w8a8_rows(const std::vector<uint8_t>& xu, const float* x_scale,
                    const std::vector<const int8_t*>& qs, const std::vector<const uint16_t*>& scales,
                    const std::vector<const int32_t*>& row_sums, const Rows& rows, float* out,
                    int64_t K) {
  const int64_t N = rows.total();
  rows.parallel(grain_rows(K), [&](size_t s, int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n) {
      const int8_t* qr = qs[s] + n * K;
      __m512i acc[M];
      for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_si512();
      for (int64_t k = 0; k < K; k += 64) {
        const __mmask64 mask = K - k >= 64 ? ~0ull : (1ull << (K - k)) - 1;
        prefetch_l2(qr + k);
        const __m512i w = _mm512_maskz_loadu_epi8(mask, qr + k);
        for (int m = 0; m < M; ++m)
          acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_maskz_loadu_epi8(mask, xu.data() + m * K + k), w);
      }
      const float scale = bf16_to_float(scales[s][n]);
      float* o = out + rows.offsets[s] + n;
      for (int m = 0; m < M; ++m) {
        const int32_t dot = _mm512_reduce_add_epi32(acc[m]) - 128 * row_sums[s][n];
        o[m * N] = x_scale[m] * scale * static_cast<float>(dot);
      }
    }
  });
}
#else
// Prefetches a weight row's bytes PREFETCH_BYTES ahead, one per cache line, as the AVX-512 loops
// do per vector.
inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) prefetch_l2(static_cast<const char*>(p) + i);
}

// W4A8 in plain loops: per 32 k (16 bytes of nibbles: the even k's low nibbles against the
// deinterleaved even codes, the odd k's high nibbles against the odd) an exact int32 dot, scaled
// by its group's scale; the offsets (zero - 8 scale) times the groups' code sums.
template <int M>
void gemv_w4a8_rows(const W4A8Activations& a, const float* x_scale,
                    const std::vector<const uint8_t*>& qs, const std::vector<const uint16_t*>& szs,
                    const Rows& rows, float* out, int64_t K, int64_t group) {
  const int64_t G = K / group, N = rows.total();
  const int group_shift = __builtin_ctzll(group);
  rows.parallel(grain_rows(K / 2), [&](size_t s, int64_t r0, int64_t r1) {
    float* o = out + rows.offsets[s];
    for (int64_t n = r0; n < r1; ++n) {
      const uint16_t* sz = szs[s] + n * G * 2;  // (scale, zero) bf16 per group
      const uint8_t* qr = qs[s] + n * (K / 2);
      prefetch_row(qr, K / 2);
      float acc[M] = {};
      for (int64_t g = 0; g < G; ++g) {
        const float scale = bf16_to_float(sz[2 * g]), zero = bf16_to_float(sz[2 * g + 1]);
        for (int m = 0; m < M; ++m)
          acc[m] += (zero - 8.f * scale) * a.group_sums[m * a.G_pad + g];
      }
      for (int64_t c = 0; c < K; c += 128) {
        const int64_t half = std::min<int64_t>(128, K - c) / 2;
        for (int64_t i = 0; i < half; i += 16) {  // k in [c + 2i, c + 2i + 32): one group
          int8_t lo[16], hi[16];
          for (int j = 0; j < 16; ++j) lo[j] = qr[c / 2 + i + j] & 0x0F, hi[j] = qr[c / 2 + i + j] >> 4;
          const float scale = bf16_to_float(sz[2 * ((c + 2 * i) >> group_shift)]);
          for (int m = 0; m < M; ++m) {
            const int8_t* xr = a.deinterleaved.data() + m * K + c;
            const int32_t dot = dot_codes(lo, xr + i, 16) + dot_codes(hi, xr + half + i, 16);
            acc[m] += scale * static_cast<float>(dot);
          }
        }
      }
      for (int m = 0; m < M; ++m) o[m * N + n] = x_scale[m] * acc[m];
    }
  });
}

// W8A8 in plain loops: the same exact int32 sum of (xq + 128) q - 128 sum q.
template <int M>
void gemv_w8a8_rows(const std::vector<uint8_t>& xu, const float* x_scale,
                    const std::vector<const int8_t*>& qs, const std::vector<const uint16_t*>& scales,
                    const std::vector<const int32_t*>& row_sums, const Rows& rows, float* out,
                    int64_t K) {
  const int64_t N = rows.total();
  rows.parallel(grain_rows(K), [&](size_t s, int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n) {
      const int8_t* qr = qs[s] + n * K;
      prefetch_row(qr, K);
      const float scale = bf16_to_float(scales[s][n]);
      float* o = out + rows.offsets[s] + n;
      for (int m = 0; m < M; ++m) {
        const int32_t dot = dot_codes(qr, xu.data() + m * K, K) - 128 * row_sums[s][n];
        o[m * N] = x_scale[m] * scale * static_cast<float>(dot);
      }
    }
  });
}
#endif

template <template <int> class Fn, typename... Args>
void dispatch_rows(int64_t M, Args&&... args) {
  switch (M) {
    case 1: Fn<1>::run(args...); break;
    case 2: Fn<2>::run(args...); break;
    case 3: Fn<3>::run(args...); break;
    case 4: Fn<4>::run(args...); break;
    default: TORCH_CHECK(false, "gemv takes 1 to ", MAX_ROWS, " rows, got ", M);
  }
}

template <int M> struct W4A8Rows {
  template <typename... A> static void run(const A&... a) { gemv_w4a8_rows<M>(a...); }
};

template <int M> struct W8A8Rows {
  template <typename... A> static void run(const A&... a) { gemv_w8a8_rows<M>(a...); }
};

const uint16_t* bits(const torch::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

// Checks a list of weights sharing the input: each [N_s, K] contiguous of `dtype`.
void check_weights(const char* op, const std::vector<torch::Tensor>& ws, int64_t K,
                   at::ScalarType dtype) {
  TORCH_CHECK(!ws.empty(), op, ": needs at least one weight");
  for (const auto& w : ws)
    TORCH_CHECK(w.dim() == 2 && w.size(1) == K && w.scalar_type() == dtype && w.is_contiguous(),
                op, ": each weight must be a contiguous [N, ", K, "] ", dtype, " matrix, got ",
                w.sizes(), " ", w.scalar_type());
}

void check_rows(int64_t M, int64_t max_rows = MAX_ROWS) {
  TORCH_CHECK(M >= 1 && M <= max_rows, "gemv takes 1 to ", max_rows, " rows, got ", M);
}

template <typename T>
std::vector<const T*> pointers(const std::vector<torch::Tensor>& ts) {
  std::vector<const T*> out;
  for (const auto& t : ts) out.push_back(static_cast<const T*>(t.data_ptr()));
  return out;
}

std::vector<int64_t> num_rows(const std::vector<torch::Tensor>& ws) {
  std::vector<int64_t> n;
  for (const auto& w : ws) n.push_back(w.size(0));
  return n;
}

}  // namespace

torch::Tensor gemv_bf16(const torch::Tensor& x, const std::vector<torch::Tensor>& ws) {
  // x: [M, K] float (rounded to bf16), ws: bf16 [N_s, K] -> [M, sum N_s] fp32
  TORCH_CHECK(x.dim() == 2 && x.is_floating_point(), "gemv_bf16: x must be 2-D float");
  const int64_t M = x.size(0), K = x.size(1);
  check_rows(M, MAX_FLOAT_ROWS);
  check_weights("gemv_bf16", ws, K, at::kBFloat16);
  const Rows rows(num_rows(ws));
  auto xc = x.to(at::kBFloat16).contiguous();
  auto out = torch::empty({M, rows.total()}, x.options().dtype(at::kFloat));
  gemv_float_rows<Bf16Kernel>(bits(xc), M, pointers<uint16_t>(ws), rows, out.data_ptr<float>(), K);
  return out;
}

torch::Tensor gemv_f32(const torch::Tensor& x, const std::vector<torch::Tensor>& ws) {
  // x: [M, K] fp32, ws: fp32 [N_s, K] -> [M, sum N_s] fp32
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "gemv_f32: x must be 2-D fp32");
  const int64_t M = x.size(0), K = x.size(1);
  check_rows(M, MAX_FLOAT_ROWS);
  check_weights("gemv_f32", ws, K, at::kFloat);
  const Rows rows(num_rows(ws));
  auto xc = x.contiguous();
  auto out = torch::empty({M, rows.total()}, x.options());
  gemv_float_rows<F32Kernel>(xc.data_ptr<float>(), M, pointers<float>(ws), rows,
                             out.data_ptr<float>(), K);
  return out;
}

torch::Tensor gemv_w4a8(const torch::Tensor& x, const std::vector<torch::Tensor>& qweights,
                        const std::vector<torch::Tensor>& row_scales_and_zeros, int64_t group,
                        at::IntArrayRef out_features, double min_scale) {
  // x: [M, K_in] float, K_in <= K; per matrix s: qweight uint8 [N_pad_s, K / 2],
  // row_scales_and_zeros bf16 [N_pad_s, K / group, 2], out_features N_s <= N_pad_s
  // -> [M, sum N_s] fp32
  TORCH_CHECK(x.dim() == 2 && x.is_floating_point(), "gemv_w4a8: x must be 2-D float");
  TORCH_CHECK(!qweights.empty() && qweights.size() == row_scales_and_zeros.size() &&
                  qweights.size() == out_features.size(),
              "gemv_w4a8: one qweight, scale tensor and out_features per matrix");
  const int64_t M = x.size(0), K_in = x.size(1), K = qweights[0].size(1) * 2;
  check_rows(M);
  TORCH_CHECK(K_in <= K, "gemv_w4a8: x has ", K_in, " columns, the weight ", K);
  TORCH_CHECK(group >= 32 && (group & (group - 1)) == 0 && K % group == 0,
              "gemv_w4a8: group must be a power of two >= 32 dividing K");
  check_weights("gemv_w4a8", qweights, K / 2, at::kByte);
  for (size_t s = 0; s < qweights.size(); ++s) {
    const auto& sz = row_scales_and_zeros[s];
    TORCH_CHECK(sz.is_contiguous() && sz.scalar_type() == at::kBFloat16 && sz.dim() == 3 &&
                    sz.size(0) == qweights[s].size(0) && sz.size(1) == K / group &&
                    sz.size(2) == 2 && out_features[s] >= 0 &&
                    out_features[s] <= qweights[s].size(0),
                "gemv_w4a8: row_scales_and_zeros or out_features of matrix ", s);
  }
  const Rows rows(out_features.vec());
  float x_scale[MAX_ROWS];
  const W4A8Activations a =
      rearrange_for_w4a8(quantize_rows(x.contiguous(), K, min_scale, x_scale), M, K, group);
  auto out = torch::empty({M, rows.total()}, x.options().dtype(at::kFloat));
  dispatch_rows<W4A8Rows>(M, a, x_scale, pointers<uint8_t>(qweights),
                          pointers<uint16_t>(row_scales_and_zeros), rows, out.data_ptr<float>(), K,
                          group);
  return out;
}

torch::Tensor gemv_w8a8(const torch::Tensor& x, const std::vector<torch::Tensor>& qweights,
                        const std::vector<torch::Tensor>& scales,
                        const std::vector<torch::Tensor>& row_sums, double min_scale) {
  // x: [M, K_in] float, K_in <= K; per matrix s: qweight int8 [N_s, K], scales bf16 [N_s],
  // row_sums int32 [N_s] (sum of each row's codes) -> [M, sum N_s] fp32
  TORCH_CHECK(x.dim() == 2 && x.is_floating_point(), "gemv_w8a8: x must be 2-D float");
  TORCH_CHECK(!qweights.empty() && qweights.size() == scales.size() &&
                  qweights.size() == row_sums.size(),
              "gemv_w8a8: one qweight, scale and row-sum tensor per matrix");
  const int64_t M = x.size(0), K_in = x.size(1), K = qweights[0].size(1);
  check_rows(M);
  TORCH_CHECK(K_in <= K, "gemv_w8a8: x has ", K_in, " columns, the weight ", K);
  check_weights("gemv_w8a8", qweights, K, at::kChar);
  for (size_t s = 0; s < qweights.size(); ++s) {
    const int64_t N = qweights[s].size(0);
    TORCH_CHECK(scales[s].is_contiguous() && scales[s].scalar_type() == at::kBFloat16 &&
                    scales[s].numel() == N && row_sums[s].is_contiguous() &&
                    row_sums[s].scalar_type() == at::kInt && row_sums[s].numel() == N,
                "gemv_w8a8: scales and row_sums of matrix ", s);
  }
  const Rows rows(num_rows(qweights));
  float x_scale[MAX_ROWS];
  const std::vector<int8_t> codes = quantize_rows(x.contiguous(), K, min_scale, x_scale);
  std::vector<uint8_t> xu(codes.size());
  for (size_t i = 0; i < codes.size(); ++i) xu[i] = static_cast<uint8_t>(codes[i] + 128);
  auto out = torch::empty({M, rows.total()}, x.options().dtype(at::kFloat));
  dispatch_rows<W8A8Rows>(M, xu, x_scale, pointers<int8_t>(qweights), pointers<uint16_t>(scales),
                          pointers<int32_t>(row_sums), rows, out.data_ptr<float>(), K);
  return out;
}

// Registered with the dispatcher (no Python on the call path): torch.ops.zcode.gemv_*.
TORCH_LIBRARY(zcode, m) {
  m.def("gemv_bf16(Tensor x, Tensor[] ws) -> Tensor");
  m.def("gemv_f32(Tensor x, Tensor[] ws) -> Tensor");
  m.def("gemv_w4a8(Tensor x, Tensor[] qweights, Tensor[] row_scales_and_zeros, int group, "
        "int[] out_features, float min_scale) -> Tensor");
  m.def("gemv_w8a8(Tensor x, Tensor[] qweights, Tensor[] scales, Tensor[] row_sums, "
        "float min_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(zcode, CPU, m) {
  m.impl("gemv_bf16", &gemv_bf16);
  m.impl("gemv_f32", &gemv_f32);
  m.impl("gemv_w4a8", &gemv_w4a8);
  m.impl("gemv_w8a8", &gemv_w8a8);
}
