"""Routing predictor for FFN neuron blocks (Deja Vu style, arXiv 2310.17157): per layer a
low-rank net x -> [num_blocks] scores, trained on the model's own FFN inputs from calibration
text to rank the neuron blocks that matter for this token, i.e. whose contribution
||W_down[:, block] @ h[block]|| is among the token's top `keep` fraction.

PredictedMLP then computes gate/up only for the predicted blocks' rows and down only for their
rows (index_select copies just those rows), so it skips weight reads of all three matrices, not
only of down_proj as magnitude thresholds on h do.
"""

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from zcode.layers.mlp import GatedMLP
from zcode.sparsity.thresholds import gated_mlps

BLOCK = 64  # neurons per block: one block is 64 rows of each FFN matrix


class BlockPredictor(nn.Module):
    """x [T, D] -> block scores [T, I / BLOCK], rank `rank`."""

    def __init__(self, hidden_size: int, num_blocks: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(hidden_size, rank, bias=False)
        self.up = nn.Linear(rank, num_blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x.float()))


def block_contributions(mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    """[T, num_blocks]: the norm of what each neuron block adds to the FFN output."""
    x = x.float()
    gate = F.linear(x, mlp.gate_proj.weight.float())
    h = F.silu(gate) * F.linear(x, mlp.up_proj.weight.float())  # [T, I]
    num_tokens, inter = h.shape
    hb = h.view(num_tokens, inter // BLOCK, BLOCK)
    wd = mlp.down_proj.weight.float().view(-1, inter // BLOCK, BLOCK)  # [D, NB, BLOCK]
    return torch.einsum("tbk,dbk->tbd", hb, wd).norm(dim=-1)


class FFNInputRecorder:
    """Pre-hooks keeping each GatedMLP's input x (float32) per layer."""

    def __init__(self, model: nn.Module) -> None:
        self.mlps = gated_mlps(model)
        self.inputs: dict[int, list[torch.Tensor]] = {i: [] for i in self.mlps}
        self._handles = []

    def __enter__(self) -> "FFNInputRecorder":
        for i, mlp in self.mlps.items():
            self._handles.append(mlp.register_forward_pre_hook(self._hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()

    def _hook(self, layer: int):
        def hook(_module, args):
            self.inputs[layer].append(args[0].detach().float().clone())

        return hook

    def stacked(self) -> dict[int, torch.Tensor]:
        return {i: torch.cat(chunks) for i, chunks in self.inputs.items()}


def labels(contrib: torch.Tensor, keep: float) -> torch.Tensor:
    """[T, NB] bool: the token's top `keep` fraction of blocks by contribution."""
    k = max(1, round(keep * contrib.shape[1]))
    top = contrib.topk(k, dim=1).indices
    return torch.zeros_like(contrib, dtype=torch.bool).scatter_(1, top, True)


def train_predictors(
    model: nn.Module,
    inputs: dict[int, torch.Tensor],
    keep: float,
    rank: int = 4,
    epochs: int = 60,
    progress: bool = True,
) -> dict[int, BlockPredictor]:
    mlps = gated_mlps(model)
    out = {}
    for i in tqdm(sorted(inputs), desc="predictors", disable=not progress):
        mlp, x = mlps[i], inputs[i]
        with torch.no_grad():
            y = labels(block_contributions(mlp, x), keep).float()
        net = BlockPredictor(x.shape[1], y.shape[1], rank)
        opt = torch.optim.Adam(net.parameters(), lr=3e-3)
        for _ in range(epochs):
            opt.zero_grad()
            loss = F.binary_cross_entropy_with_logits(net(x), y)
            loss.backward()
            opt.step()
        out[i] = net.requires_grad_(False)
    return out


def recall_precision(
    model: nn.Module,
    predictors: dict[int, BlockPredictor],
    inputs: dict[int, torch.Tensor],
    keep: float,
) -> dict[str, float]:
    """On held-out FFN inputs: mean recall and precision of the predicted top-`keep` blocks
    against the true top-`keep` blocks, and the share of the true contribution norm kept."""
    mlps = gated_mlps(model)
    hits = truths = preds = 0.0
    mass_kept = mass_total = 0.0
    for i, net in predictors.items():
        with torch.no_grad():
            contrib = block_contributions(mlps[i], inputs[i])
            truth = labels(contrib, keep)
            pred = labels(net(inputs[i]), keep)
        hits += (truth & pred).sum().item()
        truths += truth.sum().item()
        preds += pred.sum().item()
        mass_kept += (contrib * pred).sum().item()
        mass_total += contrib.sum().item()
    return {
        "recall": hits / truths,
        "precision": hits / preds,
        "contribution_kept": mass_kept / mass_total,
    }


class PredictedMLP(nn.Module):
    """SwiGLU FFN over the predicted neuron blocks only (per batch: the union of its tokens')."""

    def __init__(self, mlp: GatedMLP, predictor: BlockPredictor, keep: float) -> None:
        super().__init__()
        self.dense = mlp  # gate/up rows are read from it; kept whole so the plan can be undone
        self.predictor, self.keep = predictor, keep
        # [I, D]: one neuron's down_proj column as one contiguous row
        self.w_down_t = nn.Parameter(mlp.down_proj.weight.t().contiguous(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, D] -> [T, D]
        chosen = labels(self.predictor(x), self.keep)  # [T, NB]
        blocks = chosen.any(0).nonzero().squeeze(1)  # [B]
        rows = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).flatten()  # [B * BLOCK]
        gate = x @ self.dense.gate_proj.weight.index_select(0, rows).t()
        up = x @ self.dense.up_proj.weight.index_select(0, rows).t()
        h = F.silu(gate) * up  # [T, R]
        token_mask = chosen[:, blocks].repeat_interleave(BLOCK, dim=1)  # each token its own
        return (h * token_mask) @ self.w_down_t.index_select(0, rows)


def predictor_state(predictors: dict[int, BlockPredictor], keep: float, rank: int) -> dict:
    return {
        "keep": keep,
        "rank": rank,
        "block": BLOCK,
        "layers": {str(i): net.state_dict() for i, net in predictors.items()},
    }


def load_predictors(state: dict, hidden_size: int) -> dict[int, BlockPredictor]:
    out = {}
    for key, sd in state["layers"].items():
        net = BlockPredictor(hidden_size, sd["up.weight"].shape[0], state["rank"])
        net.load_state_dict(sd)
        out[int(key)] = net.requires_grad_(False)
    return out


def num_parameters(predictors: dict[int, BlockPredictor]) -> int:
    return sum(p.numel() for net in predictors.values() for p in net.parameters())
