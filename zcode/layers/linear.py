"""Linear: nn.Linear whose bf16 decode calls run the C++ GEMV (zcode.kernels.gemv).

At one to gemv.MAX_ROWS rows a bf16 linear only reads its weight, and the GEMV reads it ~2x
faster than torch's bf16 F.linear on AVX-512 BF16 CPUs; every other call (fp32 weights, prefill,
no kernel on this machine, autograd) is F.linear. Same parameters and names as nn.Linear.
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
            w.dtype == torch.bfloat16
            and x.numel() <= GEMV_MAX_ROWS * self.in_features
            and w.device.type == "cpu"
            and w.is_contiguous()
            and not (w.requires_grad and torch.is_grad_enabled())  # the kernel has no backward
            and gemv_available()
        ):
            out = torch.ops.zcode.gemv_bf16(x.reshape(-1, self.in_features), w).to(x.dtype)
            if self.bias is not None:
                out = out + self.bias
            return out.view(*x.shape[:-1], self.out_features)
        return F.linear(x, w, self.bias)
