"""SparseMLP: a SwiGLU FFN that drops small inputs of its linears (TEAL) and really skips the
weight rows they would have multiplied.

Semantics, whatever the kernel: with a = x * [|x| * s_in > t_in] and
h = silu(a @ Wg^T) * (a @ Wu^T), out = (h * [|h| * s_mid > t_mid]) @ Wd^T, each token with its own
masks (s: per-channel score scales, see thresholds.py). A batch reads the union of its
tokens' kept rows; when the union passes `dense_fraction` of the rows of a batch of 16 tokens or
more, the kernel multiplies the masked inputs densely instead (same numbers, MKL speed).

The thresholds are the module's level (`set_thresholds`), or, inside `tokens_at_levels`, each
token's own: requests at different FFN levels (a dense one included: negative thresholds keep
every input) then share one forward.

The rows it reads are the float weights, or (`set_weight_format("int8")`) their int8 codes with
per-output-channel scales, the int8 format's own (zcode.quant.int8): a quarter of fp32's bytes,
quantized on first use and kept beside the float rows.
"""

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from zcode.errors import ValidationError
from zcode.layers.mlp import GatedMLP
from zcode.quant.int8 import channel_scales as int8_scales
from zcode.quant.int8 import codes_on_scale
from zcode.sparsity import kernel
from zcode.sparsity.thresholds import channel_scales

DEFAULT_DENSE_FRACTION = 0.85  # past this union density the row loop loses to one dense GEMM
WEIGHT_FORMATS = ("fp32", "int8")  # the rows a SparseMLP reads: as loaded, or int8 codes


class SparseMLP(nn.Module):
    def __init__(
        self,
        mlp: GatedMLP,
        thresh_in: float,
        thresh_mid: float,
        score: str = "teal",
        dense_fraction: float = DEFAULT_DENSE_FRACTION,
        use_kernel: bool | None = None,
    ) -> None:
        super().__init__()
        if mlp.gate_proj.bias is not None:
            raise NotImplementedError("SparseMLP: FFNs with biases (mlp_bias=True)")
        if not all(isinstance(m, nn.Linear) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            raise NotImplementedError("SparseMLP: sparsity on top of quantized FFN weights")
        self.intermediate_size = mlp.gate_proj.out_features
        self.thresh_in, self.thresh_mid = float(thresh_in), float(thresh_mid)
        self.token_thresholds: torch.Tensor | None = None  # [T, 2] inside tokens_at_levels
        self.dense_fraction = dense_fraction
        scale_in, scale_mid = channel_scales(mlp, score)
        self.register_buffer("scale_in", scale_in, persistent=False)  # [D]
        self.register_buffer("scale_mid", scale_mid, persistent=False)  # [I]
        w_gate, w_up, w_down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
        # Transposed so one input channel is one contiguous row: [D, 2I] and [I, D].
        self.w_gate_up_t = nn.Parameter(
            torch.cat([w_gate, w_up]).t().contiguous(), requires_grad=False
        )
        self.w_down_t = nn.Parameter(w_down.t().contiguous(), requires_grad=False)
        if use_kernel is None:
            use_kernel = w_gate.dtype == torch.float32 and kernel.available()
        self.use_kernel = use_kernel
        self.weight_format = "fp32"
        self.int8: tuple[torch.Tensor, ...] | None = None  # codes and column scales, on first use

    @property
    def is_dense(self) -> bool:
        return self.thresh_in < 0 and self.thresh_mid < 0

    def to_dense(self) -> GatedMLP:
        """The dense FFN this module was made from (weights shared, not copied)."""
        hidden = self.w_down_t.shape[1]
        mlp = GatedMLP(hidden, self.intermediate_size).to(self.w_down_t.dtype)
        gate_t, up_t = self.w_gate_up_t.split(self.intermediate_size, dim=1)
        mlp.gate_proj.weight = nn.Parameter(gate_t.t(), requires_grad=False)
        mlp.up_proj.weight = nn.Parameter(up_t.t(), requires_grad=False)
        mlp.down_proj.weight = nn.Parameter(self.w_down_t.t(), requires_grad=False)
        return mlp

    @property
    def compilable(self) -> bool:
        """Whether a compiled graph can run it: dense, on the float rows (a matmul); sparse
        levels and int8 rows need the row kernel, which is not a torch op."""
        return self.is_dense and self.weight_format == "fp32"

    def set_weight_format(self, weight_format: str) -> None:
        """Which rows the kernel reads: "fp32" (the weights as loaded) or "int8"."""
        if weight_format not in WEIGHT_FORMATS:
            raise ValidationError(
                f"a sparse FFN reads {' or '.join(WEIGHT_FORMATS)} rows, not {weight_format!r}"
            )
        if weight_format == "int8" and self.int8 is None:
            self.int8 = (*int8_rows(self.w_gate_up_t), *int8_rows(self.w_down_t))
        self.weight_format = weight_format

    def _rows(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """(gate|up rows [D, 2I], their column scales, down rows [I, D], theirs) of the format."""
        if self.weight_format == "int8":
            return self.int8
        return self.w_gate_up_t, None, self.w_down_t, None

    def set_thresholds(self, thresh_in: float, thresh_mid: float) -> None:
        """Moves this FFN to another sparsity level (negative thresholds: dense)."""
        self.thresh_in, self.thresh_mid = float(thresh_in), float(thresh_mid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, D] -> [T, D]
        w_gate_up, scale_gate_up, w_down, scale_down = self._rows()
        if self.token_thresholds is not None:
            thresh_in, thresh_mid = self.token_thresholds.unbind(1)  # [T] each
        elif self.compilable and (not self.use_kernel or torch.compiler.is_compiling()):
            # (the kernel's row loop is the faster GEMV, but not a torch op a graph can call)
            gate, up = (x @ w_gate_up).split(self.intermediate_size, dim=-1)
            return (F.silu(gate) * up) @ w_down
        else:
            thresh_in = torch.full((x.shape[0],), self.thresh_in)
            thresh_mid = torch.full((x.shape[0],), self.thresh_mid)
        if self.use_kernel:
            return kernel.sparse_ffn(
                x,
                self.scale_in,
                thresh_in,
                w_gate_up,
                self.scale_mid,
                thresh_mid,
                w_down,
                self.dense_fraction,
                scale_gate_up,
                scale_down,
            )
        gate_up = _sparse_rows_torch(
            x, self.scale_in, thresh_in, w_gate_up, self.dense_fraction, scale_gate_up
        )
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        h = F.silu(gate) * up  # [T, I]
        return _sparse_rows_torch(
            h, self.scale_mid, thresh_mid, w_down, self.dense_fraction, scale_down
        )


def int8_rows(w_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Transposed float rows [K, N] -> (int8 codes [K, N], fp32 column scales [N]): the int8
    format's codes of the weight [N, K], per output channel."""
    w = w_t.t().float()  # [N, K]
    scales = int8_scales(w)  # bf16 [N]
    return codes_on_scale(w, scales).t().contiguous(), scales.float()


@contextmanager
def tokens_at_levels(mlps: list[SparseMLP | None], thresholds: torch.Tensor):
    """Inside, each of `mlps` (one per layer; None: an FFN without levels) runs each token at
    its own thresholds: thresholds [L, T, 2], (t_in, t_mid) of the L layers' FFNs for the next
    forward's T tokens (negative: dense)."""
    bound = [(mlp, t) for mlp, t in zip(mlps, thresholds, strict=True) if mlp is not None]
    try:
        for mlp, layer_thresholds in bound:
            mlp.token_thresholds = layer_thresholds
        yield
    finally:
        for mlp, _ in bound:
            mlp.token_thresholds = None


def _sparse_rows_torch(
    x: torch.Tensor,
    scale: torch.Tensor,
    thresh: torch.Tensor,
    w_t: torch.Tensor,
    dense_fraction: float,
    col_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel's contract in torch ops: index_select copies only the union's rows."""
    # x: [T, K], scale: [K], thresh: [T], w_t: [K, N] (int8 codes with col_scale [N]) -> [T, N]
    masked = x * (x.abs() * scale.to(x.dtype) > thresh[:, None].to(x.dtype))
    if col_scale is not None:
        w_t = w_t.to(x.dtype)
    rows = masked.ne(0).any(dim=0).nonzero().squeeze(1)  # [R]
    if rows.numel() > dense_fraction * x.shape[1]:
        y = masked @ w_t
    else:
        y = masked.index_select(1, rows) @ w_t.index_select(0, rows)
    return y if col_scale is None else y * col_scale.to(x.dtype)
