"""How busy other processes kept this machine while something was measured: the CPU time all
processes used (Linux /proc/stat) less this process's own, over the wall time, in cores.

Unlike the load average, it leaves out the measurement's own threads (a fit that keeps two
cores busy is not a busy machine) and what ran before the measurement started (the 1-minute
average still counts a test run that ended a minute ago).
"""

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

# A measurement during which other processes kept more than this share of the cores busy is
# reported as taken on a busy machine (bandwidth read ~11 GB/s under load here, ~30 GB/s idle).
BUSY_LOAD_PER_CORE = 0.25


@dataclass(frozen=True)
class _Sample:
    wall_s: float
    busy_s: float  # CPU seconds every process has used since boot
    own_s: float  # CPU seconds this process has used (all its threads, its waited-for children)


def measure_other_load(fn: Callable[[], T]) -> tuple[T, float | None]:
    """fn()'s result, and the cores other processes kept busy on average while it ran (None
    where /proc/stat cannot be read)."""
    before = _sample()
    result = fn()
    after = _sample()
    if before is None or after is None or after.wall_s <= before.wall_s:
        return result, None
    others_s = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
    return result, max(0.0, others_s / (after.wall_s - before.wall_s))


def _sample() -> _Sample | None:
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        ticks_per_s = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is inside user)
    user, nice, system, _, _, irq, softirq, steal = (int(x) for x in fields[1:9])
    own = os.times()
    return _Sample(
        wall_s=time.monotonic(),
        busy_s=(user + nice + system + irq + softirq + steal) / ticks_per_s,
        # A compiled fit's own compilers (inductor runs g++ as child processes) are not other
        # load: a quiet fit was reported as timed beside 0.5 busy cores.
        own_s=own.user + own.system + own.children_user + own.children_system,
    )
