"""Measured wall times by shape: what the draft policy prices a step it has seen run by.

A compiled engine runs few shapes (batch bucket x query width), each often; the median of a
shape's latest MEASURED_RUNS runs follows the machine as it is now (its load, the context
grown since), where the cost model's fit was made on a few layers, at other shapes, another
time.
"""

import statistics
from collections import deque
from collections.abc import Hashable

MEASURED_RUNS = 8  # a shape's time: the median of its latest runs, this many at most
MIN_MEASURED_RUNS = 3  # fewer runs measure nothing yet


class StepTimes:
    def __init__(self) -> None:
        self.runs_ms: dict[Hashable, deque[float]] = {}

    def record(self, shape: Hashable, ms: float) -> None:
        self.runs_ms.setdefault(shape, deque(maxlen=MEASURED_RUNS)).append(ms)

    def median_ms(self, shape: Hashable) -> float | None:
        """The median of the shape's latest runs; None before MIN_MEASURED_RUNS of them."""
        runs = self.runs_ms.get(shape, ())
        return statistics.median(runs) if len(runs) >= MIN_MEASURED_RUNS else None
