"""GGUF block formats run as stored: a weight is the file's bytes, never an fp32 copy.

A GGUF tensor of shape [N, K] is N rows of `K / block_size` blocks (llama.cpp's ggml types: Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, the K-quants Q2_K..Q6_K, and the float types F32 / F16 / BF16). Each row
is a contiguous run of bytes, so `data` is a uint8 tensor [N, row_bytes], usually a view of the
memory-mapped file: loading reads nothing, and a decode step reads each block once.

- `linear_reference`: the `gguf` package's own dequantize, then fp32 F.linear: the oracle.
- `linear_fast`: see the class docstring.

`GgufEmbedding` looks rows of a quantized embedding up by dequantizing only those rows; a tied
lm_head is a QuantizedLinear over the same GgufWeight.
"""

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize
from torch import nn

from zcode.quant.formats import PackedWeight, linear_dequantized

FLOAT_TYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}


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


class GgufWeight(PackedWeight):
    """One linear layer's weight [N, K] in a ggml type, as the file stores it."""

    def __init__(self, data: torch.Tensor, ggml_type: int, in_features: int) -> None:
        # data: uint8 [N, row_bytes]
        super().__init__(data.shape[0], in_features)
        if data.dtype != torch.uint8 or data.dim() != 2:
            raise ValueError(f"GGUF weight bytes must be uint8 [N, row_bytes], got {data.dtype}")
        if data.shape[1] != row_bytes(ggml_type, in_features):
            raise ValueError(
                f"{type_name(ggml_type)} rows of {in_features} take "
                f"{row_bytes(ggml_type, in_features)} bytes, not {data.shape[1]}"
            )
        self.ggml_type = int(ggml_type)
        self.register_buffer("data", data)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "GgufWeight":
        raise NotImplementedError(
            "GGUF weights come from GGUF files; ZCode does not quantize to ggml types"
        )

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_rows(self.data, self.ggml_type).to(dtype)

    def linear_fast(self, x: torch.Tensor) -> torch.Tensor:
        return linear_dequantized(
            x.float(),
            self.out_features,
            lambda start, end: dequantize_rows(self.data[start:end], self.ggml_type),
        )

    def linear_reference(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.dequantize())

    @property
    def weight_bytes(self) -> int:
        return self.data.numel()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, type={self.type_name}"


class GgufEmbedding(nn.Module):
    """nn.Embedding over a GGUF weight [vocab, hidden]: a lookup dequantizes only its rows."""

    def __init__(self, packed: GgufWeight) -> None:
        super().__init__()
        self.packed = packed
        self.num_embeddings, self.embedding_dim = packed.out_features, packed.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, D] fp32
        rows = self.packed.data.index_select(0, input_ids.reshape(-1))
        out = dequantize_rows(rows, self.packed.ggml_type)
        return out.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.packed.type_name}"
