"""GGUF block formats in C++ (ggml.cpp: AVX-512 VNNI, AVX2, or portable loops), as torch ops.

A GGUF weight is the file's own bytes, uint8 [N, row_bytes] in one ggml type (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F32, F16, BF16; zcode.quant.gguf). Two ops read it as stored:

- `torch.ops.zcode.ggml_gemv(x, ws, ggml_types)`: x [M, K] float (any M: 8-row chunks of x on
  each tile of weight rows) times a list of weights sharing x, each of its own type
  -> [M, N_0 + N_1 + ...] fp32. x is
  quantized to int8 inside the call as llama.cpp does (per 32 for the 32-block types, per 256
  with sums per 16 for the K-quants; fp32 scales amax / 127, round half to even), and each block
  is an exact integer dot product (VNNI, or int8 loops the compiler vectorizes); F32 and F16
  rows multiply fp32 x, BF16 rows x rounded to bf16 (llama.cpp's activations for them) in
  tiles of 4 x rows by 4 weight rows (vdpbf16ps): a GEMM at any M, the prefill path of BF16.
- `torch.ops.zcode.ggml_moe(x, weights, expert_ids, gate, up, down, gate_types, up_types,
  down_types, num_routed)`: a MoE layer's step (x [T, D]: decode or prefill) over experts of
  GGUF weights in one call: each routed expert of the step (ascending id) on its own tokens and
  the shared ones (experts num_routed.. ) on every token (each list entry one expert's rows
  [N, row_bytes] or a stack of experts [E, N, row_bytes], with one type per entry); gate and up
  of all of them in one parallel region, SiLU * up, every down GEMV in a second, the
  routing-weighted sum -> [T, D] fp32; what the experts' modules compute, without a Python call
  per expert; the work split over threads by weight bytes x rows of x;
- `torch.ops.zcode.ggml_dequantize(data, ggml_type, in_features, row_ids=None)`: rows
  [R, row_bytes] -> fp32 [R, K], or only rows row_ids [T] -> [T, K] (an embedding lookup, ~3 us),
  bit for bit the `gguf` package's dequantize (also the prefill path: row tiles dequantized, then
  a GEMM).
- `torch.ops.zcode.ggml_interleave(data, ggml_type, in_features, inverse=False)`: a 32-block
  type's rows (N a multiple of 16) -> the same bytes in the interleaved layout, kernel type
  `ggml_type | 256` for the ops above (or back); `ggml_interleaved_kernels()` says whether this
  build has its vector kernel (AVX-512 VNNI or AVX2; elsewhere the ops put it back in row order).

Built once with torch.utils.cpp_extension.load and -march=native (cached by torch);
`available()` is False only where no C++ compiler works, and zcode.quant.gguf keeps the `gguf`
package's numpy dequantize.
"""

import functools
from pathlib import Path

import torch

from zcode.kernels.cpp_build import build_ops

SOURCE = Path(__file__).with_name("ggml.cpp")


@functools.cache
def available() -> bool:
    """True when the kernels build and load here (built on first call); then torch.ops.zcode
    has them."""
    # -ffp-contract=off: dequantize rounds each product and sum as the gguf package does.
    if not build_ops(
        "zcode_ggml", SOURCE, "using the gguf package's", extra_cflags=("-ffp-contract=off",)
    ):
        return False
    _register_fakes()
    return True


def _register_fakes() -> None:
    # Output shapes for tracing (torch.compile): the kernels themselves never run on fakes.
    @torch.library.register_fake("zcode::ggml_gemv")
    def _(x, ws, ggml_types):
        return x.new_empty(x.shape[0], sum(w.shape[0] for w in ws), dtype=torch.float32)

    @torch.library.register_fake("zcode::ggml_moe")
    def _(x, weights, expert_ids, gate, up, down, gate_types, up_types, down_types, num_routed):
        return x.new_empty(x.shape, dtype=torch.float32)

    @torch.library.register_fake("zcode::ggml_attention_block")
    def _(x, cos, sin, kv_cache, slot_mapping, context_slots, mask, *weights):
        return torch.empty_like(x)

    @torch.library.register_fake("zcode::ggml_moe_block")
    def _(x, *weights):
        return torch.empty_like(x)

    @torch.library.register_fake("zcode::ggml_mlp_block")
    def _(x, *weights):
        return torch.empty_like(x)

    @torch.library.register_fake("zcode::ggml_dequantize")
    def _(data, ggml_type, in_features, row_ids=None):
        num_rows = data.shape[0] if row_ids is None else row_ids.shape[0]
        return data.new_empty(num_rows, in_features, dtype=torch.float32)
