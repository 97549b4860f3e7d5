"""Sensitivity profiler: the quality cost of quantizing one unit of a model alone, per format.

A unit is one quantizable linear module (zcode.quant.quantizable_modules), except that the routed
experts of a MoE layer form one unit per projection ("model.layers.3.mlp.experts.*.down_proj"):
a plan gives them one format together. For each unit and format the unit's modules are quantized
by round-to-nearest and the model is run over calibration tokens; the cost is the mean KL
divergence KL(dense || quantized) of the next-token distributions over every position, and the
perplexity delta on the same tokens.

The shortcut that makes this affordable: a module in decoder layer L cannot change what layers
0..L-1 compute, so the dense outputs of every layer are recorded once and, while a unit of layer
L is measured, layers 0..L-1 are replaced by modules that return their recorded outputs. The
layers from L on run exactly the computation a full forward would run, so the result equals a
full rerun (tests/test_sensitivity.py checks it). Modules outside the decoder layers (lm_head)
replay every layer.
"""

import math
import re
from collections.abc import Iterable

import torch
from torch import nn
from tqdm import tqdm

from zcode.engine.kv_cache import KVCache
from zcode.forward_batch import ForwardBatch
from zcode.quant.apply import quantizable_modules
from zcode.quant.linear import Kernel, QuantizedLinear

DEFAULT_FORMATS = ("int8", "int4-g32", "int4-g128", "w8a8", "w4a8")
BLOCK_SIZE = 16
LAYER_PATTERN = re.compile(r"^(.*?layers)\.(\d+)\.(.+)$")
EXPERT_PATTERN = re.compile(r"\.experts\.\d+\.")


def unit_of(module_name: str) -> str:
    """The unit a module is planned in: itself, or its layer's expert group for one projection."""
    return EXPERT_PATTERN.sub(".experts.*.", module_name)


def layer_and_kind(unit: str) -> tuple[int | None, str]:
    """(layer index, kind): "model.layers.3.self_attn.q_proj" -> (3, "self_attn.q_proj");
    "lm_head" -> (None, "lm_head")."""
    match = LAYER_PATTERN.match(unit)
    return (int(match[2]), match[3]) if match else (None, unit)


class ReplayLayer(nn.Module):
    """Stands in for a decoder layer: returns the output that layer produced in the dense run."""

    def __init__(self, output) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args, **kwargs):
        return self.output


class SingleSequenceRunner:
    """Runs a model over one token sequence with a private paged KV cache, all logits wanted.

    Entering swaps a fresh cache into the attention layers; leaving gives back the ones they had
    (the engine's), so a profiled LLM keeps working.
    """

    def __init__(self, model: nn.Module, token_ids: list[int]) -> None:
        self.model = model
        self.input_ids = torch.tensor(token_ids, dtype=torch.int64)
        num_tokens = len(token_ids)
        num_blocks = math.ceil(num_tokens / BLOCK_SIZE)
        self.num_blocks = num_blocks
        self.batch = ForwardBatch.build(
            [num_tokens], [num_tokens], [list(range(num_blocks))], BLOCK_SIZE, [num_tokens]
        )

    def __enter__(self) -> "SingleSequenceRunner":
        layers = self.model.attention_layers()
        self.saved_caches = [dict(layer.cache) for layer in layers]  # KVCache binds in place
        dtype = next(self.model.parameters()).dtype
        KVCache(layers, self.num_blocks, BLOCK_SIZE, dtype)
        return self

    def __exit__(self, *exc) -> None:
        for layer, cache in zip(self.model.attention_layers(), self.saved_caches):
            layer.cache.clear()
            layer.cache.update(cache)

    @torch.inference_mode()
    def log_probs(self) -> torch.Tensor:
        """[T, V] fp32 log-softmax of the next-token logits at every position."""
        return torch.log_softmax(self.model(self.input_ids, self.batch), dim=-1)


def record_layer_outputs(
    model: nn.Module, runner: SingleSequenceRunner
) -> tuple[list, torch.Tensor]:
    """One dense run: (each decoder layer's output, the log-probs [T, V])."""
    outputs = []
    hooks = [
        layer.register_forward_hook(lambda _m, _a, out: outputs.append(out))
        for layer in model.model.layers
    ]
    try:
        log_probs = runner.log_probs()
    finally:
        for hook in hooks:
            hook.remove()
    return outputs, log_probs


def kl_and_nll(
    dense: torch.Tensor, quantized: torch.Tensor, target_ids: torch.Tensor
) -> tuple[float, float]:
    """Mean KL(dense || quantized) over positions and the quantized model's mean NLL.

    dense, quantized: [T, V] log-probs; target_ids: [T - 1], the token after each position.
    """
    kl = (dense.exp() * (dense - quantized)).sum(-1).mean().item()
    nll = -quantized[:-1].gather(1, target_ids[:, None]).mean().item()
    return kl, nll


class Swap:
    """Context manager: modules of `model` replaced by others by name, put back on exit."""

    def __init__(self, model: nn.Module, replacements: dict[str, nn.Module]) -> None:
        self.model, self.replacements = model, replacements

    def __enter__(self) -> None:
        self.originals = {}
        for name, new in self.replacements.items():
            parent_name, _, child = name.rpartition(".")
            parent = self.model.get_submodule(parent_name)
            self.originals[name] = getattr(parent, child)
            setattr(parent, child, new)  # a ModuleList takes "3" like any attribute

    def __exit__(self, *exc) -> None:
        for name, old in self.originals.items():
            parent_name, _, child = name.rpartition(".")
            setattr(self.model.get_submodule(parent_name), child, old)


def profile_sensitivity(
    model: nn.Module,
    token_ids: list[int],
    formats: Iterable[str] = DEFAULT_FORMATS,
    kernel: Kernel = "reference",
    shortcut: bool = True,
    units: Iterable[str] | None = None,
    progress: bool = True,
) -> dict:
    """The sensitivity profile of `model` on `token_ids` (see the module docstring).

    Returns {"num_tokens", "formats", "dense": {"nll", "ppl"}, "modules": {unit: {"members",
    "num_weights", "layer", "kind", "formats": {format: {"kl", "ppl_delta", "bytes"}}}}};
    `units` restricts the units measured (all by default); `shortcut=False` reruns every layer
    (the check of the shortcut). The reference kernel is the default: it measures the format's
    own rounding, not a fast kernel's (which may round activations to bf16, and is picked per
    machine), and gives the same numbers everywhere.
    """
    if len(token_ids) < 2:
        raise ValueError("profiling needs at least 2 calibration tokens")
    formats = list(formats)
    modules = dict(model.named_modules())
    members: dict[str, list[str]] = {}
    for name in quantizable_modules(model):
        members.setdefault(unit_of(name), []).append(name)
    if units is not None:
        wanted = set(units)
        unknown = wanted - set(members)
        if unknown:
            raise ValueError(f"no such units: {', '.join(sorted(unknown))}")
        members = {u: m for u, m in members.items() if u in wanted}
    num_layers = len(model.model.layers)
    target_ids = torch.tensor(token_ids[1:], dtype=torch.int64)
    with SingleSequenceRunner(model, token_ids) as runner:
        layer_outputs, dense = record_layer_outputs(model, runner)
        dense_nll = -dense[:-1].gather(1, target_ids[:, None]).mean().item()
        report = {
            "num_tokens": len(token_ids),
            "formats": formats,
            "dense": {"nll": dense_nll, "ppl": math.exp(dense_nll)},
            "modules": {},
        }
        bar = tqdm(total=len(members) * len(formats), desc="sensitivity", disable=not progress)
        for unit, names in members.items():
            layer, kind = layer_and_kind(unit)
            if layer is None:
                first_rerun = num_layers if unit == "lm_head" else 0
            else:
                first_rerun = layer
            replay = {
                f"model.layers.{i}": ReplayLayer(layer_outputs[i])
                for i in range(first_rerun if shortcut else 0)
            }
            entry = {
                "members": names,
                "num_weights": sum(modules[n].weight.numel() for n in names),
                "layer": layer,
                "kind": kind,
                "formats": {},
            }
            for fmt in formats:
                quantized = {n: QuantizedLinear.from_linear(modules[n], fmt, kernel) for n in names}
                with Swap(model, {**replay, **quantized}):
                    kl, nll = kl_and_nll(dense, runner.log_probs(), target_ids)
                entry["formats"][fmt] = {
                    "kl": kl,
                    "ppl_delta": math.exp(nll) - math.exp(dense_nll),
                    "bytes": sum(q.weight_bytes for q in quantized.values()),
                }
                bar.update()
            report["modules"][unit] = entry
        bar.close()
    return report
