// Decode attention over the paged KV cache in one call: one query per sequence reads its context
// straight from the cache's slots (no gathered copy).
//
// At decode a layer's attention is a few thousand multiply-adds per head: in eager PyTorch the
// gather of the context and SDPA's set-up cost ~75 us a layer (SmolLM2, 150 positions), ~25x
// the arithmetic. Same math as zcode.layers.attention.padded_attention, in fp32:
//   scores_l = scale q . k_l for the allowed positions l, p = softmax(scores), out = sum_l p_l v_l.
//
// Queries and output are fp32 or bf16 (the dtype the model computes in); the cache is that
// dtype, or a narrower one than fp32 queries (EngineConfig.kv_cache_dtype: bf16 or fp16, widened
// exactly as it is read).
//
// AVX-512 F/BW/VL (fp32, bf16 and fp16 caches, head dims of 16 lanes' multiples): a task is one
// sequence's chunk of positions for every head (chunks on a fixed grid, so a query's result is
// the same in any call), so one sequence's context spreads over the threads too
// (flash-decoding); a task keeps its chunk's max score, exp-sum and unnormalized output per query
// head, merged after. The keys of 16 positions are transposed once per KV head and every query
// head reading it scores them a lane per position (no horizontal sums), and each value vector is
// loaded once per 4 query heads: a KV head's keys and values are read once per chunk, not once
// per query head, which GLM's 12 query heads per KV head paid for. A polynomial exp (simd.h).
// Measured (warm caches, 2 threads, against one query head at a time with a horizontal sum per
// position): GLM-4.5-Air-shaped heads (24 over 2 KV heads of 128), 13 layers at 512 positions
// 1.18 -> 0.81 ms, at 4096 (from memory) 12.0 -> 8.8 ms; SmolLM2's (9 over 3 of 64), 30 layers
// at 128 positions 0.36 -> 0.34 ms. Every other CPU and head dim runs the portable loops (scalar
// exp, one task per sequence and KV head).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// A task reads at least this many bytes of keys and values: below it, forking the second thread
// costs more than the work (gemv.cpp measured ~64 KB).
constexpr int64_t GRAIN_BYTES = 64 << 10;

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

// q . k in 16 independent lanes (a float sum in one chain does not vectorize: no reassociation).
template <typename T>
inline float dot(const float* q, const T* k, int64_t D) {
  constexpr int64_t W = 16;
  float lanes[W] = {};
  int64_t d = 0;
  for (; d + W <= D; d += W)
    for (int64_t j = 0; j < W; ++j) lanes[j] += q[d + j] * to_float(k[d + j]);
  float s = 0.f;
  for (; d < D; ++d) s += q[d] * to_float(k[d]);
  for (int64_t j = 0; j < W; ++j) s += lanes[j];
  return s;
}

// One (sequence, KV head): the G query heads that share it, over the sequence's L slots.
template <typename T, typename TQ>
void attend(const TQ* q, const T* cache, const int64_t* slots, const bool* allowed, int64_t L,
            int64_t G, int64_t D, int64_t slot_stride, int64_t kv_offset, int64_t head_offset,
            float scale, std::vector<float>& scores, TQ* out) {
  // q: [G, D] (row stride D); cache slot s: keys at s * slot_stride + head_offset, values kv_offset
  // further; out: [G, D]
  scores.assign(L * G, 0.f);
  std::vector<float> qf(G * D);
  for (int64_t i = 0; i < G * D; ++i) qf[i] = to_float(q[i]);
  float best[64];  // G <= 64 (checked)
  std::fill(best, best + G, -std::numeric_limits<float>::infinity());
  for (int64_t l = 0; l < L; ++l) {
    if (allowed && !allowed[l]) continue;
    const T* k = cache + slots[l] * slot_stride + head_offset;
    for (int64_t g = 0; g < G; ++g) {
      const float s = dot(qf.data() + g * D, k, D) * scale;
      scores[l * G + g] = s;
      best[g] = std::max(best[g], s);
    }
  }
  std::vector<float> acc(G * D, 0.f);
  float total[64] = {};
  for (int64_t l = 0; l < L; ++l) {
    if (allowed && !allowed[l]) continue;
    const T* v = cache + slots[l] * slot_stride + kv_offset + head_offset;
    for (int64_t g = 0; g < G; ++g) {
      const float p = std::exp(scores[l * G + g] - best[g]);
      total[g] += p;
      float* ag = acc.data() + g * D;
      for (int64_t d = 0; d < D; ++d) ag[d] += p * to_float(v[d]);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    // A sequence with no allowed position attends to nothing: zeros (SDPA would give NaN).
    const float inv = total[g] > 0.f ? 1.f / total[g] : 0.f;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<TQ>(acc[g * D + d] * inv);
  }
}

template <typename T, typename TQ>
void attend_all_portable(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& slots,
                const bool* allowed, float scale, torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = cache.size(3);
  const int64_t L = slots.size(1), G = H / KVH;
  const int64_t slot_stride = 2 * KVH * D, kv_offset = KVH * D;
  const int64_t task_bytes = std::max<int64_t>(1, L * 2 * D * static_cast<int64_t>(sizeof(T)));
  const TQ* q_data = q.data_ptr<TQ>();
  const T* cache_data = cache.data_ptr<T>();
  const int64_t* slot_data = slots.data_ptr<int64_t>();
  TQ* out_data = out.data_ptr<TQ>();
  at::parallel_for(0, B * KVH, std::max<int64_t>(1, GRAIN_BYTES / task_bytes),
                   [&](int64_t t0, int64_t t1) {
    std::vector<float> scores;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / KVH, h = t % KVH;
      attend(q_data + (b * H + h * G) * D, cache_data, slot_data + b * L,
             allowed ? allowed + b * L : nullptr, L, G, D, slot_stride, kv_offset, h * D, scale,
             scores, out_data + (b * H + h * G) * D);
    }
  });
}

// ---- The vector path (AVX-512, or AVX2 + FMA + F16C): flash-decoding chunks of positions.

// Positions a task reads, on a fixed grid (0-127, 128-255, ...): one sequence of 1000 positions
// is 8 tasks. (32: up to 2x slower at 16 sequences, the tasks' fixed costs.)
constexpr int64_t CHUNK = 128;

// max(a, b), NaN if either is: a NaN score (corrupted KV) must reach the output, as it does
// through the portable loops and SDPA, so the engine's anomaly guard sees it.
inline float nan_max(float a, float b) { return (a > b || std::isnan(a)) ? a : b; }

// One task's partial softmax per query head: max score, exp-sum and unnormalized output.
struct Partial {
  float* best;  // [H]
  float* total;  // [H]
  float* acc;  // [H, D]
};

// Query heads sharing a KV head are scored and summed this many at a time: their accumulators
// stay in registers (NH x 2 for the scores, NH x up to 6 vectors for the values).
constexpr int64_t HEAD_GROUP = 4;

// fn(std::integral_constant<int, NH>{}) for the next group of the `left` heads of a KV head,
// NH = min(HEAD_GROUP, left): the group's size as a compile-time count.
template <typename Fn>
void head_group(int64_t left, const Fn& fn) {
  static_assert(HEAD_GROUP == 4, "one case per group size");
  switch (std::min(HEAD_GROUP, left)) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    default: return fn(std::integral_constant<int, 4>{});
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ZCODE_ATTENTION_VECTORS 1

constexpr int64_t LANES = 16;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {  // bf16 -> fp32: the bits move up 16
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const at::Half* p) {  // fp16 -> fp32, exact (F16C's AVX-512 form)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// max(row[0..n)), NaN if any is (as nan_max), -inf for n = 0.
inline float row_max(const float* row, int64_t n) {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 x = _mm512_mask_loadu_ps(best, m, row + i);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, x);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(best);
}

// rows[i] <- column i of the 16 x 16 matrix whose rows were rows[0..15].
inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {  // 32-bit pairs
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // 64-bit pairs
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes, then 256-bit halves
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
  }
}

// Scores of NH query heads q [NH, D] for a block of 16 positions, keys_t [D, 16] (their keys,
// transposed): a lane per position, so no horizontal sums; two partial sums per head (even and
// odd d) keep 2 * NH multiply-add chains in flight. Positions not `live` (masked out) score
// -inf; the first m lanes are stored (row stride CHUNK).
template <int NH, int64_t D>
void block_scores(const float* q, const float* keys_t, float scale, __mmask16 live, int64_t m,
                  float* out) {
  __m512 a[NH][2];
  for (int g = 0; g < NH; ++g) a[g][0] = a[g][1] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 2) {
    const __m512 k0 = _mm512_load_ps(keys_t + d * 16), k1 = _mm512_load_ps(keys_t + (d + 1) * 16);
    for (int g = 0; g < NH; ++g) {
      a[g][0] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * D + d]), k0, a[g][0]);
      a[g][1] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * D + d + 1]), k1, a[g][1]);
    }
  }
  const __mmask16 stored = m >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << m) - 1);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int g = 0; g < NH; ++g) {
    const __m512 s = _mm512_mul_ps(_mm512_add_ps(a[g][0], a[g][1]), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(out + g * CHUNK, stored, _mm512_mask_mov_ps(neg_inf, live, s));
  }
}

// acc[g] = sum_i p[g][i] v_i for NH query heads of one KV head over a chunk's n positions
// (p: rows of `scores`, stride CHUNK; values at value_offset in each slot): a position every head
// of the group weighs 0 (masked out, or underflowed) is not read; for each head and vector the
// products add in position order, as one head at a time would.
template <int NH, int VECS, typename T>
void accumulate_values(const float* p, const T* cache, const int64_t* slots, int64_t n,
                       int64_t slot_stride, int64_t value_offset, float* acc) {
  constexpr int64_t D = 16 * VECS;
  // vectors of a head's D per pass: NH x BLOCK accumulators and BLOCK values in 32 registers
  constexpr int BLOCK = VECS <= 6 ? VECS : VECS % 4 == 0 ? 4 : VECS % 2 == 0 ? 2 : 1;
  static_assert(VECS % BLOCK == 0, "the blocks of a head's vectors tile it");
  for (int v0 = 0; v0 < VECS; v0 += BLOCK) {
    __m512 a[NH][BLOCK];
    for (int g = 0; g < NH; ++g)
      for (int j = 0; j < BLOCK; ++j) a[g][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      bool weighed = false;
      for (int g = 0; g < NH; ++g) weighed |= p[g * CHUNK + i] != 0.f;
      if (!weighed) continue;
      const T* val = cache + slots[i] * slot_stride + value_offset + 16 * v0;
      __m512 v[BLOCK];
      for (int j = 0; j < BLOCK; ++j) v[j] = load16(val + 16 * j);
      for (int g = 0; g < NH; ++g) {
        const __m512 w = _mm512_set1_ps(p[g * CHUNK + i]);
        for (int j = 0; j < BLOCK; ++j) a[g][j] = _mm512_fmadd_ps(w, v[j], a[g][j]);
      }
    }
    for (int g = 0; g < NH; ++g)
      for (int j = 0; j < BLOCK; ++j) _mm512_storeu_ps(acc + g * D + 16 * (v0 + j), a[g][j]);
  }
}

// Positions [l0, l1) of one sequence, every head: qf [H, D] fp32 queries (H = KVH * G, query
// head kvh * G + g reads KV head kvh), D = 16 * VECS. A slot's keys (then values) of all KV heads
// are adjacent, so a task streams whole slots.
template <int VECS, typename T>
void attend_chunk(const float* qf, const T* cache, const int64_t* slots, const bool* allowed,
                  int64_t l0, int64_t l1, int64_t KVH, int64_t G, float scale, float* scores,
                  const T* zero_keys, Partial part) {
  // scores: scratch [H, CHUNK]; zero_keys: KVH * D zeros
  constexpr int64_t D = 16 * VECS;
  const int64_t H = KVH * G, n = l1 - l0, slot_stride = 2 * KVH * D;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  alignas(64) float keys_t[D * 16];  // [D, 16]: a block's keys of one KV head, transposed
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - i0);
    __mmask16 live = 0;  // positions of the block with a key to read
    for (int64_t j = 0; j < m; ++j)
      live |= static_cast<__mmask16>(!allowed || allowed[l0 + i0 + j]) << j;
    const T* key_rows[16];  // a masked position's keys are not read: zeros instead
    for (int j = 0; j < 16; ++j)
      key_rows[j] = live >> j & 1 ? cache + slots[l0 + i0 + j] * slot_stride : zero_keys;
    for (int64_t kvh = 0; kvh < KVH; ++kvh) {
      for (int v = 0; v < VECS; ++v) {
        __m512 rows[16];
        for (int j = 0; j < 16; ++j) rows[j] = load16(key_rows[j] + kvh * D + 16 * v);
        transpose16(rows);
        for (int d = 0; d < 16; ++d) _mm512_store_ps(keys_t + (16 * v + d) * 16, rows[d]);
      }
      for (int64_t h = kvh * G; h < (kvh + 1) * G; h += HEAD_GROUP)
        head_group((kvh + 1) * G - h, [&](auto heads) {
          block_scores<decltype(heads)::value, D>(qf + h * D, keys_t, scale, live, m,
                                                   scores + h * CHUNK + i0);
        });
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    float* row = scores + h * CHUNK;
    const float best = row_max(row, n);
    part.best[h] = best;
    __m512 total = _mm512_setzero_ps();
    if (best != neg_inf) {
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
        const __m512 x = _mm512_maskz_loadu_ps(m, row + i);
        const __mmask16 live = _mm512_mask_cmp_ps_mask(m, x, _mm512_set1_ps(neg_inf), _CMP_NEQ_UQ);
        const __m512 e = zcode_simd::exp_ps(_mm512_sub_ps(x, _mm512_set1_ps(best)));
        const __m512 p = _mm512_maskz_mov_ps(live, e);
        _mm512_mask_storeu_ps(row + i, m, p);
        total = _mm512_add_ps(total, p);
      }
    } else {  // no allowed position in this chunk: weights 0 (the value sums read every row)
      std::fill(row, row + n, 0.f);
    }
    part.total[h] = _mm512_reduce_add_ps(total);
  }
  // acc[h] = sum_i p[h][i] v_i, a group of query heads at a time: each value vector is loaded
  // once per group, not once per head (GLM-4.5's 12 query heads per KV head re-read a chunk's
  // values, 128 KB, from L2 12 times).
  for (int64_t kvh = 0; kvh < KVH; ++kvh)
    for (int64_t h = kvh * G; h < (kvh + 1) * G; h += HEAD_GROUP)
      head_group((kvh + 1) * G - h, [&](auto heads) {
        accumulate_values<decltype(heads)::value, VECS>(scores + h * CHUNK, cache, slots + l0, n,
                                                        slot_stride, (KVH + kvh) * D,
                                                        part.acc + h * D);
      });
}

// Head dims (in vectors of LANES) with a kernel: multiples of 16 up to 128, 192, 256.
#define ZCODE_HEAD_DIMS(X) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(12) X(16)

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ZCODE_ATTENTION_VECTORS 1

// AVX2: the same tasks in 8 lanes: blocks of 8 positions, keys transposed 8 x 8. A block's lanes
// past the chunk's end score -inf, so the loops over a chunk's scores run whole vectors (a
// row's CHUNK floats hold them: CHUNK is a multiple of 8).
constexpr int64_t LANES = 8;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // bf16 -> fp32: the bits move up 16
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const at::Half* p) {  // fp16 -> fp32, exact (F16C)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// max(row[0..n)) over whole vectors (the lanes past n hold -inf), NaN if any is (as nan_max).
inline float row_max(const float* row, int64_t n) {
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int nan = 0;
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 x = _mm256_loadu_ps(row + i);
    nan |= _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    best = _mm256_max_ps(best, x);
  }
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(best), _mm256_extractf128_ps(best, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// rows[i] <- column i of the 8 x 8 matrix whose rows were rows[0..7].
inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8];
  for (int i = 0; i < 4; ++i) {  // 32-bit pairs
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // 64-bit pairs
    r[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {  // 128-bit halves
    const __m256 a = r[j], b = r[4 + j];
    r[j] = _mm256_permute2f128_ps(a, b, 0x20);
    r[4 + j] = _mm256_permute2f128_ps(a, b, 0x31);
  }
}

// Scores of NH query heads q [NH, D] for a block of 8 positions, keys_t [D, 8] (their keys,
// transposed), as the AVX-512 block_scores; positions not `live` (bit j: position j) score -inf.
template <int NH, int64_t D>
void block_scores(const float* q, const float* keys_t, float scale, int live, float* out) {
  __m256 a[NH][2];
  for (int g = 0; g < NH; ++g) a[g][0] = a[g][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 2) {
    const __m256 k0 = _mm256_load_ps(keys_t + d * 8), k1 = _mm256_load_ps(keys_t + (d + 1) * 8);
    for (int g = 0; g < NH; ++g) {
      a[g][0] = _mm256_fmadd_ps(_mm256_set1_ps(q[g * D + d]), k0, a[g][0]);
      a[g][1] = _mm256_fmadd_ps(_mm256_set1_ps(q[g * D + d + 1]), k1, a[g][1]);
    }
  }
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 is_live = _mm256_castsi256_ps(
      _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(live), lane_bit), lane_bit));
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int g = 0; g < NH; ++g) {
    const __m256 s = _mm256_mul_ps(_mm256_add_ps(a[g][0], a[g][1]), _mm256_set1_ps(scale));
    _mm256_storeu_ps(out + g * CHUNK, _mm256_blendv_ps(neg_inf, s, is_live));
  }
}

// acc[g] = sum_i p[g][i] v_i for NH query heads of one KV head, as the AVX-512 one.
template <int NH, int VECS, typename T>
void accumulate_values(const float* p, const T* cache, const int64_t* slots, int64_t n,
                       int64_t slot_stride, int64_t value_offset, float* acc) {
  constexpr int64_t D = 8 * VECS;
  // vectors of a head's D per pass: NH x BLOCK accumulators and BLOCK values in 16 registers
  constexpr int BLOCK = VECS % 3 == 0 ? 3 : VECS % 2 == 0 ? 2 : 1;
  for (int v0 = 0; v0 < VECS; v0 += BLOCK) {
    __m256 a[NH][BLOCK];
    for (int g = 0; g < NH; ++g)
      for (int j = 0; j < BLOCK; ++j) a[g][j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      bool weighed = false;
      for (int g = 0; g < NH; ++g) weighed |= p[g * CHUNK + i] != 0.f;
      if (!weighed) continue;
      const T* val = cache + slots[i] * slot_stride + value_offset + 8 * v0;
      __m256 v[BLOCK];
      for (int j = 0; j < BLOCK; ++j) v[j] = load8(val + 8 * j);
      for (int g = 0; g < NH; ++g) {
        const __m256 w = _mm256_set1_ps(p[g * CHUNK + i]);
        for (int j = 0; j < BLOCK; ++j) a[g][j] = _mm256_fmadd_ps(w, v[j], a[g][j]);
      }
    }
    for (int g = 0; g < NH; ++g)
      for (int j = 0; j < BLOCK; ++j) _mm256_storeu_ps(acc + g * D + 8 * (v0 + j), a[g][j]);
  }
}

// Positions [l0, l1) of one sequence, every head (see the AVX-512 attend_chunk); D = 8 * VECS.
template <int VECS, typename T>
void attend_chunk(const float* qf, const T* cache, const int64_t* slots, const bool* allowed,
                  int64_t l0, int64_t l1, int64_t KVH, int64_t G, float scale, float* scores,
                  const T* zero_keys, Partial part) {
  // scores: scratch [H, CHUNK]; zero_keys: KVH * D zeros
  constexpr int64_t D = 8 * VECS;
  const int64_t H = KVH * G, n = l1 - l0, slot_stride = 2 * KVH * D;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  alignas(32) float keys_t[D * 8];  // [D, 8]: a block's keys of one KV head, transposed
  for (int64_t i0 = 0; i0 < n; i0 += 8) {
    const int64_t m = std::min<int64_t>(8, n - i0);
    int live = 0;  // positions of the block with a key to read
    for (int64_t j = 0; j < m; ++j) live |= static_cast<int>(!allowed || allowed[l0 + i0 + j]) << j;
    const T* key_rows[8];  // a masked position's keys are not read: zeros instead
    for (int j = 0; j < 8; ++j)
      key_rows[j] = live >> j & 1 ? cache + slots[l0 + i0 + j] * slot_stride : zero_keys;
    for (int64_t kvh = 0; kvh < KVH; ++kvh) {
      for (int v = 0; v < VECS; ++v) {
        __m256 rows[8];
        for (int j = 0; j < 8; ++j) rows[j] = load8(key_rows[j] + kvh * D + 8 * v);
        transpose8(rows);
        for (int d = 0; d < 8; ++d) _mm256_store_ps(keys_t + (8 * v + d) * 8, rows[d]);
      }
      for (int64_t h = kvh * G; h < (kvh + 1) * G; h += HEAD_GROUP)
        head_group((kvh + 1) * G - h, [&](auto heads) {
          block_scores<decltype(heads)::value, D>(qf + h * D, keys_t, scale, live,
                                                   scores + h * CHUNK + i0);
        });
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    float* row = scores + h * CHUNK;
    const float best = row_max(row, n);
    part.best[h] = best;
    __m256 total = _mm256_setzero_ps();
    if (best != neg_inf) {
      for (int64_t i = 0; i < n; i += 8) {
        const __m256 x = _mm256_loadu_ps(row + i);
        const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(neg_inf), _CMP_NEQ_UQ);
        const __m256 p = _mm256_and_ps(live, zcode_simd::exp_ps(_mm256_sub_ps(x, _mm256_set1_ps(best))));
        _mm256_storeu_ps(row + i, p);
        total = _mm256_add_ps(total, p);
      }
    } else {  // no allowed position in this chunk: weights 0 (the value sums read every row)
      std::fill(row, row + n, 0.f);
    }
    part.total[h] = zcode_simd::hsum(total);
  }
  for (int64_t kvh = 0; kvh < KVH; ++kvh)
    for (int64_t h = kvh * G; h < (kvh + 1) * G; h += HEAD_GROUP)
      head_group((kvh + 1) * G - h, [&](auto heads) {
        accumulate_values<decltype(heads)::value, VECS>(scores + h * CHUNK, cache, slots + l0, n,
                                                        slot_stride, (KVH + kvh) * D,
                                                        part.acc + h * D);
      });
}

// Head dims (in vectors of LANES) with a kernel: multiples of 16 up to 64, 96, 128, 192, 256.
#define ZCODE_HEAD_DIMS(X) X(2) X(4) X(6) X(8) X(12) X(16) X(24) X(32)

#endif

#if defined(ZCODE_ATTENTION_VECTORS)

template <int VECS, typename T, typename TQ>
void attend_vectors(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& slots,
                    const bool* allowed, float scale, torch::Tensor& out) {
  constexpr int64_t D = LANES * VECS;
  const int64_t B = q.size(0), H = q.size(1), KVH = cache.size(3);
  const int64_t L = slots.size(1), G = H / KVH;
  // Chunks on a fixed grid of positions, whatever the rows, their longest context or the
  // threads: a query's result is then that of the same query in any other call (a verifying
  // step's row is the decode step's at its position, bit for bit: masked positions and empty
  // chunks add exact zeros), so drafts leave greedy outputs as they are.
  const int64_t chunks = std::max<int64_t>(1, (L + CHUNK - 1) / CHUNK);
  const int64_t tasks = B * chunks, part_floats = H * (2 + D);
  const int64_t chunk_bytes = std::min(L, CHUNK) * 2 * KVH * D * static_cast<int64_t>(sizeof(T));
  const TQ* q_data = q.data_ptr<TQ>();
  const T* cache_data = cache.data_ptr<T>();
  const int64_t* slot_data = slots.data_ptr<int64_t>();
  std::vector<float> parts(tasks * part_floats);  // zeros: a chunk weighed 0 skips its acc
  auto part_of = [&](int64_t t) {
    float* p = parts.data() + t * part_floats;
    return Partial{p, p + H, p + 2 * H};
  };
  at::parallel_for(0, tasks, std::max<int64_t>(1, GRAIN_BYTES / chunk_bytes),
                   [&](int64_t t0, int64_t t1) {
    std::vector<float> qf(H * D), scores(H * CHUNK);
    const std::vector<T> zero_keys(KVH * D, T(0.f));
    int64_t loaded = -1;  // the sequence whose queries qf holds
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / chunks, c = t % chunks;
      if (b != loaded) {
        const TQ* qs = q_data + b * H * D;
        for (int64_t i = 0; i < H * D; ++i) qf[i] = static_cast<float>(qs[i]);
        loaded = b;
      }
      attend_chunk<VECS>(qf.data(), cache_data, slot_data + b * L,
                         allowed ? allowed + b * L : nullptr, c * CHUNK,
                         std::min(L, (c + 1) * CHUNK), KVH, G, scale, scores.data(), zero_keys.data(),
                         part_of(t));
    }
  });
  // Merge each sequence's chunks per query head: rescale to the largest max, normalize.
  TQ* out_data = out.data_ptr<TQ>();
  at::parallel_for(0, B * H, std::max<int64_t>(1, 4096 / (chunks * D)), [&](int64_t r0, int64_t r1) {
    std::vector<float> weight(chunks), sum(D);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / H, h = r % H;
      float best = -std::numeric_limits<float>::infinity(), total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) best = nan_max(best, part_of(b * chunks + c).best[h]);
      for (int64_t c = 0; c < chunks; ++c) {
        const Partial p = part_of(b * chunks + c);
        weight[c] = p.total[h] == 0.f ? 0.f : std::exp(p.best[h] - best);  // NaN stays NaN
        total += weight[c] * p.total[h];
      }
      // A sequence with no allowed position attends to nothing: zeros (SDPA would give NaN).
      const float inv = total == 0.f ? 0.f : 1.f / total;
      // chunk by chunk over the head's D sums (vectors; each sum adds its chunks in order)
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t c = 0; c < chunks; ++c) {
        const float w = weight[c], *acc = part_of(b * chunks + c).acc + h * D;
        for (int64_t d = 0; d < D; ++d) sum[d] += w * acc[d];
      }
      for (int64_t d = 0; d < D; ++d) out_data[r * D + d] = static_cast<TQ>(sum[d] * inv);
    }
  });
}

template <typename T, typename TQ>
void attend_all(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& slots,
                const bool* allowed, float scale, torch::Tensor& out) {
  switch (q.size(2)) {  // the head dims of ZCODE_HEAD_DIMS; others the portable loops
#define ZCODE_HEAD_DIM(VECS) \
    case LANES * VECS: return attend_vectors<VECS, T, TQ>(q, cache, slots, allowed, scale, out);
    ZCODE_HEAD_DIMS(ZCODE_HEAD_DIM)
#undef ZCODE_HEAD_DIM
    default: return attend_all_portable<T, TQ>(q, cache, slots, allowed, scale, out);
  }
}

#else


template <typename T, typename TQ>
void attend_all(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& slots,
                const bool* allowed, float scale, torch::Tensor& out) {
  attend_all_portable<T, TQ>(q, cache, slots, allowed, scale, out);
}

#endif

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& kv_cache,
                                     const torch::Tensor& context_slots,
                                     const c10::optional<torch::Tensor>& mask, double scale) {
  // q: [B, H, D]; kv_cache: [num_blocks, block_size, 2, KVH, D] (keys, values);
  // context_slots: int64 [B, L]; mask: bool [B, 1, 1, L] (True = may attend) or None -> [B, H, D]
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(2) == 2,
              "paged_decode_attention: q must be [B, H, D] and kv_cache [blocks, block_size, 2, "
              "KVH, D], got ", q.sizes(), " and ", kv_cache.sizes());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && KVH > 0 && H % KVH == 0 && H / KVH <= 64,
              "paged_decode_attention: ", H, " query heads of ", D, " over ", KVH, " KV heads of ",
              kv_cache.size(4));
  const auto q_type = q.scalar_type(), cache_type = kv_cache.scalar_type();
  TORCH_CHECK((q_type == at::kFloat &&
               (cache_type == at::kFloat || cache_type == at::kBFloat16 || cache_type == at::kHalf)) ||
                  (q_type == at::kBFloat16 && cache_type == at::kBFloat16),
              "paged_decode_attention: q fp32 over an fp32, bf16 or fp16 kv_cache, or both bf16; "
              "got ", q_type, " over ", cache_type);
  TORCH_CHECK(context_slots.dim() == 2 && context_slots.size(0) == B &&
                  context_slots.scalar_type() == at::kLong,
              "paged_decode_attention: context_slots must be int64 [B, L]");
  const int64_t L = context_slots.size(1);
  torch::Tensor allowed;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->numel() == B * L,
                "paged_decode_attention: mask must be bool [B, 1, 1, L]");
    allowed = mask->contiguous();
  }
  // The cache is read in place (a copy of it would cost more than the attention).
  TORCH_CHECK(kv_cache.is_contiguous(), "paged_decode_attention: kv_cache must be contiguous");
  const auto qc = q.contiguous(), slots = context_slots.contiguous();
  auto out = torch::empty_like(qc);
  const bool* allowed_data = allowed.defined() ? allowed.data_ptr<bool>() : nullptr;
  const float s = static_cast<float>(scale);
  if (q_type == at::kBFloat16)
    attend_all<at::BFloat16, at::BFloat16>(qc, kv_cache, slots, allowed_data, s, out);
  else if (cache_type == at::kFloat)
    attend_all<float, float>(qc, kv_cache, slots, allowed_data, s, out);
  else if (cache_type == at::kBFloat16)
    attend_all<at::BFloat16, float>(qc, kv_cache, slots, allowed_data, s, out);
  else
    attend_all<at::Half, float>(qc, kv_cache, slots, allowed_data, s, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(zcode, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor context_slots, Tensor? mask, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(zcode, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
