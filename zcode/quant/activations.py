"""What each linear layer sees on calibration text: the Hessian H = X^T X of its inputs.

Forward hooks on the named modules sum x^T x over every row the model runs while the engine
prefills calibration windows. All Hessians come from the float model in one pass (the layers are
not re-run after earlier ones are quantized, unlike GPTQ's sequential variant): one forward pass
per window instead of one per layer. Modules fed the very same tensor (q/k/v, gate/up) share one
product per call. Sums are fp32 (~520 MB for SmolLM2-135M's 211 linears).
"""

from collections.abc import Sequence

import torch
from torch import nn
from tqdm import tqdm

from zcode.llm import LLM
from zcode.sampling_params import SamplingParams

CALIBRATION_TOKENS = 2048
CALIBRATION_WINDOW = 512


class HessianCollector:
    """Hooks that sum x^T x into `hessians[name]` ([K, K] fp32) and count the rows."""

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        modules = dict(model.named_modules())
        missing = [n for n in names if n not in modules]
        if missing:
            raise ValueError(f"no such modules in {type(model).__name__}: {missing[:5]}")
        self.hessians: dict[str, torch.Tensor] = {}
        self.num_rows: dict[str, int] = {}
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # (input, its x^T x)
        self._handles = [
            modules[name].register_forward_pre_hook(self._hook(name)) for name in names
        ]

    def _hook(self, name: str):
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            x = inputs[0]
            if self._last is not None and self._last[0] is x:
                product = self._last[1]
            else:
                rows = x.reshape(-1, x.shape[-1]).float()  # [T, K]
                product = rows.T @ rows  # [K, K]
                self._last = (x, product)
            if name in self.hessians:
                self.hessians[name] += product
            else:
                self.hessians[name] = product.clone()
            self.num_rows[name] = self.num_rows.get(name, 0) + x.numel() // x.shape[-1]

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._last = None


def collect_hessians(
    llm: LLM,
    token_ids: Sequence[int],
    names: Sequence[str],
    window: int = CALIBRATION_WINDOW,
) -> dict[str, torch.Tensor]:
    """X^T X of each named module's inputs over `token_ids`, run in windows of `window` tokens
    (non-overlapping, so prefix caching reuses nothing). Returns {name: [K, K] fp32} for the
    modules that ran: a MoE expert no calibration token was routed to has no entry."""
    if len(token_ids) < 2:
        raise ValueError("calibration needs at least 2 tokens")
    collector = HessianCollector(llm.model, names)
    # prompt_logprobs: the engine then runs lm_head on every position, not only the last one
    # (without it lm_head's Hessian had one row per window, and GPTQ overfit it).
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=0)
    chunks = [list(token_ids[i : i + window]) for i in range(0, len(token_ids), window)]
    try:
        for chunk in tqdm(chunks, desc="calibration windows", unit="window"):
            llm.generate([chunk], params)
    finally:
        collector.remove()
    return collector.hessians
