"""Drafting with the checkpoint's MTP layer (zcode/models/mtp.py).

The MTP layer attends over its own KV of every earlier position, as vLLM and llama.cpp run it.
Its input at position j pairs token j with the target's hidden state at j - 1, so the MTP KV at
j, like the target's, depends on tokens 0..j only: it lives in its own paged tensors under the
same block tables and slots, and prefix-cache hits, preemption and rejected drafts need nothing
of their own. The runner's hidden-state observer keeps both up to date in every forward of the
engine (all sequences, speculating or not): it writes each token's final hidden state to a
paged hidden-state cache and runs the MTP layer over the forward's tokens (its KV write). Slot 0
holds no pair (no hidden state precedes position 0): a query sees it only when it sees nothing
else.

A step's drafts: the MTP layer at the last known token (position n - 1, with the hidden state
of n - 2 from the cache) gives draft 1; draft i + 1 comes from draft i at the next position with
the MTP output as its hidden state. Their MTP KV goes into the slots the scheduler reserved for
the drafts, which the verifying forward rewrites.
"""

import dataclasses

import torch
from torch import nn

from zcode.engine.kv_cache import KVCache
from zcode.engine.sequence import Sequence
from zcode.forward_batch import ForwardBatch
from zcode.harness.plan import ExecutionPlan
from zcode.layers.attention import gather_cache, write_cache
from zcode.models.mtp import MtpLayer, build_mtp_layer
from zcode.spec.drafter import Drafter


def mtp_cost_plan(num_layers: int) -> ExecutionPlan:
    """What an MTP draft step costs: one decoder layer with the embedding and the head, the
    model's step with all its layers but one skipped."""
    return ExecutionPlan(name="mtp draft", skip_layers=tuple(range(1, num_layers)))


class HiddenStates(nn.Module):
    """The target's final-normed hidden state of every cached position: the MTP layer's input
    at the next position (a cache owner like an attention module)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.cache: dict[str, torch.Tensor] = {}

    def cache_spec(self) -> dict[str, tuple[int, ...]]:
        return {"hidden": (self.hidden_size,)}

    def write(self, hidden: torch.Tensor, batch: ForwardBatch) -> None:
        write_cache(self.cache["hidden"], hidden, batch.slot_mapping)

    def before(self, batch: ForwardBatch) -> torch.Tensor:
        """[T, D]: the hidden state at the position before each of the batch's tokens (at
        position 0 its own slot's, which the MTP mask hides)."""
        seq_of_token = batch.token_index // batch.query_index.shape[1]  # [T]
        previous = (batch.positions - 1).clamp(min=0)
        slots = batch.context_slots[seq_of_token, previous]
        return gather_cache(self.cache["hidden"], slots)


class MtpDrafter(Drafter):
    def __init__(self, model: nn.Module) -> None:
        """Builds the checkpoint's MTP layer; its caches are made by `attach`, once the engine
        has sized the KV cache with them (`cache_owners`) inside kv_cache_bytes."""
        self.mtp: MtpLayer = build_mtp_layer(model)
        self.hidden = HiddenStates(model.config.hidden_size)
        self.rotary = model.model.rotary_emb

    def attach(self, runner) -> None:
        """runner: the engine's ModelRunner, whose block tables and slots the MTP caches share
        (as many blocks as the target's KV, its padding block too)."""
        if runner.pages is not None:
            raise NotImplementedError(
                "speculative='mtp' with per_request_depth: the MTP caches are not paged per head"
            )
        if runner.graphs is not None:
            raise NotImplementedError(
                "speculative='mtp' with compile: compiled decode graphs do not run the MTP "
                "layer's KV update yet"
            )
        self.block_size = runner.block_size
        dtype = runner.model.model.norm.weight.dtype
        KVCache(self.cache_owners(), runner.kv_cache.num_blocks, runner.block_size, dtype)
        runner.hidden_observer = self.observe

    def cost_plan(self, num_layers: int) -> ExecutionPlan:
        return mtp_cost_plan(num_layers)

    def cache_owners(self) -> list[nn.Module]:
        return [self.mtp.mtp_block.self_attn, self.hidden]

    @torch.inference_mode()
    def observe(self, input_ids: torch.Tensor, batch: ForwardBatch, hidden: torch.Tensor) -> None:
        """After a target forward: input_ids [T], its final-normed hidden states [T, D]."""
        self.hidden.write(hidden, batch)
        batch = without_position_zero(batch)
        self.mtp(input_ids, self.hidden.before(batch), batch, self.rotary(batch.positions))

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], max_num_tokens: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        rows = [i for i, n in enumerate(max_num_tokens) if n > 0]
        input_ids = torch.tensor([seqs[i].token_ids[-1] for i in rows], dtype=torch.int64)
        prev_hidden = None  # first step: the target's, from the cache
        for step in range(max(max_num_tokens, default=0)):
            context_lens = [seqs[i].num_tokens + step for i in rows]
            tables = [seqs[i].block_table for i in rows]
            batch = ForwardBatch.build([1] * len(rows), context_lens, tables, self.block_size)
            batch = without_position_zero(batch)
            if prev_hidden is None:
                prev_hidden = self.hidden.before(batch)
            hidden = self.mtp(input_ids, prev_hidden, batch, self.rotary(batch.positions))
            tokens = self.mtp.logits(hidden).argmax(-1)  # [R]
            for i, token in zip(rows, tokens.tolist()):
                drafts[i].append(token)
            going = [r for r, i in enumerate(rows) if max_num_tokens[i] > step + 1]
            rows = [rows[r] for r in going]
            input_ids, prev_hidden = tokens[going], hidden[going]
        return drafts


def without_position_zero(batch: ForwardBatch) -> ForwardBatch:
    """`batch` with slot 0 masked from every query that sees another slot: the MTP layer has no
    pair at position 0."""
    num_seqs, context_len = batch.context_slots.shape
    mask = batch.attn_mask
    if mask is None:  # uniform decode: every query sees the whole context
        mask = torch.ones(num_seqs, 1, 1, context_len, dtype=torch.bool)
    else:
        mask = mask.clone()
    mask[..., 0] = ~mask[..., 1:].any(-1)
    return dataclasses.replace(batch, attn_mask=mask)
