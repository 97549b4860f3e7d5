// Fused MoE experts for any CPU: one call computes every routed expert of a step,
// plus the shared experts, for fp32 or bf16 expert weights held as lists (one tensor per expert
// and projection, zero-copy views of the model's Linear weights):
//
//   out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = expert_ids[t, j]
//            (j with e = -1 skipped: an expert held by another rank under expert parallelism)
//          + sum_s down_s(silu(gate_s(x[t])) * up_s(x[t]))   for the num_shared last experts
//
// The tokens are grouped by expert once (a counting sort). An expert hit by at most MAX_ROWS
// tokens is a GEMV pass: its gate and up rows are streamed once, side by side, for all of its
// tokens, then (SiLU-mul between, the activation rounded to the weights' dtype once) its down
// rows once. Decode is memory-bound, so the two phases each run as one parallel region over the
// rows of every pass: phase 1 splits the gate/up rows, phase 2 the output columns, so a thread
// owns out[:, n0:n1] and adds the weighted down products there without a reduction.
// An expert hit by more tokens (prefill) is one GEMM per projection over its gathered tokens.
//
// ISA paths: the dot products are float_dot.h's (AVX-512, with vdpbf16ps where AVX512_BF16 is;
// AVX2 + FMA; portable loops), SiLU simd.h's.
// The passes, threading and GEMMs are shared.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "float_dot.h"
#include "simd.h"
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t MAX_ROWS = 8;  // tokens per GEMV pass; an expert with more takes GEMMs
// A parallel_for task reads at least this many weight bytes (forking costs as much as ~64 KB).
constexpr int64_t GRAIN_BYTES = 64 << 10;
using zcode_float_dot::Bf16;
using zcode_float_dot::dot_rows;
using zcode_float_dot::F32;

// act[m, i] = silu(gate[m, i]) * up[m, i], rounded to the weights' dtype once (to nearest even);
// gate_up [count, 2 I] is the scratch it is computed in.
template <typename F>
void silu_mul(float* gate_up, typename F::T* act, int64_t count, int64_t I) {
  for (int64_t m = 0; m < count; ++m) {
    float* gate = gate_up + m * 2 * I;
    zcode_simd::silu_mul(gate, gate + I, I, gate);
    for (int64_t i = 0; i < I; ++i) {
      if constexpr (std::is_same_v<typename F::T, float>)
        act[m * I + i] = gate[i];
      else
        act[m * I + i] = zcode_float_dot::float_to_bf16(gate[i]);
    }
  }
}

// One expert over up to MAX_ROWS of its tokens.
struct Pass {
  int64_t expert;  // index into the weight lists
  int64_t first;   // its assignments: tokens[first : first + count], gains likewise
  int64_t count;
  int64_t inter;   // the expert's intermediate size I
  int64_t act_offset;  // its activations [count, I] in the act buffer
};

template <typename F>
struct Experts {
  using T = typename F::T;
  std::vector<const T*> gate, up, down;  // per expert: [I, D], [I, D], [D, I]
  std::vector<int64_t> inter;
  int64_t D;

  void set(int64_t e, const torch::Tensor& g, const torch::Tensor& u, const torch::Tensor& d) {
    const int64_t I = g.size(0);
    for (const auto* t : {&g, &u, &d})
      TORCH_CHECK(t->dim() == 2 && t->scalar_type() == F::DTYPE && t->is_contiguous() &&
                      t->device().is_cpu(),
                  "moe_fused: expert ", e, "'s weights must be contiguous CPU ", F::DTYPE);
    TORCH_CHECK(g.size(1) == D && u.size(0) == I && u.size(1) == D && d.size(0) == D &&
                    d.size(1) == I,
                "moe_fused: expert ", e, "'s weight shapes");
    gate[e] = static_cast<const T*>(g.data_ptr());
    up[e] = static_cast<const T*>(u.data_ptr());
    down[e] = static_cast<const T*>(d.data_ptr());
    inter[e] = I;
  }
};

// Phase 1 for rows r0..r1 of one pass's gate (which = 0) or up (1) matrix:
// gate_up[m * 2I + which * I + r] = x_m . w_r, fp32.
template <typename F, int M>
void gate_up_rows(const Experts<F>& ex, const Pass& p, int which, const typename F::T* xg,
                  float* gate_up, int64_t r0, int64_t r1) {
  const int64_t D = ex.D, I = p.inter;
  const typename F::T* w = (which ? ex.up : ex.gate)[p.expert];
  float* o = gate_up + which * I;
  constexpr int R = M <= 4 ? 2 : 1;  // adjacent rows per step: one stream, shared x loads
  int64_t r = r0;
  for (; r + R <= r1; r += R) {
    float sums[R][M];
    dot_rows<F, M, R>(xg, w + r * D, sums, D);
    for (int i = 0; i < R; ++i)
      for (int m = 0; m < M; ++m) o[m * 2 * I + r + i] = sums[i][m];
  }
  for (; r < r1; ++r) {
    float sums[1][M];
    dot_rows<F, M, 1>(xg, w + r * D, sums, D);
    for (int m = 0; m < M; ++m) o[m * 2 * I + r] = sums[0][m];
  }
}

// Phase 2 for output columns n0..n1 of one pass: out[t_m, n] += gain_m * (act_m . down_n).
template <typename F, int M>
void down_cols(const Experts<F>& ex, const Pass& p, const typename F::T* act,
               const int64_t* tokens, const float* gains, float* out, int64_t n0, int64_t n1) {
  const int64_t D = ex.D, I = p.inter;
  const typename F::T* wd = ex.down[p.expert];
  constexpr int R = M <= 4 ? 2 : 1;
  int64_t n = n0;
  for (; n < n1; n += R) {
    const int rows = std::min<int64_t>(R, n1 - n);
    float sums[R][M];
    if (rows == R) {
      dot_rows<F, M, R>(act, wd + n * I, sums, I);
    } else {
      float one[1][M];
      dot_rows<F, M, 1>(act, wd + n * I, one, I);
      for (int m = 0; m < M; ++m) sums[0][m] = one[0][m];
    }
    for (int r = 0; r < rows; ++r)
      for (int m = 0; m < M; ++m)
        out[tokens[p.first + m] * D + n + r] += gains[p.first + m] * sums[r][m];
  }
}

template <typename F, int M>
struct Rows {
  static void gate_up(const Experts<F>& ex, const Pass& p, int which, const typename F::T* xg,
                      float* gate_up, int64_t r0, int64_t r1) {
    gate_up_rows<F, M>(ex, p, which, xg, gate_up, r0, r1);
  }
  static void down(const Experts<F>& ex, const Pass& p, const typename F::T* act,
                   const int64_t* tokens, const float* gains, float* out, int64_t n0, int64_t n1) {
    down_cols<F, M>(ex, p, act, tokens, gains, out, n0, n1);
  }
};

template <typename F, typename Fn>
void by_rows(int64_t M, const Fn& fn) {
  switch (M) {
    case 1: fn(Rows<F, 1>{}); break;
    case 2: fn(Rows<F, 2>{}); break;
    case 3: fn(Rows<F, 3>{}); break;
    case 4: fn(Rows<F, 4>{}); break;
    case 5: fn(Rows<F, 5>{}); break;
    case 6: fn(Rows<F, 6>{}); break;
    case 7: fn(Rows<F, 7>{}); break;
    case 8: fn(Rows<F, 8>{}); break;
    default: TORCH_CHECK(false, "moe_fused: a pass takes 1 to ", MAX_ROWS, " tokens");
  }
}

// The GEMV passes: phase 1 over the gate then up rows of every pass (as gemv.cpp over a list of
// matrices), SiLU-mul, then phase 2 over the output columns. xg: the passes' tokens gathered,
// [sum count, D]; out: fp32 [T, D], added to.
template <typename F>
void run_passes(const Experts<F>& ex, const std::vector<Pass>& passes, const typename F::T* xg,
                const std::vector<int64_t>& tokens, const std::vector<float>& gains, float* out) {
  if (passes.empty()) return;
  using T = typename F::T;
  const int64_t D = ex.D;
  // Matrix s = 2 * pass + which; its rows are numbered from row_offsets[s].
  std::vector<int64_t> row_offsets{0}, x_offsets{0};
  int64_t act_size = 0, down_bytes_per_col = 0;
  for (const Pass& p : passes) {
    for (int which = 0; which < 2; ++which) row_offsets.push_back(row_offsets.back() + p.inter);
    x_offsets.push_back(x_offsets.back() + p.count * D);
    act_size = std::max(act_size, p.act_offset + p.count * p.inter);
    down_bytes_per_col += p.inter * static_cast<int64_t>(sizeof(T));
  }
  // 64-byte aligned (torch's CPU allocator), as each row is: activation loads split no line.
  auto gate_up_t = torch::empty({2 * act_size}, at::kFloat);
  auto act_t = torch::empty({act_size}, F::DTYPE);
  float* gate_up = gate_up_t.data_ptr<float>();
  T* act = static_cast<T*>(act_t.data_ptr());
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  at::parallel_for(0, row_offsets.back(), std::max<int64_t>(16, GRAIN_BYTES / row_bytes),
                   [&](int64_t r0, int64_t r1) {
    size_t s =
        std::upper_bound(row_offsets.begin(), row_offsets.end(), r0) - row_offsets.begin() - 1;
    for (; r0 < r1; ++s) {
      const int64_t end = std::min(r1, row_offsets[s + 1]);
      const Pass& p = passes[s / 2];
      by_rows<F>(p.count, [&](auto rows) {
        rows.gate_up(ex, p, s % 2, xg + x_offsets[s / 2], gate_up + 2 * p.act_offset,
                     r0 - row_offsets[s], end - row_offsets[s]);
      });
      r0 = end;
    }
  });
  for (const Pass& p : passes)
    silu_mul<F>(gate_up + 2 * p.act_offset, act + p.act_offset, p.count, p.inter);
  at::parallel_for(0, D, std::max<int64_t>(16, GRAIN_BYTES / down_bytes_per_col),
                   [&](int64_t n0, int64_t n1) {
    for (const Pass& p : passes)
      by_rows<F>(p.count, [&](auto rows) {
        rows.down(ex, p, act + p.act_offset, tokens.data(), gains.data(), out, n0, n1);
      });
  });
}

// a @ w.T as at::linear, in a's dtype. Without bf16 arithmetic (x86 without AVX512_BF16 or
// AMX-BF16) oneDNN widens bf16 inside its GEMM loops, ~7x slower than an fp32 GEMM on a Zen 3:
// there bf16 operands are widened first (exact), the product rounded back to bf16 once, as
// zcode.quant.formats.float_linear does for the dense layers.
inline torch::Tensor gemm(const torch::Tensor& a, const torch::Tensor& w) {
#if (defined(__x86_64__) || defined(__i386__)) && !defined(__AVX512BF16__) && !defined(__AMX_BF16__)
  if (w.scalar_type() == at::kBFloat16)
    return at::linear(a.to(at::kFloat), w.to(at::kFloat)).to(at::kBFloat16);
#endif
  return at::linear(a, w);
}

template <typename F>
torch::Tensor moe_fused_impl(const torch::Tensor& x, const torch::Tensor& weights,
                             const torch::Tensor& expert_ids, const std::vector<torch::Tensor>& wg,
                             const std::vector<torch::Tensor>& wu,
                             const std::vector<torch::Tensor>& wd, int64_t num_shared) {
  using T = typename F::T;
  const int64_t num_tokens = x.size(0), D = x.size(1), top_k = expert_ids.size(1);
  const int64_t num_experts = static_cast<int64_t>(wg.size());
  const int64_t num_routed = num_experts - num_shared;
  Experts<F> ex;
  ex.D = D;
  ex.gate.resize(num_experts);
  ex.up.resize(num_experts);
  ex.down.resize(num_experts);
  ex.inter.resize(num_experts);

  // Assignments grouped by expert (counting sort): tokens[starts[e] : starts[e + 1]].
  auto ids = expert_ids.to(at::kLong).contiguous();
  auto w = weights.to(at::kFloat).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* wt = w.data_ptr<float>();
  std::vector<int64_t> starts(num_experts + 1, 0);
  for (int64_t a = 0; a < num_tokens * top_k; ++a) {
    TORCH_CHECK(id[a] >= -1 && id[a] < num_routed, "moe_fused: expert id ", id[a], " out of range");
    if (id[a] >= 0) ++starts[id[a] + 1];
  }
  for (int64_t e = num_routed; e < num_experts; ++e) starts[e + 1] = num_tokens;
  for (int64_t e = 0; e < num_experts; ++e) {
    // Only the experts this step reads are checked and read (~0.2 us each).
    if (starts[e + 1] > 0) ex.set(e, wg[e], wu[e], wd[e]);
    starts[e + 1] += starts[e];
  }
  std::vector<int64_t> tokens(starts.back()), fill(starts.begin(), starts.end() - 1);
  std::vector<float> gains(starts.back());
  for (int64_t a = 0; a < num_tokens * top_k; ++a) {
    if (id[a] < 0) continue;
    const int64_t slot = fill[id[a]]++;
    tokens[slot] = a / top_k;
    gains[slot] = wt[a];
  }
  for (int64_t e = num_routed; e < num_experts; ++e)
    for (int64_t t = 0; t < num_tokens; ++t) {
      tokens[fill[e] + t] = t;
      gains[fill[e] + t] = 1.f;
    }

  auto xc = x.to(F::DTYPE).contiguous();
  const T* xp = static_cast<const T*>(xc.data_ptr());
  auto out = torch::zeros({num_tokens, D}, x.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();

  std::vector<Pass> passes;
  std::vector<int64_t> gemm_experts;
  int64_t act_size = 0, x_rows = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t count = starts[e + 1] - starts[e];
    if (count > MAX_ROWS) {
      gemm_experts.push_back(e);
      continue;
    }
    if (count == 0) continue;
    passes.push_back({e, starts[e], count, ex.inter[e], act_size});
    act_size += count * ex.inter[e];
    x_rows += count;
  }
  auto xg_t = torch::empty({x_rows * D}, F::DTYPE);  // aligned, as in run_passes
  T* xg = static_cast<T*>(xg_t.data_ptr());
  int64_t row = 0;
  for (const Pass& p : passes)
    for (int64_t m = 0; m < p.count; ++m, ++row)
      std::memcpy(xg + row * D, xp + tokens[p.first + m] * D, D * sizeof(T));
  run_passes<F>(ex, passes, xg, tokens, gains, op);

  // Experts with many tokens (prefill): a GEMM per projection over their gathered tokens.
  for (int64_t e : gemm_experts) {
    const int64_t first = starts[e], count = starts[e + 1] - first;
    auto index = torch::from_blob(tokens.data() + first, {count}, at::kLong);
    auto rows = xc.index_select(0, index);
    auto act = at::silu(gemm(rows, wg[e])).mul_(gemm(rows, wu[e]));
    auto y = gemm(act, wd[e]).to(at::kFloat);
    y.mul_(torch::from_blob(gains.data() + first, {count, 1}, at::kFloat));
    out.index_add_(0, index, y);
  }
  return out.to(x.scalar_type());
}

}  // namespace

torch::Tensor moe_fused(const torch::Tensor& x, const torch::Tensor& weights,
                        const torch::Tensor& expert_ids, const std::vector<torch::Tensor>& w_gate,
                        const std::vector<torch::Tensor>& w_up,
                        const std::vector<torch::Tensor>& w_down, int64_t num_shared) {
  // x: [T, D] float; weights: [T, k] float; expert_ids: [T, k] integer in [0, E - num_shared),
  // or -1 for an assignment to an expert not in the lists (another rank's: expert parallelism);
  // per expert e: w_gate[e], w_up[e]: [I_e, D], w_down[e]: [D, I_e], all one dtype (fp32 or
  // bf16), contiguous -> [T, D] of x's dtype.
  TORCH_CHECK(x.dim() == 2 && x.is_floating_point(), "moe_fused: x must be 2-D float");
  TORCH_CHECK(weights.dim() == 2 && expert_ids.sizes() == weights.sizes() &&
                  weights.size(0) == x.size(0),
              "moe_fused: weights and expert_ids must both be [T, k]");
  const size_t E = w_gate.size();
  TORCH_CHECK(E > 0 && w_up.size() == E && w_down.size() == E,
              "moe_fused: one gate, up and down weight per expert");
  TORCH_CHECK(num_shared >= 0 && num_shared < static_cast<int64_t>(E),
              "moe_fused: num_shared must leave at least one routed expert");
  const at::ScalarType dtype = w_gate[0].scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "moe_fused: expert weights must be fp32 or bf16");
  if (dtype == at::kBFloat16)
    return moe_fused_impl<Bf16>(x, weights, expert_ids, w_gate, w_up, w_down, num_shared);
  return moe_fused_impl<F32>(x, weights, expert_ids, w_gate, w_up, w_down, num_shared);
}

// Registered with the dispatcher (no Python on the call path): torch.ops.zcode.moe_fused.
TORCH_LIBRARY_FRAGMENT(zcode, m) {
  m.def("moe_fused(Tensor x, Tensor weights, Tensor expert_ids, Tensor[] w_gate, Tensor[] w_up, "
        "Tensor[] w_down, int num_shared) -> Tensor");
}

TORCH_LIBRARY_IMPL(zcode, CPU, m) { m.impl("moe_fused", &moe_fused); }
