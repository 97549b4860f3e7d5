"""Weight formats with real CPU kernels (bf16, int8, int4 by group, W8A8, W4A8)."""

from zcode.quant.linear import FORMATS, QuantizedLinear, quantize_weight

__all__ = ["FORMATS", "QuantizedLinear", "quantize_weight"]
