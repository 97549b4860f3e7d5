// Decode attention over the paged KV cache in one call: one query per sequence reads its context
// straight from the cache's slots (no gathered copy), for any CPU (plain loops gcc vectorizes).
//
// At decode a layer's attention is a few thousand multiply-adds per head: in eager PyTorch the
// gather of the context and SDPA's set-up cost ~75 us a layer (SmolLM2, 150 positions), ~25x
// the arithmetic. Same math as zcode.layers.attention.padded_attention, in fp32:
//   scores_l = scale q . k_l for the allowed positions l, p = softmax(scores), out = sum_l p_l v_l.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
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
template <typename T>
void attend(const T* q, const T* cache, const int64_t* slots, const bool* allowed, int64_t L,
            int64_t G, int64_t D, int64_t slot_stride, int64_t kv_offset, int64_t head_offset,
            float scale, std::vector<float>& scores, T* out) {
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
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<T>(acc[g * D + d] * inv);
  }
}

template <typename T>
void attend_all(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& slots,
                const bool* allowed, float scale, torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = cache.size(3);
  const int64_t L = slots.size(1), G = H / KVH;
  const int64_t slot_stride = 2 * KVH * D, kv_offset = KVH * D;
  const int64_t task_bytes = std::max<int64_t>(1, L * 2 * D * static_cast<int64_t>(sizeof(T)));
  const T* q_data = q.data_ptr<T>();
  const T* cache_data = cache.data_ptr<T>();
  const int64_t* slot_data = slots.data_ptr<int64_t>();
  T* out_data = out.data_ptr<T>();
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
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "paged_decode_attention: q and kv_cache must both be fp32 or bf16");
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
  if (q.scalar_type() == at::kFloat)
    attend_all<float>(qc, kv_cache, slots, allowed_data, static_cast<float>(scale), out);
  else
    attend_all<at::BFloat16>(qc, kv_cache, slots, allowed_data, static_cast<float>(scale), out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(zcode, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor context_slots, Tensor? mask, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(zcode, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
