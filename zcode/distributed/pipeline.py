"""Pipeline parallelism: each rank runs a contiguous range of the decoder layers (issue 19).

Rank 0 holds the embedding and the first range, the last rank the last range, the final norm and
the lm_head. Every rank keeps only its layers' weights, and since the engine sizes and allocates
the KV cache from the attention layers the model holds, only their KV cache (layer-wise KV
sharding): the same bytes of cache hold world_size times the tokens. Ranges are as even as
possible, the larger ones first, so rank 0 (whose scheduler hands out the KV blocks) holds the
fewest blocks per byte of cache and every other rank holds the blocks it hands out. No stage
starts at a GLM-5.2 IndexShare layer (it reuses the previous layer's DSA top-k selection): such a
boundary moves to the nearest layer that runs its own indexer.

One forward pass, the same on every rank (rank 0 broadcasts its inputs, zcode.distributed.steps):

    rank 0     embed -> layers [0, a) --hidden [T, D]-->
    rank 1                                layers [a, b) --hidden [T, D]--> ...
    last rank                                              layers [.., L) -> norm -> lm_head
    rank 0     <-- logits [N, vocab] fp32: only the rows the step samples from --

It is done by swapping modules, as tensor parallelism does, so the model files stay as they are:
a later stage's `embed_tokens` receives the hidden states (`ReceiveHidden`); an earlier stage
sends them as they enter its final norm (a forward pre-hook: the norm stays, D values, and the
engine reads the activation dtype from it); the last stage's `lm_head` sends its logits to rank
0 (`SendLogits`) and rank 0's receives them (`ReceiveLogits`). Point-to-point sends run under
the collective timeout: a dead or hung stage fails the step with `RankFailure`.

The stages run one after another, a whole batch at a time, so at N stages each is idle
(N - 1) / N of a step: this buys memory (weights and KV / N per rank), not speed. Overlapping
them needs micro-batches, a step's sequences in groups with stage s running group i while stage
s + 1 runs group i - 1 (GPipe; vLLM runs one scheduler batch in flight per stage). What crosses
a boundary is one [T, D] tensor per step (2 D bytes per token in bf16), against tensor
parallelism's all-reduce in every layer: the scheme for ranks joined by slow links. The logits
coming back (vocab x 4 bytes per sampled row) outweigh it at GLM's vocabulary; sampling on the
last stage and returning the token ids, as vLLM does, would move the sampler off rank 0.
"""

from collections.abc import Callable

import torch
from torch import nn

from zcode.distributed.group import TPGroup, recv, send
from zcode.distributed.shard import own_memory, split_sizes
from zcode.layers.mla import MLAttention


def stage_layers(
    num_layers: int, num_stages: int, can_start: Callable[[int], bool] = lambda layer: True
) -> list[range]:
    """Per stage, the decoder layers it runs: contiguous, as even as possible with the larger
    ranges first. A boundary on a layer that cannot start a stage (`can_start`) moves to the
    nearest one that can, the later one on a tie."""
    if num_layers < num_stages:
        raise NotImplementedError(
            f"pipeline parallelism over {num_stages} ranks of a model with {num_layers} "
            "decoder layers: each rank needs at least one"
        )
    sizes = split_sizes(num_layers, num_stages)
    starts = [sum(sizes[:stage]) for stage in range(num_stages)]
    for stage in range(1, num_stages):
        # after the previous stage's first layer, leaving a layer for each later stage
        allowed = range(starts[stage - 1] + 1, num_layers - (num_stages - 1 - stage))
        candidates = [layer for layer in allowed if can_start(layer)]
        if not candidates:
            raise NotImplementedError(
                f"pipeline parallelism over {num_stages} ranks: no layer in "
                f"[{allowed.start}, {allowed.stop}) can start stage {stage}"
            )
        even = starts[stage]
        starts[stage] = min(candidates, key=lambda layer: (abs(layer - even), -layer))
    return [range(a, b) for a, b in zip(starts, starts[1:] + [num_layers])]


def split_pipeline(model: nn.Module, group: TPGroup) -> None:
    """Keeps this rank's stage of `model`, in place: its layers, plus the embedding on the first
    rank and the lm_head on the last; the rest is dropped."""
    backbone, rank, last_rank = model.model, group.rank, group.world_size - 1
    stage = model_stages(model, group.world_size)[rank]
    backbone.layers = nn.ModuleList(backbone.layers[stage.start : stage.stop])
    hidden_dtype = backbone.norm.weight.dtype  # the engine's activation dtype
    if rank > 0:
        backbone.embed_tokens = ReceiveHidden(
            model.config.hidden_size, hidden_dtype, rank - 1, group
        )
        backbone.embed_scale = None  # the first stage scaled the embeddings
    if rank < last_rank:
        backbone.norm.register_forward_pre_hook(HiddenSender(hidden_dtype, rank + 1, group))
        model.mtp_weights = {}  # the MTP layers follow the last decoder layer
    if rank == 0:
        model.lm_head = ReceiveLogits(model.config.vocab_size, last_rank, group)
    elif rank == last_rank:
        model.lm_head = SendLogits(model.lm_head, group)
    else:
        model.lm_head = nn.Identity()  # a middle stage's output is discarded
    own_memory(model)


def model_stages(model: nn.Module, num_stages: int) -> list[range]:
    """`stage_layers` for `model`: no stage starts at a DSA layer that reuses an earlier layer's
    top-k selection (IndexShare), which would have to cross ranks."""
    layers = model.model.layers

    def can_start(index: int) -> bool:
        attn = layers[index].self_attn
        return not (type(attn) is MLAttention and attn.indexer is None)

    return stage_layers(len(layers), num_stages, can_start)


class ReceiveHidden(nn.Module):
    """Stands in for the embedding on a later stage: the previous stage's hidden states."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, src: int, group: TPGroup) -> None:
        super().__init__()
        self.hidden_size, self.dtype, self.src, self.group = hidden_size, dtype, src, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> hidden [T, D] after the previous stages' layers
        hidden = torch.empty(input_ids.shape[0], self.hidden_size, dtype=self.dtype)
        return recv(hidden, self.src, self.group)


class HiddenSender:
    """Forward pre-hook of an earlier stage's final norm: sends the hidden states entering it to
    the next stage."""

    def __init__(self, dtype: torch.dtype, dst: int, group: TPGroup) -> None:
        self.dtype, self.dst, self.group = dtype, dst, group

    def __call__(self, norm: nn.Module, args: tuple) -> None:
        hidden = args[0]  # [T, D]
        if hidden.dtype != self.dtype:
            raise NotImplementedError(
                f"pipeline parallelism of a model whose hidden states ({hidden.dtype}) are not "
                f"in its norms' dtype ({self.dtype}), which the next stage receives them in"
            )
        send(hidden, self.dst, self.group)


class SendLogits(nn.Module):
    """The last stage's lm_head: its logits also go to rank 0, which samples from them."""

    def __init__(self, lm_head: nn.Module, group: TPGroup) -> None:
        super().__init__()
        self.lm_head, self.group = lm_head, group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, D] -> logits [N, vocab] fp32, as CausalLM.forward returns them
        logits = self.lm_head(hidden).float()
        send(logits, 0, self.group)
        return logits


class ReceiveLogits(nn.Module):
    """Stands in for rank 0's lm_head: the last stage's logits of the same rows."""

    def __init__(self, vocab_size: int, src: int, group: TPGroup) -> None:
        super().__init__()
        self.vocab_size, self.src, self.group = vocab_size, src, group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, D], only its row count read -> logits [N, vocab] fp32
        logits = torch.empty(hidden.shape[0], self.vocab_size, dtype=torch.float32)
        return recv(logits, self.src, self.group)
