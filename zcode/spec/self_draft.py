"""Self-drafting: the same model under a cheaper plan proposes, the full plan verifies.

The cheaper plan skips decoder layers (LayerSkip / Draft & Verify style), or runs every linear
in a quantized weight format (`QuantizedDrafter`: int8 by default, whose greedy tokens are
mostly the full model's). It is a second module tree over the model's tensors
(`zcode.quant.variants.copy_with`) with the cheaper modules in place, so the model itself never
changes and, in an engine that compiles decode steps, the draft's steps are compiled graphs of
their own. It reads the full model's KV of the computed context, and writes its own KV of the
draft positions into the slots the verifying forward then overwrites, so it needs no cache of
its own.
"""

import time

import torch
from torch import nn

from zcode.engine.graph_cache import GraphCache
from zcode.engine.sequence import Sequence
from zcode.engine.step_times import StepTimes
from zcode.errors import ValidationError
from zcode.harness.plan import ExecutionPlan
from zcode.models.base import Backbone
from zcode.quant.variants import copy_with
from zcode.sparsity.layer_skip import SkippedLayer
from zcode.spec.drafter import Drafter


class SelfDrafter(Drafter):
    """Drafts greedily with `self.model`, the engine's model with `modules` in place, one
    decode step per draft position (compiled where the engine compiles its steps)."""

    def __init__(self, runner, modules: dict[str, nn.Module]) -> None:
        """runner: the engine's ModelRunner; modules: the draft's modules by name."""
        self.runner = runner
        self.model = copy_with(runner.model, modules)
        self.graphs = None
        if runner.graphs is not None:
            self.graphs = GraphCache(self.model, runner.graphs.buckets[-1])
            self.graphs.model_changed()  # MoE layers gather the draft's expert weights
        # ms of a compiled draft step by its batch bucket, its batch building and argmax with
        # it: what the draft policy prices draft steps it has seen by
        self.step_times = StepTimes()

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], max_num_tokens: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        compiled = self.graphs is not None and self.runner.pages is None  # steps timed if so
        for step in range(max(max_num_tokens, default=0)):
            rows = [i for i, n in enumerate(max_num_tokens) if n > step]
            # Row i feeds its newest token (the last known one, then its latest draft).
            input_ids = [drafts[i][-1] if drafts[i] else seqs[i].token_ids[-1] for i in rows]
            context_lens = [seqs[i].num_tokens + len(drafts[i]) for i in rows]
            start, compiles = time.perf_counter(), self.graphs.num_compiles if compiled else 0
            logits = self.runner.decode(
                self.model, self.graphs, [seqs[i] for i in rows], input_ids, context_lens
            )
            # numpy's argmax: ~3 us over a 49152-token vocabulary, torch's ~75 (Sampler)
            for i, token in zip(rows, logits.float().numpy().argmax(-1).tolist()):  # [R, V]
                drafts[i].append(token)
            if compiled and self.graphs.num_compiles == compiles:  # not a step that compiled
                ms = 1e3 * (time.perf_counter() - start)
                self.step_times.record(self.graphs.bucket(len(rows)), ms)
        return drafts


def default_skip_layers(num_layers: int) -> tuple[int, ...]:
    """Every other layer strictly inside the stack: about half the cost; the first and last
    layers, whose removal breaks small models outright, always run."""
    return tuple(range(1, num_layers - 1, 2))


class SkipLayersDrafter(SelfDrafter):
    def __init__(self, runner, skip_layer_ids: tuple[int, ...] | None = None) -> None:
        """runner: the engine's ModelRunner; skip_layer_ids: the decoder layers the draft
        skips (default: `default_skip_layers`)."""
        model = runner.model
        if type(model.model).forward is not Backbone.forward:
            raise NotImplementedError(
                f"speculative='skip_layers' for {type(model).__name__}: its layers pass state to "
                "the next (DSA's index selections), which a skipped layer breaks; use 'ngram'"
            )
        num_layers = len(model.model.layers)
        if skip_layer_ids is None:
            skip_layer_ids = default_skip_layers(num_layers)
        bad = [i for i in skip_layer_ids if not 0 <= i < num_layers]
        if bad or not skip_layer_ids or len(set(skip_layer_ids)) >= num_layers:
            raise ValidationError(
                f"draft_skip_layers must name some but not all of the {num_layers} layers, "
                f"got {list(skip_layer_ids)}"
            )
        self.skip_layer_ids = tuple(sorted(set(skip_layer_ids)))
        layers = model.model.layers
        super().__init__(
            runner, {f"model.layers.{i}": SkippedLayer(layers[i]) for i in self.skip_layer_ids}
        )

    def cost_plan(self, num_layers: int) -> ExecutionPlan:
        return ExecutionPlan(name="draft", skip_layers=self.skip_layer_ids)


class QuantizedDrafter(SelfDrafter):
    def __init__(self, runner, fmt: str = "int8") -> None:
        """runner: the engine's ModelRunner; fmt: the weight format (zcode.quant.linear.FORMATS)
        every quantizable linear of the draft runs in: round-to-nearest copies, built once
        (their bytes beside the model's: a quarter of an fp32 model's in int8)."""
        from zcode.quant.apply import quantizable_modules, quantize_linear
        from zcode.quant.linear import FORMATS

        if fmt not in FORMATS:
            raise ValidationError(f"draft_format must be one of {sorted(FORMATS)}, got {fmt!r}")
        model = runner.model
        self.format = fmt
        self.names = sorted(quantizable_modules(model))
        super().__init__(
            runner, {name: quantize_linear(model.get_submodule(name), fmt) for name in self.names}
        )

    def cost_plan(self, num_layers: int) -> ExecutionPlan:
        return ExecutionPlan(
            name="draft", precision=tuple((name, self.format) for name in self.names)
        )
