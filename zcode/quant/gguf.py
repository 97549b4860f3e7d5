"""GGUF block formats run as stored: a weight is the file's bytes, never an fp32 copy.

A GGUF tensor of shape [N, K] is N rows of `K / block_size` blocks (llama.cpp's ggml types: Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, the K-quants Q2_K..Q6_K, and the float types F32 / F16 / BF16). Each row
is a contiguous run of bytes, so `data` is a uint8 tensor [N, row_bytes], usually a view of the
memory-mapped file: loading reads nothing, and a decode step reads each block once.

- `linear_reference`: the `gguf` package's own dequantize, then fp32 F.linear of x quantized per
  activation block as llama.cpp's dot products quantize it: the oracle.
- `linear_fast`: the C++ kernels (zcode.kernels.ggml), see the class docstring; the package's
  dequantize tile by tile where they do not build or lack the type.

`GgufEmbedding` looks rows of a quantized embedding up by dequantizing only those rows; a tied
lm_head is a QuantizedLinear over the same GgufWeight.
"""

import sys
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize, quantize
from torch import nn

from zcode.quant.formats import PackedWeight, linear_dequantized

FLOAT_TYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}


# Rows up to which linear_fast takes the C++ GEMV (int8 activations; 8-row chunks on each tile of
# weight rows); past that it dequantizes tiles for fp32 GEMMs. The GEMV led up to 512 rows here
# (Zen 5, VNNI, 2 threads: 1.2x at 512, 2x at 64); the autotuner, which times both at any
# row count, finds the crossover of another machine.
GEMV_MAX_ROWS = 64
# Activation block of the GEMV per weight type: llama.cpp's Q8_0 / Q8_1 (32), Q8_K (256).
ACTIVATION_BLOCK = {
    **dict.fromkeys(
        (
            GGMLQuantizationType.Q4_0,
            GGMLQuantizationType.Q4_1,
            GGMLQuantizationType.Q5_0,
            GGMLQuantizationType.Q5_1,
            GGMLQuantizationType.Q8_0,
        ),
        32,
    ),
    **dict.fromkeys(
        (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K), 256
    ),
}

# The types ggml.cpp runs: those with an activation block, and the float rows.
KERNEL_TYPES = frozenset(ACTIVATION_BLOCK) | frozenset(FLOAT_TYPES)
# The types ggml.cpp also runs interleaved (all its quantized types): the blocks of 16 rows side
# by side (its "interleaved layout"; kernel type = ggml type | INTERLEAVED), so one VNNI
# instruction advances 16 rows. The same bytes reordered, so no precision changes; 2-3x the
# row-major GEMV's throughput from cache, 1.3-1.8x from memory (Zen 5, one thread, M = 1 to 16).
INTERLEAVED_TYPES = frozenset(ACTIVATION_BLOCK)
INTERLEAVED = 256
INTERLEAVE_ROWS = 16


def type_name(ggml_type: int) -> str:
    """'Q4_K', 'F16', ...: the name llama.cpp and gguf-dump print."""
    return GGMLQuantizationType(ggml_type).name


def format_name(ggml_type: int) -> str:
    """The QuantizedLinear format name of a ggml type: 'gguf-q4_k'."""
    return f"gguf-{type_name(ggml_type).lower()}"


def row_bytes(ggml_type: int, in_features: int) -> int:
    block_size, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    if in_features % block_size:
        raise ValueError(
            f"{type_name(ggml_type)} rows hold whole blocks of {block_size}, not {in_features}"
        )
    return in_features // block_size * block_bytes


def dequantize_rows(data: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """uint8 [R, row_bytes] -> fp32 [R, K] with the `gguf` package (the reference)."""
    weights = dequantize(data.numpy(), GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.require(weights, np.float32, ["C", "W"]))


@torch.compiler.assume_constant_result  # compiled graphs take the answer, not the build
def ggml_available() -> bool:
    """Whether the C++ GGUF kernels (zcode.kernels.ggml) build here. Imported on first use:
    zcode.kernels imports this package."""
    from zcode.kernels import ggml

    return ggml.available()


def has_kernel(ggml_type: int) -> bool:
    """Whether zcode.kernels.ggml runs this type (where it builds)."""
    return ggml_type in KERNEL_TYPES


def has_interleaved_layout(ggml_type: int, num_rows: int) -> bool:
    """Whether a weight of this type and row count can be interleaved: the type has the layout
    and its rows fill groups of 16."""
    return ggml_type in INTERLEAVED_TYPES and num_rows % INTERLEAVE_ROWS == 0


def interleaving_pays(ggml_type: int, num_rows: int) -> bool:
    """Whether such a weight runs faster interleaved here: it has the layout and ggml.cpp has
    its vector kernel on this CPU (elsewhere the layout would only be put back in row order)."""
    return (
        has_interleaved_layout(ggml_type, num_rows)
        and ggml_available()
        and torch.ops.zcode.ggml_interleaved_kernels()
    )


class GgufWeight(PackedWeight):
    """One linear layer's weight [N, K] in a ggml type, as the file stores it.

    Fast path (zcode/kernels/ggml.cpp): up to GEMV_MAX_ROWS (64) rows the GEMV, which
    quantizes x to int8 per block as llama.cpp does and streams each weight block once; past
    that the weight dequantized to fp32 DEQUANT_TILE_ROWS rows at a time by the C++ dequantize,
    each tile one fp32 GEMM: a 512 x 576 x 1536 prefill, one thread, 14 ms in Q4_1 (26 ms with
    the package's dequantize; 17 ms for an fp32 F.linear over a weight dequantized in advance).
    BF16 rows take the C++ kernel at any row count (x rounded to bf16, as llama.cpp rounds it).

    `interleaved`: `data` holds the same bytes in ggml.cpp's interleaved layout (blocks of 16
    rows side by side), which its ops read as `kernel_type`; `file_rows()` gives them back in the
    file's order (the package's dequantize reads that).
    """

    @property
    def gemv_max_rows(self) -> int:
        """Rows up to which the C++ kernel runs (linear_fast, linear_group): BF16 rows at any
        count, as ggml.cpp's tiles of vdpbf16ps products (a 512 x 1024 x 3584 prefill, 2 Zen 5
        threads: ~700 GFLOP/s against ~210 for the fp32 GEMM over dequantized tiles)."""
        return sys.maxsize if self.ggml_type == GGMLQuantizationType.BF16 else GEMV_MAX_ROWS

    def __init__(
        self, data: torch.Tensor, ggml_type: int, in_features: int, interleaved: bool = False
    ) -> None:
        # data: uint8 [N, row_bytes], in the file's row order or (interleaved) ggml.cpp's
        # interleaved layout: each 16 rows' bytes hold their group
        super().__init__(data.shape[0], in_features)
        if data.dtype != torch.uint8 or data.dim() != 2:
            raise ValueError(f"GGUF weight bytes must be uint8 [N, row_bytes], got {data.dtype}")
        if data.shape[1] != row_bytes(ggml_type, in_features):
            raise ValueError(
                f"{type_name(ggml_type)} rows of {in_features} take "
                f"{row_bytes(ggml_type, in_features)} bytes, not {data.shape[1]}"
            )
        if interleaved and not has_interleaved_layout(ggml_type, data.shape[0]):
            raise ValueError(
                f"{type_name(ggml_type)} [{data.shape[0]}, {in_features}] has no interleaved "
                f"layout (the 32-block types and Q6_K, rows a multiple of {INTERLEAVE_ROWS})"
            )
        self.ggml_type = int(ggml_type)
        self.interleaved = interleaved
        self.register_buffer("data", data)

    @property
    def kernel_type(self) -> int:
        """The type ggml.cpp's ops take for `data`: the ggml type, | INTERLEAVED if it is."""
        return self.ggml_type | (INTERLEAVED if self.interleaved else 0)

    def interleaved_copy(self) -> "GgufWeight":
        """This weight in the interleaved layout (a copy in memory; a loaded file's comes from
        the on-disk cache, zcode.loader.interleaved)."""
        if self.interleaved:
            return self
        if not ggml_available():
            raise NotImplementedError("the interleaved layout needs ggml.cpp, not built here")
        data = torch.ops.zcode.ggml_interleave(self.data, self.ggml_type, self.in_features)
        return GgufWeight(data, self.ggml_type, self.in_features, interleaved=True)

    def rows(self, start: int, stop: int) -> "GgufWeight":
        """A view of rows start..stop (multiples of 16 if interleaved: whole groups)."""
        if self.interleaved and (start % INTERLEAVE_ROWS or stop % INTERLEAVE_ROWS):
            raise ValueError(f"an interleaved weight splits at groups of {INTERLEAVE_ROWS} rows")
        data = self.data[start:stop]
        return GgufWeight(data, self.ggml_type, self.in_features, self.interleaved)

    def file_rows(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """uint8 [stop - start, row_bytes]: rows start..stop in the file's row order (if
        interleaved, a copy of the 16-row groups that hold them: only their pages are read)."""
        stop = self.out_features if stop is None else stop
        if not self.interleaved:
            return self.data[start:stop]
        group = INTERLEAVE_ROWS
        first, end = start // group * group, -(-stop // group) * group
        rows = torch.ops.zcode.ggml_interleave(
            self.data[first:end], self.ggml_type, self.in_features, inverse=True
        )
        return rows[start - first : stop - first]

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "GgufWeight":
        raise NotImplementedError(
            "GGUF weights come from GGUF files; ZCode does not quantize to ggml types"
        )

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_rows(self.file_rows(), self.ggml_type).to(dtype)

    @classmethod
    def random(cls, ggml_type: int, num_out: int, num_in: int, generator: torch.Generator):
        """A valid weight of random content, for tests and the kernel registry's cases: random
        fp32 weights quantized by the `gguf` package where it can quantize the type, else random
        block bytes with small positive fp16 scales (any codes, scales and mins are valid)."""
        ggml_type = GGMLQuantizationType(ggml_type)
        w = torch.randn(num_out, num_in, generator=generator) * num_in**-0.5
        try:
            data = np.ascontiguousarray(quantize(w.numpy(), ggml_type)).view(np.uint8)
            return cls(torch.from_numpy(data.reshape(num_out, -1)), ggml_type, num_in)
        except NotImplementedError:
            pass
        block_size, block_bytes = GGML_QUANT_SIZES[ggml_type]
        blocks = torch.randint(
            0, 256, (num_out, num_in // block_size, block_bytes), generator=generator
        ).to(torch.uint8)
        scale_offsets = {
            GGMLQuantizationType.Q4_K: (0, 2),  # d, dmin
            GGMLQuantizationType.Q5_K: (0, 2),
            GGMLQuantizationType.Q6_K: (208,),  # d
        }[ggml_type]
        for offset in scale_offsets:
            scale = torch.rand(blocks.shape[:2], generator=generator) * 2**-7 * num_in**-0.5
            blocks[..., offset : offset + 2] = scale.half().unsqueeze(-1).view(torch.uint8)
        return cls(blocks.reshape(num_out, -1), ggml_type, num_in)

    def linear_fast(self, x: torch.Tensor) -> torch.Tensor:
        if not (ggml_available() and has_kernel(self.ggml_type)):
            return self.mm_package(x)
        if x.shape[0] <= self.gemv_max_rows:
            return self.mm_gemv(x)
        return self.mm_dequantized(x)

    def linear_reference(self, x: torch.Tensor) -> torch.Tensor:
        """The gguf package's dequantize times x quantized per activation block in torch: what
        llama.cpp computes, so the kernels, which quantize x themselves, are held to it tightly,
        and an autotuner that picks the reference computes what the kernels compute. (The
        unquantized product is the tests' second float64 reference.)"""
        return F.linear(self.quantized_activations(x), self.dequantize())

    @classmethod
    def gemv_group(cls, x: torch.Tensor, weights: Sequence["GgufWeight"]) -> torch.Tensor | None:
        """x [M, K] (any M) times weights of any kernel types (a Q4_K_M file's q/k/v
        mix Q4_K and Q6_K) in one C++ call -> [M, N_0 + N_1 + ...] fp32."""
        if not (ggml_available() and all(has_kernel(w.ggml_type) for w in weights)):
            return None
        return torch.ops.zcode.ggml_gemv(
            x, [w.data for w in weights], [w.kernel_type for w in weights]
        )

    def mm_gemv(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemv_group(x, [self])

    def quantized_activations(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] as the GEMV multiplies it: int8 codes per activation block (llama.cpp's
        Q8_0 / Q8_1 / Q8_K; scale amax / 127, round half to even, as ggml.cpp) times their
        scale, fp32; x rounded to bf16 for BF16 weights (llama.cpp's activations for them);
        x itself for F32 and F16. The GEMM paths multiply this, so a prompt token gets the
        logits it would get decoded (and llama.cpp's, which quantizes both)."""
        block = ACTIVATION_BLOCK.get(GGMLQuantizationType(self.ggml_type))
        x = x.float()
        if self.ggml_type == GGMLQuantizationType.BF16:
            return x.bfloat16().float()
        if block is None:
            return x
        blocks = x.reshape(x.shape[0], -1, block)  # [M, K / block, block]
        scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
        # An all-zero block has scale 0 and codes 0; NaN in x stays NaN.
        codes = torch.round(blocks / torch.where(scale == 0, 1.0, scale)).clamp_(-127, 127)
        return (codes * scale).view(x.shape)

    def mm_dequantized(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ W.T with W dequantized to fp32 by the C++ kernel, a tile of rows at a time,
        x quantized as the GEMV quantizes it."""
        return linear_dequantized(
            self.quantized_activations(x),
            self.out_features,
            lambda start, end: torch.ops.zcode.ggml_dequantize(
                self.data[start:end], self.kernel_type, self.in_features
            ),
        )

    def mm_package(self, x: torch.Tensor) -> torch.Tensor:
        """As mm_dequantized, with the `gguf` package's numpy dequantize (any type, no build)."""
        rows = self.file_rows()
        return linear_dequantized(
            self.quantized_activations(x),
            self.out_features,
            lambda start, end: dequantize_rows(rows[start:end], self.ggml_type),
        )

    @property
    def weight_bytes(self) -> int:
        return self.data.numel()

    def extra_repr(self) -> str:
        interleaved = ", interleaved" if self.interleaved else ""
        return f"{super().extra_repr()}, type={self.type_name}{interleaved}"


class GgufEmbedding(nn.Module):
    """nn.Embedding over a GGUF weight [vocab, hidden]: a lookup dequantizes only its rows."""

    def __init__(self, packed: GgufWeight) -> None:
        super().__init__()
        self.packed = packed
        self.num_embeddings, self.embedding_dim = packed.out_features, packed.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, D] fp32
        ids, ggml_type = input_ids.reshape(-1), self.packed.ggml_type
        if ggml_available() and has_kernel(ggml_type):
            out = torch.ops.zcode.ggml_dequantize(
                self.packed.data, self.packed.kernel_type, self.embedding_dim, ids
            )
        else:
            out = dequantize_rows(self.packed.data.index_select(0, ids), ggml_type)
        return out.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.packed.type_name}"
