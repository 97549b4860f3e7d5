"""The precision planner against brute force over every plan of small random profiles."""

import itertools
import random

import pytest

from zcode.errors import ValidationError
from zcode.quant.planner import (
    DENSE,
    PlanError,
    budget_bytes,
    module_formats,
    plan,
    plan_for_budget,
    solve_knapsack,
)


def random_profile(rng: random.Random, num_units: int, num_formats: int) -> dict:
    """A profile whose units have random sizes and random (loss, bytes) per format."""
    modules = {}
    for u in range(num_units):
        num_weights = rng.randint(10, 200)
        formats = {
            f"f{i}": {
                "kl": rng.random(),
                "ppl_delta": 0.0,
                "bytes": rng.randint(num_weights // 4, 3 * num_weights),
            }
            for i in range(num_formats)
        }
        modules[f"unit{u}"] = {
            "members": [f"unit{u}.a", f"unit{u}.b"],
            "num_weights": num_weights,
            "formats": formats,
        }
    return {"modules": modules}


def brute_force(profile: dict, capacity: float) -> float | None:
    """Least total KL over every plan within capacity (None if none fits)."""
    units = profile["modules"].values()
    per_unit = [
        [(m["kl"], m["bytes"]) for m in u["formats"].values()] + [(0.0, 4 * u["num_weights"])]
        for u in units
    ]
    best = None
    for combo in itertools.product(*per_unit):
        if sum(cost for _, cost in combo) <= capacity:
            loss = sum(kl for kl, _ in combo)
            best = loss if best is None else min(best, loss)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_planner_equals_brute_force(seed):
    rng = random.Random(seed)
    profile = random_profile(rng, num_units=rng.randint(1, 5), num_formats=rng.randint(1, 3))
    opts = [
        [(m["kl"], m["bytes"]) for m in u["formats"].values()] + [(0.0, 4 * u["num_weights"])]
        for u in profile["modules"].values()
    ]
    lo = sum(min(c for _, c in g) for g in opts)
    hi = sum(max(c for _, c in g) for g in opts)
    capacity = rng.randint(lo, hi)
    result = plan(profile, f"{capacity}B")
    assert result.weight_bytes <= capacity
    assert result.predicted_kl == pytest.approx(brute_force(profile, capacity), abs=1e-12)


@pytest.mark.parametrize("seed", range(10))
def test_coarse_grid_respects_budget_and_stays_near_optimal(seed):
    """With fewer cells than bytes costs round up: never over budget, close to the optimum."""
    rng = random.Random(100 + seed)
    profile = random_profile(rng, num_units=5, num_formats=3)
    opts = [
        [(m["kl"], m["bytes"]) for m in u["formats"].values()] + [(0.0, 4 * u["num_weights"])]
        for u in profile["modules"].values()
    ]
    lo = sum(min(c for _, c in g) for g in opts)
    capacity = lo + rng.randint(50, 400)
    chosen = solve_knapsack(opts, capacity, max_cells=37)  # slack >= 50: no exact grid fits
    cost = sum(opts[g][i][1] for g, i in enumerate(chosen))
    assert cost <= capacity
    loss = sum(opts[g][i][0] for g, i in enumerate(chosen))
    assert loss >= brute_force(profile, capacity) - 1e-12


def test_bits_budget_and_module_expansion():
    profile = {
        "modules": {
            "a": {
                "members": ["a"],
                "num_weights": 100,
                "formats": {
                    "int8": {"kl": 0.1, "ppl_delta": 0, "bytes": 100},
                    "int4-g32": {"kl": 0.5, "ppl_delta": 0, "bytes": 50},
                },
            },
            "experts": {
                "members": ["e.0", "e.1"],
                "num_weights": 100,
                "formats": {
                    "int8": {"kl": 0.3, "ppl_delta": 0, "bytes": 100},
                    "int4-g32": {"kl": 1.0, "ppl_delta": 0, "bytes": 50},
                },
            },
        }
    }
    # 6 bits over 200 weights = 150 bytes: one unit at int8, and it pays more to protect experts.
    assert budget_bytes(profile, "6bits") == 150
    assert plan_for_budget(profile, "6bits") == {"a": "int4-g32", "e.0": "int8", "e.1": "int8"}
    assert plan_for_budget(profile, "32bits") == {"a": DENSE, "e.0": DENSE, "e.1": DENSE}
    assert module_formats(profile, {"a": "int8", "experts": "int4-g32"}) == {
        "a": "int8",
        "e.0": "int4-g32",
        "e.1": "int4-g32",
    }


def test_budget_forms():
    profile = random_profile(random.Random(0), 2, 2)
    assert budget_bytes(profile, "60MB") == 60e6
    assert budget_bytes(profile, "2MiB") == 2 << 20
    assert budget_bytes(profile, " 1.5 kB ") == 1500
    assert budget_bytes(profile, "12ms", bandwidth_gbps=10.0) == pytest.approx(12e-3 * 10e9)


@pytest.mark.parametrize("budget", ["4.5", "bits", "-3bits", "12 parsecs", ""])
def test_unparseable_budget_is_a_validation_error(budget):
    with pytest.raises(ValidationError, match="not understood"):
        plan_for_budget(random_profile(random.Random(0), 2, 2), budget)


def test_infeasible_budget_raises():
    profile = random_profile(random.Random(1), 3, 2)
    with pytest.raises(PlanError, match="infeasible"):
        plan_for_budget(profile, "1bits")


def test_gcd_grid_is_exact_when_the_slack_is_large():
    """Costs in multiples of 384 (like SmolLM2's formats): exact with few cells."""
    rng = random.Random(7)
    opts = [[(rng.random(), 384 * rng.randint(1, 5000)) for _ in range(3)] for _ in range(4)]
    lo = sum(min(c for _, c in g) for g in opts)
    capacity = lo + 384 * 3000
    chosen = solve_knapsack(opts, capacity, max_cells=4000)
    best = min(
        sum(loss for loss, _ in combo)
        for combo in itertools.product(*opts)
        if sum(c for _, c in combo) <= capacity
    )
    assert sum(opts[g][i][0] for g, i in enumerate(chosen)) == pytest.approx(best, abs=1e-12)


class LinearCostModel:
    """A stand-in for zcode.hardware.cost_model.CostModel: 10 ms plus a fixed delta per module
    and format, linear like the real one."""

    def __init__(self, deltas: dict[str, dict[str, float]]) -> None:
        self.deltas = deltas

    def predict_decode_ms(self, model, plan=None):
        return 10.0 + sum(self.deltas[m][f] for m, f in (plan or {}).items())


def test_latency_budget_through_a_cost_model():
    rng = random.Random(3)
    profile = random_profile(rng, num_units=4, num_formats=3)
    deltas = {
        member: {"fp32": 0.0, **{f: -rng.random() for f in entry["formats"]}}
        for entry in profile["modules"].values()
        for member in entry["members"]
    }
    cost = LinearCostModel(deltas)
    per_unit = [
        [
            (
                entry["formats"][f]["kl"] if f != DENSE else 0.0,
                sum(deltas[m][f] for m in entry["members"]),
            )
            for f in [*entry["formats"], DENSE]
        ]
        for entry in profile["modules"].values()
    ]
    fastest = 10.0 + sum(min(ms for _, ms in g) for g in per_unit)
    for target_ms in (fastest + 0.5, fastest + 1.5, 9.999):
        result = plan(profile, f"{target_ms}ms", model=object(), cost_model=cost)
        assert result.predicted_ms <= target_ms + 1e-9
        best = min(
            sum(kl for kl, _ in combo)
            for combo in itertools.product(*per_unit)
            if 10.0 + sum(ms for _, ms in combo) <= target_ms
        )
        # Float costs go on a grid of MAX_CELLS cells, rounded up: optimal up to that rounding.
        assert result.predicted_kl == pytest.approx(best, abs=1e-9)
    with pytest.raises(PlanError, match="fastest plan"):
        plan(profile, f"{fastest - 0.1}ms", model=object(), cost_model=cost)
