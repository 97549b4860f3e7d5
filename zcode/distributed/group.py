"""The process group of a torchrun launch, and the collectives the sharded layers run on it.

torchrun starts one process per rank and sets RANK, WORLD_SIZE and the rendezvous (MASTER_ADDR,
MASTER_PORT); this module is the one place that reads them. Collectives on CPU tensors go over
gloo, on CUDA tensors over NCCL. Two groups:

- `compute`: the all-reduces and all-gathers of a forward pass (and the point-to-point sends of
  pipeline stages), with the config's timeout, so a rank that died or hangs fails the step
  within it instead of hanging the others;
- `control`: rank 0's per-step broadcast of what to run. Followers wait on it between steps
  (an idle server may wait for days), so their timeout is long; rank 0's is the config's, as
  gloo's send waits for the receiver to take it: a follower that hangs (stopped, swapped out)
  fails rank 0's next step within the timeout instead of hanging it. A rank that dies closes
  its sockets, which gloo reports at once, timeout or not.

And `join`: the join-time handshake (`all_gather_object`), over gloo with the join's timeout (a
rank may still be building its kernels).

A failed collective raises `RankFailure`, which the engine does not isolate to one request:
the ranks no longer agree on what they computed, so every rank must stop and be restarted.
"""

import ctypes
import os
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from zcode.distributed.config import ParallelConfig
from zcode.errors import RankFailure, ValidationError

# Ranks reach the join at different times (a first kernel build on one of them, imports on a
# busy machine): torch's own default, not the collective timeout, bounds the wait.
JOIN_TIMEOUT = timedelta(minutes=30)
CONTROL_TIMEOUT = timedelta(days=7)


@dataclass(frozen=True)
class TPGroup:
    rank: int
    world_size: int
    compute: dist.ProcessGroup
    control: dist.ProcessGroup
    join: dist.ProcessGroup

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


def launch_rank() -> int:
    """This process's rank in the torchrun launch (0 outside one), before joining it."""
    return int(os.environ.get("RANK", "0"))


def launch_world_size() -> int:
    """The processes of the torchrun launch (1 outside one)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(config: ParallelConfig) -> TPGroup:
    """Joins the torchrun launch (once per process); checks it has the processes `config` asks
    for."""
    world_size = launch_world_size()
    if world_size != config.world_size:
        launch = f"torchrun --nproc-per-node {config.world_size} -m zcode ..."
        raise ValidationError(
            f"tensor_parallel_size {config.tensor_parallel_size} x pipeline_parallel_size "
            f"{config.pipeline_parallel_size} needs {config.world_size} processes, this launch "
            f"has {world_size}: start it with `{launch}`"
        )
    if dist.is_initialized():
        raise RuntimeError("this process already joined a process group: one model per process")
    _end_with_the_launcher()
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=JOIN_TIMEOUT)
    timeout = timedelta(seconds=config.collective_timeout_s)
    compute = dist.new_group(timeout=timeout)  # the launch's backend(s)
    # Each rank's gloo context keeps its own timeout: the groups need not agree on it.
    control_timeout = timeout if dist.get_rank() == 0 else CONTROL_TIMEOUT
    control = dist.new_group(backend="gloo", timeout=control_timeout)
    join = dist.new_group(backend="gloo", timeout=JOIN_TIMEOUT)
    return TPGroup(dist.get_rank(), world_size, compute, control, join)


def _end_with_the_launcher() -> None:
    """Asks Linux to SIGTERM this rank when the process that started it (torchrun's agent) dies.
    A launcher killed with SIGKILL forwards no signal, and its ranks would serve on with no one
    to stop them; now rank 0 drains and exits as on any SIGTERM, and the followers (which ignore
    SIGTERM) end when rank 0 does."""
    if sys.platform != "linux":
        return
    pr_set_pdeathsig = 1  # <linux/prctl.h>
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() == 1:  # the launcher died before the request: no one would send the signal
        os.kill(os.getpid(), signal.SIGTERM)


def all_reduce(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Sums x over the ranks, in place; returns x."""
    _checked(group, dist.all_reduce, x, group=group.compute)
    return x


def all_gather(x: torch.Tensor, group: TPGroup) -> list[torch.Tensor]:
    """Every rank's x (same shape on all), in rank order."""
    parts = [torch.empty_like(x) for _ in range(group.world_size)]
    _checked(group, dist.all_gather, parts, x.contiguous(), group=group.compute)
    return parts


def send(x: torch.Tensor, dst: int, group: TPGroup) -> None:
    """Sends x to rank `dst`, which receives it with `recv` into a tensor of x's shape and dtype."""
    _checked(group, dist.send, x.contiguous(), dst, group=group.compute)


def recv(x: torch.Tensor, src: int, group: TPGroup) -> torch.Tensor:
    """Fills x with what rank `src` sends; returns x."""
    _checked(group, dist.recv, x, src, group=group.compute)
    return x


def broadcast_object(obj: object, group: TPGroup) -> object:
    """Rank 0's `obj` on every rank (pickled; other ranks pass None)."""
    box = [obj]
    _checked(group, dist.broadcast_object_list, box, src=0, group=group.control)
    return box[0]


def all_gather_object(obj: object, group: TPGroup) -> list:
    """Every rank's `obj` (pickled), in rank order, on every rank; waits as long as the join."""
    out = [None] * group.world_size
    _checked(group, dist.all_gather_object, out, obj, group=group.join)
    return out


def joined() -> bool:
    """Whether this process is (still) in the launch's process group."""
    return dist.is_initialized()


def leave() -> None:
    """Leaves the process group (at exit, or after a failure made it useless)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _checked(tp: TPGroup, collective, *args, **kwargs) -> None:
    try:
        collective(*args, **kwargs)
    except (RuntimeError, ValueError) as e:  # gloo errors, c10d's DistError, a left group
        # The ranks no longer agree on what ran: leave, so no later collective waits on them.
        leave()
        raise RankFailure(
            f"rank {tp.rank} of {tp.world_size}: a collective failed: another rank died, "
            f"hung past the timeout or lost its link ({e}); stop every rank and relaunch torchrun"
        ) from e
