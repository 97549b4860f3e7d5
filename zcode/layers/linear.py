"""Linear: nn.Linear whose bf16 and fp32 decode calls run the C++ GEMV (zcode.kernels.gemv).

At one to gemv.MAX_ROWS rows a linear only reads its weight. The GEMV reads bf16 ~2x faster than
torch's bf16 F.linear on AVX-512 BF16 CPUs, and fp32 2-3% faster than MKL's sgemv (its prefetch);
every other call (prefill, other dtypes, no kernel on this machine, autograd) is F.linear. Same
parameters and names as nn.Linear.
"""

import torch
import torch.nn.functional as F
from torch import nn

from zcode.quant.formats import GEMV_MAX_ROWS, gemv_available


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        w = self.weight
        if (
            (kernel := _GEMV.get(w.dtype)) is not None
            and x.dtype == w.dtype
            and 0 < x.numel() <= GEMV_MAX_ROWS * self.in_features
            and w.device.type == "cpu"
            and w.is_contiguous()
            and not (w.requires_grad and torch.is_grad_enabled())  # the kernel has no backward
            and gemv_available()
        ):
            out = kernel(x.reshape(-1, self.in_features), w).to(x.dtype)
            if self.bias is not None:
                out = out + self.bias
            return out.view(*x.shape[:-1], self.out_features)
        return F.linear(x, w, self.bias)


_GEMV = {
    torch.bfloat16: lambda x, w: torch.ops.zcode.gemv_bf16(x, w),
    torch.float32: lambda x, w: torch.ops.zcode.gemv_f32(x, w),
}
