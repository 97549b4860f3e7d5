"""What runs of drafts yield, measured: verifying steps counted by how many drafts of a request
they checked, and the drafts kept, so the draft policy expects of a run of k drafts what runs of
k drafts kept.

One acceptance rate a per request, with draft j kept with probability a^j, overstated n-gram
drafts: a lookup near the end of its match drafts 1-2 tokens, kept more often than a full run's
later positions, so they raise a without raising what a run of 3 keeps (SmolLM2 continuation at
batch 4: a = 0.68 expected 1.46 kept of 3 drafts, where runs kept 1.17 of 2.4 on average, and
the policy drafted where a plain step was faster).
"""

PRIOR_RUNS = 4  # pseudo-runs a measured mean is shrunk toward its prior by


class RunYields:
    """runs[k]: steps that verified k drafts; accepted[k]: the drafts those steps kept."""

    def __init__(self) -> None:
        self.runs: list[int] = [0]
        self.accepted: list[int] = [0]

    def record(self, num_drafts: int, num_accepted: int) -> None:
        grow = num_drafts + 1 - len(self.runs)
        if grow > 0:
            self.runs += [0] * grow
            self.accepted += [0] * grow
        self.runs[num_drafts] += 1
        self.accepted[num_drafts] += num_accepted

    def expected(self, prior: list[float]) -> list[float]:
        """Expected kept drafts of a run of k drafts, k = 0 .. len(prior) - 1: the measured mean
        of runs of k, shrunk toward prior[k] by PRIOR_RUNS pseudo-runs, then made
        non-decreasing in k (a longer run keeps at least what its first drafts do)."""
        curve, best = [], 0.0
        for k, expect in enumerate(prior):
            runs, kept = (self.runs[k], self.accepted[k]) if k < len(self.runs) else (0, 0)
            best = max(best, (kept + PRIOR_RUNS * expect) / (runs + PRIOR_RUNS))
            curve.append(best)
        return curve


def geometric(acceptance: float, max_drafts: int) -> list[float]:
    """E(a, k) = a + a^2 + ... + a^k for k = 0 .. max_drafts: draft j kept with probability a^j
    (each accepted with probability a once those before it were)."""
    curve = [0.0]
    for j in range(1, max_drafts + 1):
        curve.append(curve[-1] + acceptance**j)
    return curve
