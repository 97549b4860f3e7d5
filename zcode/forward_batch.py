"""What one forward pass needs to know about its batch, built once per step and read by every layer.

Tokens of all sequences are packed along one axis (T = sum of query lengths). Attention gathers
each sequence's queries and cached context into padded [B, S_max] and [B, L_max] views:

    packed tokens   t = 0 .. T-1          (query_index maps [B, S_max] -> t)
    padded queries  b * S_max + s         (token_index maps t -> b * S_max + s)
    context slots   context_slots[b, j]   (cache slot of position j of sequence b)

`build_decode` makes the fixed-shape batch of a compiled step: one token per sequence (or a
fixed width of verified drafts), padded to a batch-size bucket, context rounded up to whole
blocks, and always an explicit mask, so a compiled graph sees the same shapes (up to the context
length) and structure every step.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from zcode.engine.page_pool import LayerPaging


@dataclass(frozen=True)
class ForwardBatch:
    positions: torch.Tensor  # [T] int64, position of each new token in its sequence
    slot_mapping: torch.Tensor  # [T] int64, cache slot each new token's KV is written to
    query_index: torch.Tensor  # [B, S_max] int64 into the packed tokens (padding -> 0)
    token_index: torch.Tensor  # [T] int64 into the flattened [B * S_max] padded queries
    context_slots: torch.Tensor  # [B, L_max] int64 cache slots of each sequence's context
    attn_mask: torch.Tensor | None  # [B, 1, S_max, L_max] bool, True = may attend; None = all
    logits_index: torch.Tensor  # [N] int64, packed tokens whose logits are wanted
    # KV pages per layer and KV head, and per-request skipped layers and heads (engine with
    # per_request_depth); None: every layer runs every row and all layers share the slots above.
    paging: "LayerPaging | None" = None
    # [T, KVH] bool, False where a row's request skips that KV head of the layer (set by
    # LayerPaging for the layer it runs); None: every row reads every head.
    kv_head_keep: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.query_index.shape[0]

    def window_mask(self, window: int) -> torch.Tensor:
        """attn_mask narrowed to a sliding window: a query at position p sees (p - window, p],
        itself and the window - 1 positions before it (HF's sliding_window_overlay:
        kv_idx > q_idx - window). [B or 1, 1, S_max, L_max] bool.

        Each row of attn_mask allows a prefix 0..p of the context, p the position of the row's
        query (a padding row: 0 only), so p is the row's count less one and a padding row keeps
        its position 0. Built per call: layers without a window never pay for it.
        """
        context_len = self.context_slots.shape[1]
        j = torch.arange(context_len, device=self.context_slots.device)
        if self.attn_mask is None:  # uniform decode: every query sits at the last position
            return (j > context_len - 1 - window)[None, None, None, :]
        query_pos = self.attn_mask.sum(-1, keepdim=True) - 1  # [B, 1, S, 1]
        return self.attn_mask & (j > query_pos - window)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        num_logits: list[int] | None = None,
    ) -> "ForwardBatch":
        """Sequence b contributes its tokens [context_lens[b] - query_lens[b], context_lens[b]);
        logits are computed for its last num_logits[b] tokens (default: the last one)."""
        num_seqs = len(query_lens)
        max_query, max_context = max(query_lens), max(context_lens)
        positions, slots, query_index, token_index = [], [], [], []
        context_slots = torch.zeros(num_seqs, max_context, dtype=torch.int64)
        t = 0
        for b, (q_len, ctx_len, table) in enumerate(zip(query_lens, context_lens, block_tables)):
            ctx_positions = torch.arange(ctx_len)
            seq_slots = torch.tensor(table, dtype=torch.int64)[ctx_positions // block_size]
            seq_slots = seq_slots * block_size + ctx_positions % block_size
            context_slots[b, :ctx_len] = seq_slots
            positions.append(ctx_positions[ctx_len - q_len :])
            slots.append(seq_slots[ctx_len - q_len :])
            query_index.append(torch.arange(t, t + q_len).tolist() + [0] * (max_query - q_len))
            token_index.extend(range(b * max_query, b * max_query + q_len))
            t += q_len
        uniform = all(q == 1 for q in query_lens) and len(set(context_lens)) == 1
        mask = None if uniform else _causal_mask(query_lens, context_lens, max_query, max_context)
        if num_logits is None:
            num_logits = [1] * num_seqs
        ends = torch.cumsum(torch.tensor(query_lens), 0).tolist()
        logits_index = [i for end, n in zip(ends, num_logits) for i in range(end - n, end)]
        return cls(
            positions=torch.cat(positions),
            slot_mapping=torch.cat(slots),
            query_index=torch.tensor(query_index, dtype=torch.int64),
            token_index=torch.tensor(token_index, dtype=torch.int64),
            context_slots=context_slots,
            attn_mask=mask,
            logits_index=torch.tensor(logits_index, dtype=torch.int64),
        )

    @classmethod
    def build_decode(
        cls,
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        num_padded: int,
        pad_block: int,
        query_lens: list[int] | None = None,
        query_width: int = 1,
    ) -> "ForwardBatch":
        """The last query_lens[b] tokens of each sequence's context (default: its last one, a
        decode step; more: its last token and the drafts that follow it, a verifying step), each
        row padded to `query_width` tokens and the rows to `num_padded`.

        Padding tokens and rows sit at position 0 and write their KV to block `pad_block`,
        which no sequence owns; their outputs are dropped. The context axis is rounded up to
        whole blocks. Every padded token has logits: [num_padded * query_width] rows, row b's
        token s at b * query_width + s.
        """
        # Built with numpy and handed to torch without copies: a dozen torch ops on these
        # few-element tensors cost ~45 us a step on the CPU, numpy ~18.
        num_seqs = len(context_lens)
        tables = np.full((num_padded, max(map(len, block_tables))), pad_block, dtype=np.int64)
        for b, table in enumerate(block_tables):
            tables[b, : len(table)] = table
        offsets = np.arange(block_size, dtype=np.int64)
        # tables: [B, blocks] -> context_slots: [B, blocks * block_size]
        context_slots = (tables[:, :, None] * block_size + offsets).reshape(num_padded, -1)
        lens = np.ones(num_padded, dtype=np.int64)
        lens[:num_seqs] = context_lens
        q_lens = np.zeros(num_padded, dtype=np.int64)
        q_lens[:num_seqs] = 1 if query_lens is None else query_lens
        s = np.arange(query_width, dtype=np.int64)
        real = s[None, :] < q_lens[:, None]  # [B, S]
        positions = np.where(real, lens[:, None] - q_lens[:, None] + s[None, :], 0)  # [B, S]
        rows = np.arange(num_padded, dtype=np.int64)[:, None]
        slot_mapping = np.where(real, context_slots[rows, positions], pad_block * block_size)
        # A token at position p sees positions 0..p (a padding token: 0 only).
        mask = np.arange(context_slots.shape[1])[None, None, :] <= positions[:, :, None]
        tokens = np.arange(num_padded * query_width, dtype=np.int64)
        return cls(
            positions=torch.from_numpy(positions.reshape(-1)),
            slot_mapping=torch.from_numpy(slot_mapping.reshape(-1)),
            query_index=torch.from_numpy(tokens.reshape(num_padded, query_width)),
            token_index=torch.from_numpy(tokens),
            context_slots=torch.from_numpy(context_slots),
            attn_mask=torch.from_numpy(mask)[:, None],  # [B, 1, S, L]
            logits_index=torch.from_numpy(tokens.copy()),
        )


def _causal_mask(
    query_lens: list[int], context_lens: list[int], max_query: int, max_context: int
) -> torch.Tensor:
    q_len = torch.tensor(query_lens)[:, None, None]
    ctx_len = torch.tensor(context_lens)[:, None, None]
    s = torch.arange(max_query)[None, :, None]
    j = torch.arange(max_context)[None, None, :]
    query_pos = ctx_len - q_len + s  # [B, S, 1]
    mask = (j <= query_pos) & (s < q_len)
    # Padding queries attend to position 0 so softmax never sees an empty row; they are dropped.
    mask[:, :, 0] = True
    return mask[:, None]  # [B, 1, S, L]
