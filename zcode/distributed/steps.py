"""Rank 0 leads, the other ranks follow: one scheduler, the same forward pass on every rank.

Rank 0 runs the engine (scheduler, block manager, sampler, API or server) as in one process.
Before each forward pass of its model it broadcasts the pass's inputs (the token ids and the
`ForwardBatch`: positions, slot mapping, context slots, masks; a few KB pickled), and every
follower runs the same pass on its shard, taking part in the same collectives. A follower keeps
a KV cache laid out as rank 0's (same blocks, its own heads), so rank 0's block tables index it.
At exit rank 0 broadcasts None and the followers return.
"""

import atexit
import logging

import torch
from torch import nn

from zcode.config import EngineConfig
from zcode.distributed.group import (
    RankFailure,
    TPGroup,
    all_gather_object,
    broadcast_object,
    init_distributed,
    joined,
    leave,
)

logger = logging.getLogger(__name__)


def join(config: EngineConfig, sparsity: object = None) -> TPGroup | None:
    """This process's place in the launch, or None when the config runs in one process."""
    if not config.parallel.is_distributed:
        return None
    unsupported = [
        name
        for name, used in (
            ("compile", config.compile),
            ("per_request_depth", config.per_request_depth),
            (
                "expert offload",
                (config.expert_cache_gb, config.expert_cache_fraction) != (None, None),
            ),
            ("a sparsity artifact", sparsity is not None),
            # the drafts run fewer layers on rank 0 than its broadcast makes the others run
            ("speculative skip_layers", config.speculative == "skip_layers"),
            # the MTP layer and its caches are whole on rank 0, unsharded
            ("speculative mtp", config.speculative == "mtp"),
        )
        if used
    ]
    if unsupported:
        raise NotImplementedError(
            f"tensor / pipeline parallelism with {', '.join(unsupported)}: not built yet (issue 19)"
        )
    return init_distributed(config.parallel)


def start_rank(engine, group: TPGroup) -> None:
    """Rank 0 returns, leading; the other ranks follow its steps and exit when it stops (so
    the rest of a script runs on rank 0 only)."""
    if group.is_leader:
        lead(engine.model, engine.runner.num_blocks, group)
        return
    follow(engine.model, engine.runner.num_blocks, group)
    raise SystemExit(0)


def lead(model: nn.Module, num_blocks: int, group: TPGroup) -> None:
    """Rank 0: from now on each forward pass of `model` runs on every rank. Returns once every
    rank has built its engine (a server reports ready only then)."""
    _check_blocks(num_blocks, group)

    def broadcast_inputs(module: nn.Module, args: tuple) -> None:
        broadcast_object(args, group)  # (input_ids [T], ForwardBatch)

    model.register_forward_pre_hook(broadcast_inputs)
    atexit.register(_stop, group)


def follow(model: nn.Module, num_blocks: int, group: TPGroup) -> None:
    """Other ranks: run rank 0's forward passes until it stops. `num_blocks`: this rank's KV
    blocks, which must hold every block rank 0 hands out."""
    _check_blocks(num_blocks, group)
    with torch.inference_mode():
        while (inputs := broadcast_object(None, group)) is not None:
            model(*inputs)
    leave()
    logger.info("rank %d: rank 0 finished", group.rank)


def _check_blocks(num_blocks: int, group: TPGroup) -> None:
    """Every rank's KV block count, gathered on every rank: the handshake that says all ranks are
    ready. Each rank must hold every block rank 0's scheduler hands out."""
    counts = all_gather_object(num_blocks, group)
    short = {rank: n for rank, n in enumerate(counts) if n < counts[0]}
    if short:
        leave()
        raise RuntimeError(
            f"ranks {sorted(short)} hold {sorted(short.values())} KV blocks, fewer than rank 0's "
            f"{counts[0]}: ranks must hold as many KV heads as rank 0 or fewer"
        )


def _stop(group: TPGroup) -> None:
    """At rank 0's exit: tells the followers to return (unless a failure already left)."""
    if not joined():
        return
    try:
        broadcast_object(None, group)
    except RankFailure:  # the followers are gone already
        return
    leave()
