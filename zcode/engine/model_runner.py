"""Owns the model and its KV cache; turns a scheduled step into one forward pass."""

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from zcode.engine.graph_cache import GraphCache, graph_width
from zcode.engine.kv_cache import KVCache, page_layout
from zcode.engine.page_pool import LayerPaging, PagePool
from zcode.engine.scheduler import ScheduledSeq
from zcode.engine.sequence import Sequence
from zcode.forward_batch import ForwardBatch
from zcode.harness.plan import ExecutionPlan
from zcode.layers.linear import gemv_row_limit
from zcode.models.base import Backbone
from zcode.sparsity.sparse_mlp import SparseMLP

LOGICAL_BLOCKS_PER_BLOCK = 4
# (input_ids [T], batch, the backbone's final hidden states [T, D]) -> None
HiddenObserver = Callable[[torch.Tensor, ForwardBatch, torch.Tensor], None]


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        compile: bool = False,
        max_num_seqs: int = 64,
        per_request_depth: bool = False,
    ):
        """num_blocks: KV blocks of all layers that fit the cache memory. per_request_depth: the
        same memory as pages of one KV head of one layer each (`pages`), so requests may skip
        layers and heads; `num_blocks` then counts the logical blocks the pool serves."""
        self.model = model
        self.block_size = block_size
        self.pages = None
        layers = model.attention_layers()
        if per_request_depth:
            self._check_paging()
            _, heads_per_layer = page_layout(layers)
            num_pages = num_blocks * sum(heads_per_layer)
            # Logical blocks for requests that keep down to 1/LOGICAL_BLOCKS_PER_BLOCK of the KV;
            # one per page would make the page table as large as a tenth of the cache.
            num_logical = min(num_pages, LOGICAL_BLOCKS_PER_BLOCK * num_blocks)
            self.pages = PagePool(heads_per_layer, num_pages + 1, num_blocks=num_logical)
            self.kv_cache = KVCache(layers, num_pages + 1, block_size, dtype, shared_pages=True)
            num_blocks = num_logical
        else:
            self.kv_cache = KVCache(layers, num_blocks + 1, block_size, dtype)
        self.num_blocks = num_blocks
        # One block past those the block manager hands out: padding rows of a compiled decode
        # step write their KV there (with pages: the null page).
        self.pad_block = num_blocks
        self.graphs = GraphCache(model, max_num_seqs) if compile else None
        self.graph_shape: tuple[int, int] | None = None  # (rows, width) the last execute ran
        # Sees the final hidden states of each eager forward: the MTP drafter's input
        # (zcode/spec/mtp.py).
        self.hidden_observer: HiddenObserver | None = None
        self.set_plan(ExecutionPlan())

    def _check_paging(self) -> None:
        if type(self.model.model).forward is not Backbone.forward:
            raise NotImplementedError(
                f"per-request layer skipping for {type(self.model).__name__}: its layers pass "
                "state to the next (DSA's shared index selections), which a skipped layer breaks"
            )

    def set_plan(self, plan: ExecutionPlan) -> None:
        """Declares the plan the model now runs (after its modules were changed to follow it,
        by zcode.harness.executor); compiled decode steps are looked up by its signature. A plan
        with sparse FFN levels or int8 FFN rows decodes eagerly: the row-skipping kernel is not a
        torch op yet."""
        self.plan, self.plan_signature = plan, plan.signature()
        if self.graphs is not None:
            self.graphs.model_changed()
        self.compiles_plan = self.graphs is not None and not any(
            isinstance(m, SparseMLP) and not m.compilable for m in self.model.modules()
        )
        self.gemv_row_limit = gemv_row_limit(self.model)

    @property
    def num_graph_compiles(self) -> int:
        """Decode graphs compiled so far (0 when compilation is off)."""
        return 0 if self.graphs is None else self.graphs.num_compiles

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], row_settings=None) -> list[torch.Tensor]:
        """Runs one step; returns per scheduled sequence the logits it asked for, [n_i, V] fp32.

        A sequence asks for its last token's logits when this step completes its known tokens,
        and for every new token's logits while its prompt log-probabilities are wanted. Drafted
        tokens (`seq.spec_token_ids`) follow its known ones in the same query, each asking for its
        logits: [1 + num_drafts, V] to verify them. `row_settings`: the FFN levels and experts per
        token of each sequence where they differ (zcode.harness.executor.RowSettings); the step
        then runs eagerly.
        """
        self.graph_shape = None
        if row_settings is None and self.runs_compiled(scheduled):
            logits = self._execute_compiled(scheduled)  # [B, S, V]
            return [logits[b, : 1 + len(s.seq.spec_token_ids)] for b, s in enumerate(scheduled)]
        input_ids, query_lens, context_lens, tables, num_logits = [], [], [], [], []
        for s in scheduled:
            start, drafts = s.seq.num_computed_tokens, s.seq.spec_token_ids
            input_ids.extend(s.seq.token_ids[start : start + s.num_new_tokens] + drafts)
            query_lens.append(s.num_new_tokens + len(drafts))
            context_lens.append(start + query_lens[-1])
            tables.append(s.seq.block_table)
            if s.seq.wants_prompt_logprobs:
                num_logits.append(s.num_new_tokens)
            else:
                num_logits.append(1 + len(drafts) if s.completes_prompt else 0)
        batch = ForwardBatch.build(query_lens, context_lens, tables, self.block_size, num_logits)
        if self.pages is not None:
            batch = self._with_paging(batch, [s.seq for s in scheduled], query_lens)
        input_ids = torch.tensor(input_ids, dtype=torch.int64)
        if row_settings is None:
            logits = self._forward(input_ids, batch)  # [N, V]
        else:
            with row_settings.bound(query_lens):
                logits = self._forward(input_ids, batch)
        return list(logits.split(num_logits))

    @torch.inference_mode()
    def decode(
        self,
        model: nn.Module,
        graphs: GraphCache | None,
        seqs: list[Sequence],
        input_ids: list[int],
        context_lens: list[int],
    ) -> torch.Tensor:
        """One token per sequence at position context_lens[i] - 1 of seqs[i]'s block table,
        through `model` (a drafter's cheaper plan over this runner's tensors and KV), compiled
        in `graphs` where given: logits [B, V]."""
        tables = [seq.block_table for seq in seqs]
        if graphs is None or self.pages is not None:
            batch = ForwardBatch.build([1] * len(seqs), context_lens, tables, self.block_size)
            if self.pages is not None:
                batch = self._with_paging(batch, seqs, [1] * len(seqs))
            return model(torch.tensor(input_ids, dtype=torch.int64), batch)
        num_padded = graphs.bucket(len(seqs))
        batch = ForwardBatch.build_decode(
            context_lens, tables, self.block_size, num_padded, self.pad_block
        )
        padded_ids = torch.tensor(input_ids + [0] * (num_padded - len(seqs)), dtype=torch.int64)
        return graphs.run("draft", padded_ids, batch)[: len(seqs)]

    def _forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self.hidden_observer is None:
            return self.model(input_ids, batch)
        observer = self.hidden_observer
        hook = self.model.model.register_forward_hook(
            lambda _backbone, _args, hidden: observer(input_ids, batch, hidden)
        )
        try:
            return self.model(input_ids, batch)
        finally:
            hook.remove()

    def runs_compiled(self, scheduled: list[ScheduledSeq], drafting: bool | None = None) -> bool:
        """Whether this step is one compiled graph: every row computes its last known token
        (and verifies its drafts), all under one plan. `drafting`: whether rows verify drafts
        (default: whether they hold any)."""
        if not self.compiles_plan or not all(s.is_decode for s in scheduled):
            return False
        if len({_skips(s.seq) for s in scheduled}) != 1:  # one graph runs one plan
            return False
        if drafting is None:
            drafting = any(s.seq.spec_token_ids for s in scheduled)
        return not drafting or self.compiles_drafts

    def step_rows(self, scheduled: list[ScheduledSeq], drafts: list[int]) -> int:
        """Rows the step's linears see if row i verifies drafts[i] drafts: a compiled graph's
        padded rows x width, else the packed tokens."""
        if self.runs_compiled(scheduled, drafting=any(drafts)):
            width = graph_width(1 + max(drafts))
            return self.graphs.bucket(len(scheduled)) * width
        return sum(s.num_new_tokens for s in scheduled) + sum(drafts)

    @property
    def compiles_drafts(self) -> bool:
        """Whether verifying steps can be compiled graphs: not with per-request pages (their
        step writes KV per row and head), nor while a drafter reads the final hidden states of
        every forward."""
        return self.compiles_plan and self.pages is None and self.hidden_observer is None

    def _execute_compiled(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Every sequence computes its last known token and its drafts: one compiled step;
        [B, S, V], row b's first 1 + len(drafts) positions its logits."""
        num_seqs = len(scheduled)
        num_padded = self.graphs.bucket(num_seqs)
        drafts = [s.seq.spec_token_ids for s in scheduled]
        query_lens = [1 + len(d) for d in drafts]
        width = graph_width(max(query_lens))
        self.graph_shape = (num_padded, width)
        batch = ForwardBatch.build_decode(
            [s.seq.num_tokens + len(d) for s, d in zip(scheduled, drafts)],
            [s.seq.block_table for s in scheduled],
            self.block_size,
            num_padded,
            self.pad_block,
            query_lens,
            width,
        )
        signature = self.plan_signature
        if self.pages is not None:  # one plan for every row: padding rows follow the first
            seqs = [s.seq for s in scheduled] + [scheduled[0].seq] * (num_padded - num_seqs)
            batch = self._with_paging(batch, seqs, [1] * num_padded)
            layers, heads = _skips(scheduled[0].seq)
            signature += f"|skip {sorted(layers)} {sorted(heads)}"
        rows = [
            [s.seq.token_ids[-1], *d, *[0] * (width - 1 - len(d))]
            for s, d in zip(scheduled, drafts)
        ]
        rows += [[0] * width] * (num_padded - num_seqs)
        input_ids = torch.tensor(rows, dtype=torch.int64).view(-1)  # [B_padded * S]
        logits = self.graphs.run(signature, input_ids, batch)  # [B_padded * S, V]
        return logits.view(num_padded, width, -1)[:num_seqs]

    def _with_paging(
        self, batch: ForwardBatch, seqs: list[Sequence], query_lens: list[int]
    ) -> ForwardBatch:
        """`batch` with its page slots and what each row's sequence skips."""
        paging = LayerPaging.build(
            self.pages,
            self.kv_cache.pages,
            self.block_size,
            batch,
            [seq.skip_layers for seq in seqs],
            [seq.skip_kv_heads for seq in seqs],
            query_lens,
        )
        return dataclasses.replace(batch, paging=paging)


def _skips(seq: Sequence) -> tuple[frozenset, frozenset]:
    return seq.skip_layers, seq.skip_kv_heads
