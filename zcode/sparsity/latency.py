"""The bytes of weights a plan reads per decode token (a bench's yardstick). Latency itself is
predicted by the one hardware cost model (zcode.hardware.cost_model), through the planner."""

from torch import nn

from zcode.layers.mlp import GatedMLP
from zcode.sparsity.layer_skip import SkippedLayer
from zcode.sparsity.predictor import PredictedMLP
from zcode.sparsity.sparse_mlp import SparseMLP


def weight_mb_per_token(model: nn.Module, ffn_density: float = 1.0) -> float:
    """MB of weights a batch-1 decode step reads under a plan with this FFN density (fraction of
    FFN weight rows read), whatever level the modules are at now: every linear of every layer
    that runs, the FFNs scaled, the LM head, one embedding row."""
    total = 0.0
    for layer in model.model.layers:
        if isinstance(layer, SkippedLayer):
            continue
        mlp = getattr(layer, "mlp", None)
        ffn_ids = set()
        if isinstance(mlp, (SparseMLP, GatedMLP, PredictedMLP)):
            ffn_ids = {id(p) for p in mlp.parameters()}
            total += ffn_density * _ffn_bytes(mlp)
        for module in layer.modules():
            if isinstance(module, nn.Linear) and id(module.weight) not in ffn_ids:
                total += module.weight.nbytes
    total += model.lm_head.weight.nbytes
    total += model.model.embed_tokens.weight[0].nbytes
    return total / 1e6


def _ffn_bytes(mlp: nn.Module) -> int:
    """Bytes of the three FFN matrices, whatever layout the module keeps them in."""
    if isinstance(mlp, PredictedMLP):
        mlp = mlp.dense
    return sum(_ffn_matrix_bytes(mlp))


def _ffn_matrix_bytes(mlp: nn.Module) -> tuple[int, int]:
    """(bytes of gate and up together, bytes of down)."""
    if isinstance(mlp, SparseMLP):
        return mlp.w_gate_up_t.nbytes, mlp.w_down_t.nbytes
    return mlp.gate_proj.weight.nbytes + mlp.up_proj.weight.nbytes, mlp.down_proj.weight.nbytes
