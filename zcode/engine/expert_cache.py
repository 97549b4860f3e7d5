"""Expert offload: which routed experts of a memory-mapped MoE model stay in RAM, under a budget.

Loaded as stored (dtype auto), a model's expert weights are views of the checkpoint's memory map,
so the OS reads an expert's pages from disk when a step touches them. The cache never copies or
replaces a weight (the fused MoE op and compiled decode graphs keep their tensors); it decides
which pages stay:

- each MoE layer calls `zcode::expert_lookup` with its routed expert ids right after routing (a
  torch op, so compiled graphs call it too): it counts them into the layer's `expert_counts`
  buffer and asks the kernel to read the non-resident ones in ahead of the layer's compute
  (MADV_WILLNEED: large asynchronous reads; one small copy of the ids per layer);
- with `prefetch` on, the same call also routes the layer's input through the NEXT MoE layer's
  router (pre-gating: the residual stream changes little from one layer to the next) and asks
  for that layer's predicted experts too, so their reads overlap this layer's compute and the
  next layer's attention. A wrong guess costs a read the budget does not keep: experts read
  ahead but not routed are dropped after the step. `prefetch_hits` counts the misses that had
  been read ahead (recall = prefetch_hits / misses, precision = prefetch_hits / prefetched);
- after each engine step `after_step` reads every layer's counts as one [L, E] tensor, scores
  the experts (decayed frequency or recency), keeps the best-scored that fit the byte budget and
  drops the pages of the rest: madvise(MADV_DONTNEED) on the mapping, then
  posix_fadvise(POSIX_FADV_DONTNEED) on the file range, so the page cache lets them go too.

The experts the cache keeps are also mlock'ed: page-cache pages are otherwise the kernel's to
reclaim under pressure, or by a proactive reclaimer (DAMON's pageout scheme evicts pages idle for
seconds on some VMs: a 10 GB model without a cache re-read more than its size from disk), so a
budget would be a hope, not a guarantee. Without the privilege to lock that much (RLIMIT_MEMLOCK,
`ulimit -l`), a warning says so once and the cache runs unpinned.

The spans of the file that hold experts are madvise(MADV_RANDOM): the kernel's read-around on a
page fault would otherwise pull neighbouring experts into RAM, unbudgeted and uncounted. Advice
on a part of a mapping splits it, so the experts' ranges are merged first (across gaps of up to
RANDOM_SPAN_GAP_BYTES: routers, norms) to keep the number of mappings small.

Accounting: a lookup is one (step, layer, expert) that ran; a hit, a lookup of an expert resident
when the step began; a miss reads the expert's bytes from disk (`read_bytes`). The process's
measured disk reads (/proc/self/io) stand beside them. Shared experts, attention and embeddings
stay resident outside the budget. A request's figures are its share of each step's, by tokens
(exact at batch 1). The cache starts cold: every expert's pages are dropped when it attaches.

The kernel drops a page-cache folio only whole and unmapped: a large folio that spans an expert's
edge and a weight in use (a file written moments ago, or read with large readahead before the
cache attached) stays in RAM. Pages the cache reads itself (faults under MADV_RANDOM, WILLNEED)
are single pages, so from then on residency follows the cache's choice page for page.
"""

import bisect
import ctypes
import logging
import math
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from zcode.config import EngineConfig
from zcode.errors import ValidationError
from zcode.layers.moe import MoE
from zcode.loader.pages import (
    MADV_DONTNEED,
    MADV_RANDOM,
    MADV_WILLNEED,
    MLOCK_ONFAULT,
    PAGE_BYTES,
    libc,
    madvise,
    whole_pages,
)

POLICIES = ("lfu", "lru")
LFU_DECAY = 0.9  # per step: a routed token's weight in the score halves in ~7 steps
BYTES_PER_GB = 10**9
RANDOM_SPAN_GAP_BYTES = 4 << 20
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileRange:
    """One weight tensor's bytes: where this process maps them and where the file holds them."""

    address: int
    num_bytes: int
    fd: int
    file_offset: int

    def _whole_pages(self) -> tuple[int, int]:
        return whole_pages(self.address, self.num_bytes)

    def advise(self, advice: int) -> None:
        madvise(self.address, self.num_bytes, advice)

    def pin(self) -> bool:
        """Locks the whole pages in RAM as they are mapped; False where the OS refuses.

        MLOCK_ONFAULT: a plain mlock populates the range, and on a copy-on-write mapping (what
        the loaders map) with write faults, so every page was copied into anonymous memory
        (~2.4 ms per 1.8 MB projection: a 10 GB GLM-4.5-Air-shaped model at a 100% budget
        decoded at 5.2 tok/s, 11.6 with this). The experts pinned have just run, so their
        pages are mapped, and now stay the file's pages."""
        start, end = self._whole_pages()
        return end <= start or libc.mlock2(start, end - start, MLOCK_ONFAULT) == 0

    def unpin(self) -> None:
        start, end = self._whole_pages()
        if end > start:
            libc.munlock(start, end - start)

    def drop(self) -> None:
        self.advise(MADV_DONTNEED)
        # The kernel drops only whole pages of the file range too, and only those nobody maps.
        os.posix_fadvise(self.fd, self.file_offset, self.num_bytes, os.POSIX_FADV_DONTNEED)

    def resident_pages(self) -> tuple[int, int]:
        """(pages in RAM, pages) of the whole pages, by mincore: the page cache's residency."""
        start, end = self._whole_pages()
        num_pages = (end - start) // PAGE_BYTES
        if not num_pages:
            return 0, 0
        vec = (ctypes.c_ubyte * num_pages)()
        if libc.mincore(start, end - start, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore on an expert's weights")
        return sum(v & 1 for v in vec), num_pages


@dataclass
class RequestExpertStats:
    """One request's share of the expert lookups, hits and disk bytes of the steps it ran in."""

    num_lookups: float = 0.0
    num_hits: float = 0.0
    read_bytes: float = 0.0
    num_tokens: int = 0

    def report(self) -> dict:
        return {
            "hit_rate": self.num_hits / self.num_lookups if self.num_lookups else None,
            "disk_bytes_per_token": self.read_bytes / self.num_tokens if self.num_tokens else 0.0,
            "num_tokens": self.num_tokens,
        }


class ExpertCache:
    def __init__(
        self,
        model: nn.Module,
        budget_bytes: int | None = None,
        budget_fraction: float | None = None,
        policy: str = "lru",
        prefetch: bool = True,
    ) -> None:
        """budget: bytes, or a fraction of the routed experts' bytes (one of the two);
        prefetch: read the next MoE layer's predicted experts ahead (module docstring)."""
        if (budget_bytes is None) == (budget_fraction is None):
            raise ValueError("give the expert cache budget_bytes or budget_fraction, not both")
        if policy not in POLICIES:
            raise ValueError(f"expert cache policy must be one of {POLICIES}, got {policy!r}")
        self.layers = [m for m in model.modules() if isinstance(m, MoE)]
        if not self.layers:
            raise ValidationError("expert offload needs a mixture-of-experts model: no MoE layers")
        if len({len(layer.experts) for layer in self.layers}) != 1:
            raise NotImplementedError("expert offload for MoE layers of different expert counts")
        self.policy, self.prefetch = policy, prefetch
        self._fds: dict[str, int] = {}
        weakref.finalize(self, _release, self._fds, [layer.layer_key for layer in self.layers])
        maps = _file_maps()
        # ranges[layer][expert]: the file ranges of that expert's weights
        self.ranges = [
            [self._expert_ranges(layer, e, maps) for e in range(len(layer.experts))]
            for layer in self.layers
        ]
        self.expert_bytes = torch.tensor(  # [L, E]
            [[sum(r.num_bytes for r in rs) for rs in layer] for layer in self.ranges]
        )
        self.total_expert_bytes = int(self.expert_bytes.sum())
        if budget_fraction is not None:
            budget_bytes = int(budget_fraction * self.total_expert_bytes)
        self.budget_bytes = budget_bytes
        self.resident = torch.zeros(self.expert_bytes.shape, dtype=torch.bool)  # [L, E]
        self.scores = torch.zeros(self.expert_bytes.shape, dtype=torch.float64)  # [L, E]
        self.read_ahead = torch.zeros(self.expert_bytes.shape, dtype=torch.bool)  # [L, E] this step
        self.pinned = torch.zeros(self.expert_bytes.shape, dtype=torch.bool)  # [L, E] mlock'ed
        self.pinning = True  # until the OS refuses a lock
        self.num_steps = self.num_tokens = self.num_lookups = self.num_hits = self.read_bytes = 0
        self.num_prefetched = self.num_prefetch_hits = 0
        self.requests: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # seq -> stats
        for i, layer in enumerate(self.layers):
            layer.expert_counts = torch.zeros(len(layer.experts), dtype=torch.int64)
            _CACHES[layer.layer_key] = (weakref.ref(self), i)
        spans = _spans(list(self._all_ranges()))
        for span in spans:
            span.advise(MADV_RANDOM)
        self._drop(torch.ones_like(self.resident))
        for span in spans:  # page-cache folios across two experts' edges go too
            os.posix_fadvise(span.fd, span.file_offset, span.num_bytes, os.POSIX_FADV_DONTNEED)
        self._process_read_bytes_at_start = process_read_bytes()

    def _expert_ranges(self, layer: MoE, expert: int, maps: list) -> list[FileRange]:
        module = layer.experts[expert]
        ranges = []
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if not t.numel():
                continue
            where = _locate(maps, t.data_ptr(), t.nbytes) if t.is_contiguous() else None
            if where is None:
                raise ValidationError(
                    f"expert offload keeps experts memory-mapped from the checkpoint, but expert "
                    f"{expert}'s {name} is a copy in memory ({t.dtype}): the weights were "
                    "converted at load (--dtype, --sparsity); load them as stored (dtype auto) "
                    "to offload experts"
                )
            path, file_offset = where
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
            ranges.append(FileRange(t.data_ptr(), t.nbytes, self._fds[path], file_offset))
        return ranges

    def _all_ranges(self):
        return (r for layer in self.ranges for ranges in layer for r in ranges)

    def fetch(self, layer: int, expert_ids: torch.Tensor, x: torch.Tensor) -> None:
        """Starts reading the routed experts of `layer` that are not resident (MADV_WILLNEED),
        and with prefetch on, the next MoE layer's experts as its router scores `x`."""
        # expert_ids: [T * top_k]; x: [T, D], the layer's input
        missing = torch.zeros(self.resident.shape[1], dtype=torch.bool)
        missing[expert_ids] = True
        missing &= ~self.resident[layer]
        self.num_prefetch_hits += int((missing & self.read_ahead[layer]).sum())
        self._read_in(layer, missing & ~self.read_ahead[layer])
        if self.prefetch and layer + 1 < len(self.layers):
            _, predicted = self.layers[layer + 1].route(x, hooks=False)  # [T, top_k]
            ahead = torch.zeros_like(missing)
            ahead[predicted[predicted >= 0]] = True  # -1: dropped by the plan's expert limit
            ahead &= ~self.resident[layer + 1] & ~self.read_ahead[layer + 1]
            self.num_prefetched += int(ahead.sum())
            self.read_ahead[layer + 1] |= ahead
            self._read_in(layer + 1, ahead)

    def _read_in(self, layer: int, experts: torch.Tensor) -> None:
        for e in experts.nonzero().flatten().tolist():
            for r in self.ranges[layer][e]:
                r.advise(MADV_WILLNEED)

    def after_step(self, token_counts: list[tuple[object, int]]) -> None:
        """Accounts the step that just ran ((sequence, tokens it computed) per sequence) and
        brings residency back within the budget."""
        counts = torch.stack([layer.expert_counts for layer in self.layers])  # [L, E] tokens
        torch._foreach_zero_([layer.expert_counts for layer in self.layers])
        used = counts > 0
        num_lookups = int(used.sum())
        num_hits = int((used & self.resident).sum())
        read_bytes = int(self.expert_bytes[used & ~self.resident].sum())
        self.num_steps += 1
        keep = self._choose(counts, used)
        self._drop((self.resident | used | self.read_ahead) & ~keep)
        self._pin(keep & ~self.pinned)
        self.resident = keep
        self.read_ahead.zero_()
        step_tokens = sum(n for _, n in token_counts)
        self.num_tokens += step_tokens
        self.num_lookups += num_lookups
        self.num_hits += num_hits
        self.read_bytes += read_bytes
        for seq, n in token_counts:
            share = n / step_tokens
            stats = self.requests.setdefault(seq, RequestExpertStats())
            stats.num_lookups += num_lookups * share
            stats.num_hits += num_hits * share
            stats.read_bytes += read_bytes * share
            stats.num_tokens += n

    def _choose(self, counts: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
        """[L, E] bool: the experts to keep, best-scored first while the budget holds. Only
        experts in RAM (resident, or just read) are candidates: the cache drops, never reads."""
        if self.policy == "lfu":
            self.scores.mul_(LFU_DECAY).add_(counts)
        else:
            self.scores[used] = float(self.num_steps)
        ids = (self.resident | used).flatten().nonzero().flatten()
        # Stable sorts: by score, ties to the experts already resident (no page churn), then ids.
        ids = ids[torch.sort(self.resident.flatten()[ids].byte(), descending=True, stable=True)[1]]
        ids = ids[torch.sort(self.scores.flatten()[ids], descending=True, stable=True)[1]]
        fits = self.expert_bytes.flatten()[ids].cumsum(0) <= self.budget_bytes  # a prefix
        keep = torch.zeros(self.resident.numel(), dtype=torch.bool)
        keep[ids[fits]] = True
        return keep.view_as(self.resident)

    def _drop(self, experts: torch.Tensor) -> None:
        num_experts = experts.shape[1]
        for flat in experts.flatten().nonzero().flatten().tolist():
            layer, expert = divmod(flat, num_experts)
            for r in self.ranges[layer][expert]:
                if self.pinned[layer, expert]:
                    r.unpin()
                r.drop()
        self.pinned &= ~experts

    def _pin(self, experts: torch.Tensor) -> None:
        """mlocks the experts (resident from now on), until the OS refuses once."""
        num_experts = experts.shape[1]
        for flat in experts.flatten().nonzero().flatten().tolist() if self.pinning else []:
            layer, expert = divmod(flat, num_experts)
            if not all(r.pin() for r in self.ranges[layer][expert]):
                for r in self.ranges[layer][expert]:
                    r.unpin()
                self.pinning = False
                logger.warning(
                    "expert cache: the OS refused to lock resident experts in RAM (%s; raise "
                    "RLIMIT_MEMLOCK, `ulimit -l`, to the budget): they stay in the page cache "
                    "unpinned, where memory pressure may evict them",
                    os.strerror(ctypes.get_errno()),
                )
                return
            self.pinned[layer, expert] = True

    def request_report(self, seq: object) -> dict | None:
        stats = self.requests.get(seq)
        return None if stats is None else stats.report()

    def stats(self) -> dict:
        """Running totals and the residency the cache keeps, for the engine's stats."""
        measured = process_read_bytes()
        return {
            "expert_cache_budget_bytes": self.budget_bytes,
            "expert_cache_expert_bytes": self.total_expert_bytes,
            "expert_cache_resident_bytes": int(self.expert_bytes[self.resident].sum()),
            "expert_cache_resident_experts": int(self.resident.sum()),
            "expert_cache_pinned_bytes": int(self.expert_bytes[self.pinned].sum()),
            "expert_cache_lookups": self.num_lookups,
            "expert_cache_hits": self.num_hits,
            "expert_cache_hit_rate": self.num_hits / self.num_lookups if self.num_lookups else None,
            "expert_cache_read_bytes": self.read_bytes,
            "expert_cache_prefetched": self.num_prefetched,
            "expert_cache_prefetch_hits": self.num_prefetch_hits,
            "expert_cache_tokens": self.num_tokens,
            "expert_cache_disk_bytes_per_token": (
                self.read_bytes / self.num_tokens if self.num_tokens else 0.0
            ),
            # the whole process's reads from storage since the cache attached (None: unreadable)
            "process_disk_read_bytes": (
                None if measured is None else measured - (self._process_read_bytes_at_start or 0)
            ),
        }

    def measured_residency(self) -> torch.Tensor:
        """[L, E] fraction of each expert's whole pages in RAM (mincore), for tests and benches:
        a syscall per weight, so not per step."""
        fractions = torch.zeros(self.expert_bytes.shape, dtype=torch.float64)
        for i, layer in enumerate(self.ranges):
            for e, ranges in enumerate(layer):
                pages = [r.resident_pages() for r in ranges]
                total = sum(n for _, n in pages)
                fractions[i, e] = sum(n for n, _ in pages) / total if total else 0.0
        return fractions


# MoE layer key -> (its cache, the layer's index there), for the op, which takes no objects
_CACHES: dict[int, tuple[weakref.ref, int]] = {}


@torch.library.custom_op("zcode::expert_lookup", mutates_args=("counts",))
def _expert_lookup(
    counts: torch.Tensor, expert_ids: torch.Tensor, x: torch.Tensor, layer_key: int
) -> None:
    """Counts a MoE layer's routed experts (counts: [E] tokens per expert; expert_ids: [T, k])
    and has its cache read in those not resident, and the next layer's as predicted from the
    layer's input x: [T, D]."""
    routed_ids = expert_ids.flatten()
    routed_ids = routed_ids[routed_ids >= 0]  # -1: dropped by the plan's expert limit
    counts.index_add_(0, routed_ids, torch.ones_like(routed_ids))
    cache_ref, layer = _CACHES.get(layer_key, (None, 0))
    if cache_ref is not None and (cache := cache_ref()) is not None:
        cache.fetch(layer, routed_ids, x)


@_expert_lookup.register_fake
def _(counts, expert_ids, x, layer_key):
    return None


def build_expert_cache(model: nn.Module, config: EngineConfig) -> ExpertCache | None:
    """The engine's expert cache, or None where the config sets no budget."""
    if config.expert_cache_gb is None and config.expert_cache_fraction is None:
        return None
    budget_bytes = None
    if config.expert_cache_gb is not None:
        budget_bytes = int(config.expert_cache_gb * BYTES_PER_GB)
    return ExpertCache(
        model,
        budget_bytes,
        config.expert_cache_fraction,
        config.expert_cache_policy,
        config.expert_cache_prefetch,
    )


def process_read_bytes() -> int | None:
    """Bytes this process caused to be read from storage (/proc/self/io), or None."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _file_maps() -> list[tuple[int, int, int, str]]:
    """(start, end, file offset, path) of this process's memory maps of files, by address."""
    maps = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/") and fields[4] != "0":
            start, end = (int(x, 16) for x in fields[0].split("-"))
            maps.append((start, end, int(fields[2], 16), fields[5]))
    return sorted(maps)


def _locate(maps: list, address: int, num_bytes: int) -> tuple[str, int] | None:
    """(path, file offset) of a byte range inside one file map, or None (anonymous memory)."""
    i = bisect.bisect_right(maps, (address, math.inf)) - 1
    if i >= 0:
        start, end, offset, path = maps[i]
        if address + num_bytes <= end:
            return path, offset + address - start
    return None


def _spans(ranges: list[FileRange]) -> list[FileRange]:
    """The ranges merged where one mapping holds them less than RANDOM_SPAN_GAP_BYTES apart."""
    spans: list[FileRange] = []
    for r in sorted(ranges, key=lambda r: r.address):
        last = spans[-1] if spans else None
        if (
            last is not None
            and last.fd == r.fd
            and r.address - last.address == r.file_offset - last.file_offset
            and r.address - (last.address + last.num_bytes) <= RANDOM_SPAN_GAP_BYTES
        ):
            end = max(last.address + last.num_bytes, r.address + r.num_bytes)
            spans[-1] = FileRange(last.address, end - last.address, last.fd, last.file_offset)
        else:
            spans.append(r)
    return spans


def _release(fds: dict[str, int], layer_keys: list[int]) -> None:
    for fd in fds.values():
        os.close(fd)
    for key in layer_keys:  # unless a later cache took the layer over
        if key in _CACHES and _CACHES[key][0]() is None:
            del _CACHES[key]
