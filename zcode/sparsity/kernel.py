"""The row-skipping CPU kernel behind SparseMLP: y = (x * [|x| > t]) @ W_t, reading only the rows
of W_t whose input is kept by some token of the batch (the union of the tokens' masks). Each
token has its own threshold t, so requests at different sparsity levels share one call (a dense
one too: a negative threshold keeps every row, and the row loop streams them at about the dense
GEMV's speed).

W_t is the transposed weight, [K, N] row-major, so one input channel is one contiguous row: a
skipped channel is a row never loaded. Its rows are fp32, or int8 codes with one fp32 scale per
output column (the int8 format's per-channel scales, zcode.quant.int8): a quarter of the
bytes, at 2.7x fp32's speed here (SmolLM2's FFN, one token, every row, 2 threads: 155 us a layer
against 415, with the next block's rows prefetched: 207 without). Past `dense_fraction` of rows
kept, a batch of 16 tokens or more falls back to one dense GEMM of the masked input (same result,
MKL speed). `sparse_ffn` fuses a whole SwiGLU FFN (gate/up concatenated) into one call so decode
pays one dispatch per layer, not five.

Built once with torch.utils.cpp_extension.load_inline (gcc, cached by torch under
$TORCH_EXTENSIONS_DIR); `available()` says whether the build works here, and SparseMLP falls back
to index_select + matmul when it does not.
"""

import functools
import logging

import torch

logger = logging.getLogger(__name__)

_CPP = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <vector>

// yr[c0:c1] += sum over j < 8 of s[j] * wr[j][c0:c1].
template <typename W>
static inline void axpy8(const float* s, const W* const* wr, float* yr, int64_t c0, int64_t c1) {
  #pragma omp simd
  for (int64_t c = c0; c < c1; ++c) {
    yr[c] += s[0] * static_cast<float>(wr[0][c]) + s[1] * static_cast<float>(wr[1][c]) +
             s[2] * static_cast<float>(wr[2][c]) + s[3] * static_cast<float>(wr[3][c]) +
             s[4] * static_cast<float>(wr[4][c]) + s[5] * static_cast<float>(wr[5][c]) +
             s[6] * static_cast<float>(wr[6][c]) + s[7] * static_cast<float>(wr[7][c]);
  }
}

// The same for 4 tokens at once, y [4, N] (token u's row at y + u * N) and s [4, 8]: each weight
// is loaded (and an int8 code widened) once for the four, not once per token.
template <typename W>
static inline void axpy8x4(const float* s, const W* const* wr, float* y, int64_t N, int64_t c0,
                           int64_t c1) {
  float* y0 = y;
  float* y1 = y + N;
  float* y2 = y + 2 * N;
  float* y3 = y + 3 * N;
  #pragma omp simd
  for (int64_t c = c0; c < c1; ++c) {
    float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
    for (int j = 0; j < 8; ++j) {
      const float w = static_cast<float>(wr[j][c]);
      d0 += s[j] * w;
      d1 += s[8 + j] * w;
      d2 += s[16 + j] * w;
      d3 += s[24 + j] * w;
    }
    y0[c] += d0;
    y1[c] += d1;
    y2[c] += d2;
    y3[c] += d3;
  }
}

#ifdef __AVX512F__
// int8 rows, 64 columns a step: each code widened once (vpmovsxbd + vcvtdq2ps) into an FMA, four
// independent accumulators (one chain of 8 dependent FMAs per 16 columns waited on the FMA's
// latency: 274 us a layer of SmolLM2's FFN on one thread, ~10 GB/s).
static inline __m512 widen16(const int8_t* codes) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
}

template <>
inline void axpy8<int8_t>(const float* s, const int8_t* const* wr, float* yr, int64_t c0,
                          int64_t c1) {
  __m512 sv[8];
  for (int j = 0; j < 8; ++j) sv[j] = _mm512_set1_ps(s[j]);
  int64_t c = c0;
  for (; c + 64 <= c1; c += 64) {
    __m512 acc[4];
    for (int v = 0; v < 4; ++v) acc[v] = _mm512_loadu_ps(yr + c + 16 * v);
    for (int j = 0; j < 8; ++j) {
      for (int v = 0; v < 4; ++v) {
        acc[v] = _mm512_fmadd_ps(sv[j], widen16(wr[j] + c + 16 * v), acc[v]);
      }
    }
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(yr + c + 16 * v, acc[v]);
  }
  for (; c + 16 <= c1; c += 16) {
    __m512 acc = _mm512_loadu_ps(yr + c);
    for (int j = 0; j < 8; ++j) acc = _mm512_fmadd_ps(sv[j], widen16(wr[j] + c), acc);
    _mm512_storeu_ps(yr + c, acc);
  }
  for (; c < c1; ++c) {
    float sum = 0.f;
    for (int j = 0; j < 8; ++j) sum += s[j] * static_cast<float>(wr[j][c]);
    yr[c] += sum;
  }
}

template <>
inline void axpy8x4<int8_t>(const float* s, const int8_t* const* wr, float* y, int64_t N,
                            int64_t c0, int64_t c1) {
  int64_t c = c0;
  for (; c + 16 <= c1; c += 16) {
    __m512 w[8];
    for (int j = 0; j < 8; ++j) w[j] = widen16(wr[j] + c);
    for (int u = 0; u < 4; ++u) {  // four independent chains of 8 FMAs
      __m512 acc = _mm512_loadu_ps(y + u * N + c);
      for (int j = 0; j < 8; ++j) acc = _mm512_fmadd_ps(_mm512_set1_ps(s[8 * u + j]), w[j], acc);
      _mm512_storeu_ps(y + u * N + c, acc);
    }
  }
  for (; c < c1; ++c) {
    for (int u = 0; u < 4; ++u) {
      float sum = 0.f;
      for (int j = 0; j < 8; ++j) sum += s[8 * u + j] * static_cast<float>(wr[j][c]);
      y[u * N + c] += sum;
    }
  }
}
#endif

// Adds the kept rows of w into y, ROW_BLOCK rows at a time. Columns split across threads: each
// thread streams its slice of every kept row, so each token's output slice is loaded and stored
// once per block, not once per row (one row at a time ran a full-density decode GEMV at
// ~16 GB/s, the dense GEMV ~25). W: float, or int8 codes whose column scales `col_scale` [N]
// multiply each output column once at the end (null for float rows).
template <typename W>
static void add_rows(const std::vector<int64_t>& rows, const float* a, const W* wp,
                     const float* col_scale, float* yp, int64_t T, int64_t N) {
  constexpr int64_t ROW_BLOCK = 8;
  const int64_t R = static_cast<int64_t>(rows.size());
  const std::vector<float> zeros(T, 0.f);  // the inputs of a short block's padding rows
  at::parallel_for(0, N, 256, [&](int64_t c0, int64_t c1) {
    for (int64_t r0 = 0; r0 < R; r0 += ROW_BLOCK) {
      const int64_t nb = std::min(ROW_BLOCK, R - r0);
      const W* wr[ROW_BLOCK];
      const float* ar[ROW_BLOCK];
      for (int64_t j = 0; j < ROW_BLOCK; ++j) {  // a short block repeats its last row, scaled 0
        const int64_t k = rows[r0 + std::min(j, nb - 1)];
        wr[j] = wp + k * N;
        ar[j] = j < nb ? a + k * T : zeros.data();
      }
      for (int64_t j = 0; r0 + ROW_BLOCK + j < R && j < ROW_BLOCK; ++j) {
        // the next block's rows into L2 while this one computes: a thread's slice of a row is a
        // short stream (1.5 KB of an int8 row of SmolLM2's gate|up), too short for the hardware
        // prefetchers to ramp up on
        const char* next = reinterpret_cast<const char*>(wp + rows[r0 + ROW_BLOCK + j] * N);
        for (int64_t b = c0 * sizeof(W); b < c1 * static_cast<int64_t>(sizeof(W)); b += 64) {
          __builtin_prefetch(next + b, 0, 2);
        }
      }
      int64_t t = 0;
      for (; t + 4 <= T; t += 4) {
        float s[4 * ROW_BLOCK];  // [4, 8]: the four tokens' inputs of the block's rows
        for (int64_t u = 0; u < 4; ++u) {
          for (int64_t j = 0; j < ROW_BLOCK; ++j) s[u * ROW_BLOCK + j] = ar[j][t + u];
        }
        axpy8x4(s, wr, yp + t * N, N, c0, c1);
      }
      for (; t < T; ++t) {
        const float s[ROW_BLOCK] = {ar[0][t], ar[1][t], ar[2][t], ar[3][t],
                                    ar[4][t], ar[5][t], ar[6][t], ar[7][t]};
        axpy8(s, wr, yp + t * N, c0, c1);
      }
    }
    if (col_scale != nullptr) {
      for (int64_t t = 0; t < T; ++t) {
        float* yr = yp + t * N;
        #pragma omp simd
        for (int64_t c = c0; c < c1; ++c) yr[c] *= col_scale[c];
      }
    }
  });
}

// y[t, :] = sum over kept rows k of a[t, k] * w[k, :], a = x masked by |x| > thresh.
// A row is kept by token t when |x[t, k]| * scale[k] > thresh[t] (scale: the row's weight norm
// for WINA-style scores, ones for plain TEAL; thresh: each token's own, negative keeps all).
// w: fp32, or int8 codes with `col_scale` [N] fp32 (w[k, n] = code * col_scale[n]; an empty
// col_scale for fp32 rows).
static torch::Tensor sparse_rows(const torch::Tensor& x, const torch::Tensor& scale,
                                 const torch::Tensor& thresh, const torch::Tensor& w,
                                 const torch::Tensor& col_scale, double dense_fraction) {
  // x: [T, K] fp32, scale: [K], thresh: [T] fp32, w: [K, N] contiguous -> y: [T, N] fp32
  const int64_t T = x.size(0), K = x.size(1), N = w.size(1);
  const bool codes = w.scalar_type() == torch::kInt8;
  TORCH_CHECK(thresh.numel() == T, "sparse_rows: one threshold per token");
  TORCH_CHECK(codes ? col_scale.numel() == N : col_scale.numel() == 0,
              "sparse_rows: int8 rows take one fp32 scale per column, fp32 rows none");
  TORCH_CHECK(codes || w.scalar_type() == torch::kFloat, "sparse_rows: fp32 or int8 rows");
  auto xc = x.contiguous();
  auto thc = thresh.contiguous();
  const float* xp = xc.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const float* th = thc.data_ptr<float>();
  std::vector<int64_t> rows;
  rows.reserve(K);
  std::vector<float> a(static_cast<size_t>(K) * T, 0.f);  // [K, T]: kept inputs, row-major by k
  for (int64_t k = 0; k < K; ++k) {
    bool any = false;
    const float sk = sp[k];
    for (int64_t t = 0; t < T; ++t) {
      float v = xp[t * K + k];
      if (std::abs(v) * sk > th[t]) { a[k * T + t] = v; any = true; }
    }
    if (any) rows.push_back(k);
  }
  auto y = torch::zeros({T, N}, x.options());
  if (rows.empty()) return y;
  // Past dense_fraction of the rows kept, one GEMM of the masked input, from GEMM_MIN_TOKENS
  // tokens on: below, the row loop wins even at every row (SmolLM2's FFN, 8 tokens, all rows:
  // 1.1 ms against the GEMM's 1.5; at 16 tokens 2.0 against 1.6). int8 rows are widened to
  // fp32 for it (a prefill's GEMM, not a decode's row loop).
  constexpr int64_t GEMM_MIN_TOKENS = 16;
  const bool dense = static_cast<double>(rows.size()) > dense_fraction * static_cast<double>(K);
  if (T >= GEMM_MIN_TOKENS && dense) {
    auto masked = torch::from_blob(a.data(), {K, T}, x.options()).t();  // [T, K]
    return codes ? torch::mm(masked, w.to(torch::kFloat)) * col_scale : torch::mm(masked, w);
  }
  float* yp = y.data_ptr<float>();
  if (codes) {
    add_rows(rows, a.data(), w.data_ptr<int8_t>(), col_scale.data_ptr<float>(), yp, T, N);
  } else {
    add_rows<float>(rows, a.data(), w.data_ptr<float>(), nullptr, yp, T, N);
  }
  return y;
}

// SwiGLU FFN with both inputs sparsified: down(silu(gate) * up), gate|up from one [K, 2I] weight.
static torch::Tensor sparse_ffn(const torch::Tensor& x, const torch::Tensor& scale_in,
                                const torch::Tensor& thresh_in, const torch::Tensor& w_gu,
                                const torch::Tensor& col_scale_gu, const torch::Tensor& scale_mid,
                                const torch::Tensor& thresh_mid, const torch::Tensor& w_down,
                                const torch::Tensor& col_scale_down, double dense_fraction) {
  // x: [T, D]; thresh_in, thresh_mid: [T]; w_gu: [D, 2I]; w_down: [I, D] -> [T, D]
  auto gu = sparse_rows(x, scale_in, thresh_in, w_gu, col_scale_gu, dense_fraction);  // [T, 2I]
  const int64_t I = w_down.size(0);
  auto h = torch::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I);  // [T, I]
  return sparse_rows(h, scale_mid, thresh_mid, w_down, col_scale_down, dense_fraction);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sparse_rows", &sparse_rows);
  m.def("sparse_ffn", &sparse_ffn);
}
"""


@functools.cache
def _module():
    from torch.utils.cpp_extension import load_inline

    from zcode.kernels.cpp_build import build_lock

    name = "zcode_sparse_rows_v9"  # v9: int8 rows, 4 tokens a pass
    with build_lock(name):
        return load_inline(
            name=name,
            cpp_sources=_CPP,
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            with_cuda=False,
        )


@functools.cache
def available() -> bool:
    """True when the C++ kernel builds and loads on this machine (built on first call)."""
    try:
        _module()
    except Exception as e:  # a missing compiler is an expected state, not a bug
        logger.warning("sparse C++ kernel unavailable, using the torch path: %s", e)
        return False
    return True


def sparse_rows(
    x: torch.Tensor,
    scale: torch.Tensor,
    thresh: torch.Tensor,
    w_t: torch.Tensor,
    dense_fraction: float,
    col_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [T, K] fp32, scale: [K], thresh: [T] fp32 (each token's), w_t: [K, N] contiguous, fp32
    or int8 codes with `col_scale` [N] fp32 -> [T, N] fp32."""
    return _module().sparse_rows(x, scale, thresh, w_t, _scales(col_scale), dense_fraction)


def sparse_ffn(
    x: torch.Tensor,
    scale_in: torch.Tensor,
    thresh_in: torch.Tensor,
    w_gate_up_t: torch.Tensor,
    scale_mid: torch.Tensor,
    thresh_mid: torch.Tensor,
    w_down_t: torch.Tensor,
    dense_fraction: float,
    col_scale_gate_up: torch.Tensor | None = None,
    col_scale_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [T, D]; scale_in: [D]; thresh_in, thresh_mid: [T] (each token's); w_gate_up_t:
    [D, 2I]; scale_mid: [I]; w_down_t: [I, D] -> [T, D] (fp32; the weights fp32, or int8 codes
    with their column scales [2I] and [D])."""
    return _module().sparse_ffn(
        x,
        scale_in,
        thresh_in,
        w_gate_up_t,
        _scales(col_scale_gate_up),
        scale_mid,
        thresh_mid,
        w_down_t,
        _scales(col_scale_down),
        dense_fraction,
    )


def _scales(col_scale: torch.Tensor | None) -> torch.Tensor:
    """The kernel's column scales argument: empty for fp32 rows."""
    return torch.empty(0) if col_scale is None else col_scale
