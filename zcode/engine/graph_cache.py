"""The plan cache: compiled decode steps keyed by (plan signature, batch-size bucket).

A decode step (one new token per sequence) is traced whole by torch.compile with inductor (C++
codegen on CPU) and reused for every later step with the same key. Shapes are static except the
context length: the batch is padded to a power-of-two bucket and `ForwardBatch.build_decode`
always supplies a mask, so a step only recompiles when the plan or the bucket changes.

`num_compiles` counts the graphs inductor actually built (a recompile of an existing key counts
too), so "a second request with the same plan does not recompile" is a counted fact.
"""

import time
import types
from collections.abc import Callable

import torch
from torch import nn

from zcode.forward_batch import ForwardBatch


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... up to the first power of two that holds max_num_seqs."""
    buckets = [1]
    while buckets[-1] < max_num_seqs:
        buckets.append(buckets[-1] * 2)
    return buckets


def _decode_step(model: nn.Module, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    return model(input_ids, batch)


class GraphCache:
    def __init__(self, model: nn.Module, max_num_seqs: int) -> None:
        self.model = model
        self.buckets = batch_buckets(max_num_seqs)
        self.graphs: dict[tuple[str, int], Callable] = {}
        self.num_compiles = 0
        self.compile_s = 0.0  # wall time of first calls per key (trace + codegen + one run)

    def bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def run(self, signature: str, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids: [B] for a batch from ForwardBatch.build_decode -> logits [B, V] fp32."""
        key = (signature, batch.num_seqs)
        graph = self.graphs.get(key)
        if graph is not None:
            # Guards are skipped: each key has its own code object with one compiled entry, and
            # what they would check (the plan, the bucket) is the key itself. Evaluating them
            # cost ~2 ms a step, one guard per parameter and module attribute the graph reads.
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return graph(self.model, input_ids, batch)
        # Without automatic dynamic shapes, a dimension is symbolic only if marked below: dynamo
        # would otherwise make dims dynamic from shapes other graphs (other buckets, models, even
        # earlier processes through its on-disk profile) saw under the same function name.
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            graph = self.graphs[key] = self._new_graph()
            # Only the context axis varies between steps of one key.
            torch._dynamo.mark_dynamic(batch.context_slots, 1)
            torch._dynamo.mark_dynamic(batch.attn_mask, 3)
            start = time.perf_counter()
            logits = graph(self.model, input_ids, batch)
        self.compile_s += time.perf_counter() - start
        return logits

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
        return compiled


CONFIG_PATCHES = {"cpp_wrapper": True}
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
