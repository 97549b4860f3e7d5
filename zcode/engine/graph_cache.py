"""The plan cache: compiled decode steps keyed by (plan signature, batch-size bucket, query width).

A decode step (one new token per sequence, or a fixed width of a token and its drafts to verify)
is traced whole by torch.compile with inductor (C++
codegen on CPU) and reused for every later step with the same key. Shapes are static except the
context length: the batch is padded to a power-of-two bucket and `ForwardBatch.build_decode`
always supplies a mask, so a step only recompiles when the plan or the bucket changes.

`num_compiles` counts the graphs inductor actually built (a recompile of an existing key counts
too), so "a second request with the same plan does not recompile" is a counted fact.

After its first call a key's graph is called directly (`DirectStep`), without dynamo: no frame
evaluation, guards or argument-gathering bytecode (~1 ms a step: W4A8 decode 135 -> 157 tok/s).
Its model tensors are taken once and again at each `model_changed()`, which ModelRunner.set_plan
calls; so code that swaps model tensors must call set_plan, as code that changes what a step
computes already had to (a direct step does not look for them otherwise).
"""

import dataclasses
import itertools
import logging
import time
import types
from collections.abc import Callable

import torch
from torch import nn

from zcode.forward_batch import ForwardBatch
from zcode.layers.moe import MoE

logger = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... up to the first power of two that holds max_num_seqs."""
    buckets = [1]
    while buckets[-1] < max_num_seqs:
        buckets.append(buckets[-1] * 2)
    return buckets


def graph_width(max_query_len: int) -> int:
    """A compiled step's query width: a row's longest query (1 + the most drafts of a row)
    rounded up to a power of two, so few graphs cover every draft count."""
    return 1 << (max_query_len - 1).bit_length()


def _decode_step(model: nn.Module, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    return model(input_ids, batch)


class GraphCache:
    def __init__(self, model: nn.Module, max_num_seqs: int) -> None:
        self.model = model
        self.buckets = batch_buckets(max_num_seqs)
        self.graphs: dict[tuple[str, int, int], Callable] = {}
        self.direct: dict[tuple[str, int, int], DirectStep] = {}
        self._compiled: tuple[Callable, list] | None = None  # set by _backend during a compile
        self.num_compiles = 0
        self.compile_s = 0.0  # wall time of first calls per key (trace + codegen + one run)

    def bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def run(self, signature: str, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids: [B * S] for a batch from ForwardBatch.build_decode (S: its query width)
        -> logits [B * S, V] fp32."""
        key = (signature, batch.num_seqs, batch.query_index.shape[1])
        if (direct := self.direct.get(key)) is not None:
            if direct.is_current() or direct.refresh(self.model):
                return direct(input_ids, batch)
            del self.direct[key]
        # Without automatic dynamic shapes, a dimension is symbolic only if marked below: dynamo
        # would otherwise make dims dynamic from shapes other graphs (other buckets, models, even
        # earlier processes through its on-disk profile) saw under the same function name.
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            if (graph := self.graphs.get(key)) is None:
                graph = self.graphs[key] = self._new_graph()
            # Only the context axis varies between steps of one key (marked for recompiles too).
            torch._dynamo.mark_dynamic(batch.context_slots, 1)
            torch._dynamo.mark_dynamic(batch.attn_mask, 3)
            if batch.paging is not None:
                torch._dynamo.mark_dynamic(batch.paging.context_slots, 2)
            # With dynamo's guards: a changed tensor (the graph has no size asserts) recompiles.
            start = time.perf_counter()
            self._compiled = None
            logits = graph(self.model, input_ids, batch)
        if self._compiled is not None:  # a (re)compile: the rest of this key's steps are direct
            self.compile_s += time.perf_counter() - start
            direct = DirectStep.capture(*self._compiled, self.model, input_ids, batch)
            if direct is not None:
                self.direct[key] = direct
        return logits

    def model_changed(self) -> None:
        """Re-reads the model tensors every direct step passes (modules may have been swapped;
        MoE layers gather their experts' weights again first); a step whose tensors are gone or
        changed shape goes back to dynamo."""
        for module in self.model.modules():
            if isinstance(module, MoE):  # the expert stacks its graphs pass
                module.gather_weights()
        self.direct = {key: d for key, d in self.direct.items() if d.refresh(self.model)}

    def _new_graph(self) -> Callable:
        # dynamo keeps compiled entries (and its recompile limit) per code object: a fresh copy
        # per key keeps keys from evicting each other and guard checks to one entry.
        step = types.FunctionType(
            _decode_step.__code__.replace(), _decode_step.__globals__, "decode_step"
        )
        return torch.compile(step, backend=self._backend, fullgraph=True)

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx
        from torch._inductor.decomposition import select_decomp_table

        decompositions = select_decomp_table() | {torch.ops.aten.mm.default: _gemv_as_reduction}
        compiled = compile_fx(
            gm, example_inputs, decompositions=decompositions, config_patches=CONFIG_PATCHES
        )
        self.num_compiles += 1
        self._compiled = (compiled, list(example_inputs))
        return compiled


# The C++ wrapper calls kernels without Python in between. Inductor's asserts of every input's
# size, stride and alignment on every call (~500 inputs, model tensors included) cost ~0.4 ms a
# W4A8 decode step; dynamo's guards check inputs where dynamo runs, and DirectStep checks the
# model tensors when it (re)reads them.
# emulate_precision_casts: inductor otherwise keeps a fused kernel's 16-bit intermediates in fp32
# and rounds only what it stores, and which ops fuse depends on the graph's shape, so a verifying
# graph (1 row x 4 tokens) gave a row other bf16 bits than the plain step (1 x 1): SmolLM2 bf16
# greedy decoding with drafts left plain decoding's tokens at token 61.
CONFIG_PATCHES = {
    "cpp_wrapper": True,
    "size_asserts": False,
    "alignment_asserts": False,
    "emulate_precision_casts": True,
}
REDUCTION_MAX_ROWS = 2
REDUCTION_DTYPES = (torch.bfloat16, torch.float16)


def _gemv_as_reduction(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """x @ w_t for a few rows of 16-bit floats as multiply + sum (where the C++ GEMV of
    zcode.kernels.gemv does not build, or for matmuls outside its linears), which inductor turns
    into one vectorised loop that widens the weights in registers. aten's bf16 matrix-vector product
    streams weights at about half its fp32 rate (SmolLM2's 211 GEMVs on one thread here: 7.5
    against 13.3 GB/s); bench_decode_overhead.py shows the effect on whole decode steps.
    """
    # x: [M, K]; w_t: [K, N] (a transposed [N, K] weight) -> [M, N]
    if x.shape[0] > REDUCTION_MAX_ROWS or x.dtype not in REDUCTION_DTYPES:
        return NotImplemented
    products = x[:, None, :].float() * w_t.t()[None].float()  # [M, N, K]
    return products.sum(-1).to(x.dtype)


@dataclasses.dataclass
class DirectStep:
    """One key's compiled graph, called with its inputs gathered without dynamo.

    Each graph input is a model tensor (a parameter, buffer or tensor attribute such as the KV
    cache, found by identity when the graph was compiled), a ForwardBatch field, the input ids,
    or the context length (the one symbolic size). Model tensors are read at capture and at each
    `refresh`; tensors held in dict attributes (the KV cache, which a new engine on the same
    model replaces) are also checked by identity on every call.
    """

    compiled: Callable
    sources: list[tuple[str, str]]  # per graph input: (kind, name)
    layouts: dict[str, tuple]  # model tensor name -> (shape, stride, dtype) it was compiled for
    args: list = dataclasses.field(default_factory=list)  # model tensors; the rest per call
    per_call: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)
    in_dicts: list[tuple[int, nn.Module, str, str]] = dataclasses.field(default_factory=list)

    @classmethod
    def capture(
        cls,
        compiled: Callable,
        example_inputs: list,
        model: nn.Module,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
    ) -> "DirectStep | None":
        """None (dynamo keeps calling the graph) when an input is none of those kinds."""
        owners = {id(t): name for name, t, _ in _model_tensors(model)}
        fields = {id(t): name for name, t in _batch_tensors(batch)}
        sources = []
        for x in example_inputs:
            if x is input_ids:
                sources.append(("input_ids", ""))
            elif isinstance(x, torch.Tensor) and id(x) in fields:
                sources.append(("batch", fields[id(x)]))
            elif isinstance(x, torch.Tensor) and id(x) in owners:
                sources.append(("model", owners[id(x)]))
            elif isinstance(x, torch.SymInt):
                sources.append(("context_len", ""))
            else:
                logger.debug("decode graph input %s has no known source", type(x).__name__)
                return None
        layouts = {
            name: _layout(x) for x, (kind, name) in zip(example_inputs, sources) if kind == "model"
        }
        step = cls(compiled, sources, layouts)
        step.per_call = [(i, k, n) for i, (k, n) in enumerate(sources) if k != "model"]
        return step if step.refresh(model) else None

    def refresh(self, model: nn.Module) -> bool:
        """Re-reads the model tensors; False if one of them no longer exists or has another
        shape, stride or dtype than the graph was compiled for (the graph does not check: it is
        built without inductor's per-call size asserts, ~0.4 ms a step)."""
        tensors = {name: (t, holder) for name, t, holder in _model_tensors(model)}
        if any(
            name not in tensors or _layout(tensors[name][0]) != layout
            for name, layout in self.layouts.items()
        ):
            return False
        self.args = [tensors[name][0] if kind == "model" else None for kind, name in self.sources]
        self.in_dicts = [
            (i, *tensors[name][1])
            for i, (kind, name) in enumerate(self.sources)
            if kind == "model" and tensors[name][1] is not None
        ]
        return True

    def is_current(self) -> bool:
        return all(getattr(m, attr)[key] is self.args[i] for i, m, attr, key in self.in_dicts)

    def __call__(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        args = self.args.copy()
        tensors = dict(_batch_tensors(batch))
        for i, kind, name in self.per_call:
            if kind == "batch":
                args[i] = tensors[name]
            elif kind == "input_ids":
                args[i] = input_ids
            else:  # the context length: the graph's one symbolic size
                args[i] = batch.context_slots.shape[1]
        (logits,) = self.compiled(*args)
        return logits


def _batch_tensors(batch: ForwardBatch):
    """(name, tensor) for every tensor a step reads from its batch: the ForwardBatch fields and,
    with per-request skips, its LayerPaging's slots and head masks."""
    for f in dataclasses.fields(batch):
        yield f.name, getattr(batch, f.name)
    if batch.paging is not None:
        yield "paging.slot_mapping", batch.paging.slot_mapping
        yield "paging.context_slots", batch.paging.context_slots
        for layer, keep in batch.paging.head_keep.items():
            yield f"paging.head_keep[{layer}]", keep


def _layout(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device


def _model_tensors(model: nn.Module):
    """(dotted name, tensor, holder) for every parameter, buffer and tensor attribute of every
    module, and every tensor in a public dict attribute (the KV cache: `attention.cache[name]`),
    whose holder is (module, attribute, key); holder is None otherwise."""
    for prefix, module in model.named_modules():
        attrs = itertools.chain(
            module._parameters.items(), module._buffers.items(), vars(module).items()
        )
        for attr, value in attrs:
            name = f"{prefix}.{attr}" if prefix else attr
            if isinstance(value, torch.Tensor):
                yield name, value, None
            elif isinstance(value, dict) and not attr.startswith("_"):
                # Public dicts only: vars() also holds nn.Module's own _parameters and _buffers,
                # whose tensors are yielded above; as dict entries each would be checked per call.
                for key, item in value.items():
                    if isinstance(item, torch.Tensor):
                        yield f"{name}[{key}]", item, (module, attr, key)
