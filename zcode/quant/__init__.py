"""Weight formats with real CPU kernels (bf16, int8, int4 by group, W8A8, W4A8) and the swap of
a model's linear layers into them."""

from zcode.quant.apply import apply_precision, quantizable_modules
from zcode.quant.linear import FORMATS, QuantizedLinear, quantize_weight

__all__ = [
    "FORMATS",
    "QuantizedLinear",
    "apply_precision",
    "quantizable_modules",
    "quantize_weight",
]
