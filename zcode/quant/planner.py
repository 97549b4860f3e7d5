"""Precision planner: the module -> format map that minimises the predicted quality loss under a
budget, as a multiple-choice knapsack solved exactly by dynamic programming over cost.

The profile (zcode/quant/sensitivity.py) gives, for each unit (one linear module, or one layer's
group of MoE experts) and each format, the KL divergence of quantizing that unit alone and the
bytes its weight then takes. Losses are taken as additive across units: the planner minimises
their sum. Every unit may also stay dense ("fp32", loss 0, 4 bytes per weight).

A budget is one string:

- average bits per weight over the planned modules: "4.5bits";
- bytes of planned weights: "60MB", "57.2MiB", "900kB", "1GB", "123456B";
- a batch-1 decode-step latency: "12ms". Given the loaded model, through the fitted cost model
  (zcode.hardware.cost_model): a step's predicted ms is linear in each linear's bytes and calls
  per kernel kind, so each unit's format adds a fixed number of ms to the step with every unit
  as loaded, and the knapsack's costs are those ms. Without the model: bytes read per token =
  latency x memory bandwidth measured by zcode.hardware.probe (KV, activations and per-call
  overheads left out, which makes it an upper bound on the weights that fit).

DP over cost: each unit's cost is its bytes above its cheapest option; the slack is the budget
minus every unit's cheapest option. When the costs are integers the grid cell is their greatest
common divisor (384 bytes for SmolLM2's formats), and if the slack fits in MAX_CELLS such cells
the solution is the exact optimum. Otherwise costs are rounded *up* to a grid of MAX_CELLS cells
over the slack: the plan still respects the budget, and is optimal up to that rounding.
"""

import math
import re
from dataclasses import dataclass

import numpy as np
from torch import nn

from zcode.errors import ValidationError

DENSE = "fp32"  # apply_precision's name for "leave the module as loaded"
DENSE_BYTES_PER_WEIGHT = 4
MAX_CELLS = 1 << 18  # cells of the DP's cost grid: choices take units x MAX_CELLS bytes

BYTE_UNITS = {
    "B": 1,
    "kB": 10**3,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KiB": 1 << 10,
    "MiB": 1 << 20,
    "GiB": 1 << 30,
}
BUDGET_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(bits|ms|[kKMG]i?B|B)\s*$")


class PlanError(ValidationError):
    """A budget that cannot be parsed or that no plan fits."""


@dataclass(frozen=True)
class Plan:
    formats: dict[str, str]  # unit -> format
    predicted_kl: float  # sum of the chosen options' KL
    weight_bytes: int  # bytes of the planned weights
    num_weights: int  # weights of the planned modules
    predicted_ms: float | None = None  # cost model's decode step ms, for latency budgets

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.weight_bytes / self.num_weights


def unit_options(profile: dict) -> dict[str, dict[str, tuple[float, int]]]:
    """unit -> format -> (kl, bytes), with the dense option added to every unit."""
    options = {}
    for unit, entry in profile["modules"].items():
        per_format = {fmt: (m["kl"], m["bytes"]) for fmt, m in entry["formats"].items()}
        per_format.setdefault(DENSE, (0.0, DENSE_BYTES_PER_WEIGHT * entry["num_weights"]))
        options[unit] = per_format
    return options


def parse_budget(budget: str) -> tuple[float, str]:
    """ "4.5bits" -> (4.5, "bits"); the unit is "bits", "ms" or a BYTE_UNITS key."""
    match = BUDGET_PATTERN.match(budget)
    if match is None:
        raise PlanError(
            f"budget {budget!r} not understood: use average bits ('4.5bits'), "
            "bytes ('60MB', '57MiB') or a decode-step latency ('12ms')"
        )
    return float(match[1]), match[2]


def budget_bytes(profile: dict, budget: str, bandwidth_gbps: float | None = None) -> float:
    """The bytes of weights a budget string allows (see the module docstring for the forms)."""
    value, unit = parse_budget(budget)
    if unit == "bits":
        num_weights = sum(entry["num_weights"] for entry in profile["modules"].values())
        return value / 8 * num_weights
    if unit == "ms":
        if bandwidth_gbps is None:
            from zcode.hardware.probe import probe

            bandwidth_gbps = probe().read_bandwidth_gbps
        return value * 1e-3 * bandwidth_gbps * 1e9
    return value * BYTE_UNITS[unit]


def solve_knapsack(
    options: list[list[tuple[float, float]]], capacity: float, max_cells: int = MAX_CELLS
) -> list[int]:
    """Multiple-choice knapsack: one option (loss, cost) per group, total cost <= capacity,
    minimal total loss. Returns the chosen option index per group.

    Raises PlanError when even the cheapest options exceed the capacity.
    """
    if max(map(len, options)) > np.iinfo(np.int8).max:
        raise ValueError("at most 127 options per group")
    min_costs = [min(cost for _, cost in group) for group in options]
    slack = capacity - sum(min_costs)
    if slack < 0:
        raise PlanError(
            f"budget infeasible: the cheapest plan needs {sum(min_costs):,.0f} bytes, "
            f"the budget allows {capacity:,.0f}"
        )
    extra = [[cost - low for _, cost in group] for group, low in zip(options, min_costs)]
    cell = max(slack / max_cells, 1e-12)
    if all(float(c).is_integer() for group in extra for c in group):
        divisor = math.gcd(*(int(c) for group in extra for c in group)) or 1
        if slack / divisor <= max_cells:
            cell = float(divisor)
    num_cells = int(math.floor(slack / cell + 1e-9)) + 1
    # best[c]: minimal loss of the groups so far with total extra cost <= c cells.
    best = np.zeros(num_cells)
    choices = np.zeros((len(options), num_cells), dtype=np.int8)
    for g, group in enumerate(options):
        candidates = np.full((len(group), num_cells), np.inf)
        for i, ((loss, _), cost) in enumerate(zip(group, extra[g])):
            cells = int(math.ceil(cost / cell - 1e-9))
            if cells < num_cells:
                candidates[i, cells:] = best[: num_cells - cells] + loss
        choices[g] = candidates.argmin(axis=0)
        best = candidates.min(axis=0)
    chosen, c = [], num_cells - 1
    for g in reversed(range(len(options))):
        i = int(choices[g, c])
        chosen.append(i)
        c -= int(math.ceil(extra[g][i] / cell - 1e-9))
    return chosen[::-1]


def latency_costs(profile: dict, model: nn.Module, cost_model) -> tuple[float, dict]:
    """(predicted batch-1 decode step ms with every unit as loaded, unit -> format -> the ms
    that format adds to it, negative when faster). Exact for the cost model, which is linear."""
    base_ms = cost_model.predict_decode_ms(model)
    deltas = {}
    for unit, per_format in unit_options(profile).items():
        members = profile["modules"][unit]["members"]
        deltas[unit] = {
            fmt: cost_model.predict_decode_ms(model, {m: fmt for m in members}) - base_ms
            for fmt in per_format
        }
    return base_ms, deltas


def plan(
    profile: dict,
    budget: str,
    bandwidth_gbps: float | None = None,
    model: nn.Module | None = None,
    cost_model=None,
) -> Plan:
    """The unit -> format plan of least predicted KL within the budget. A latency budget uses
    the cost model when `model` (the loaded, unquantized model) is given: `cost_model`, or this
    machine's fitted one (zcode.hardware.cost_model.CostModel.load_or_fit)."""
    options = unit_options(profile)
    units = list(options)
    names = [list(options[u]) for u in units]
    value, unit = parse_budget(budget)
    if unit == "ms" and model is not None:
        if cost_model is None:
            from zcode.hardware.cost_model import CostModel

            cost_model = CostModel.load_or_fit()
        base_ms, deltas = latency_costs(profile, model, cost_model)
        groups = [[(options[u][f][0], deltas[u][f]) for f in names[g]] for g, u in enumerate(units)]
        fastest_ms = base_ms + sum(min(cost for _, cost in group) for group in groups)
        if fastest_ms > value:
            raise PlanError(
                f"latency budget {budget} infeasible: the fastest plan's decode step is "
                f"predicted at {fastest_ms:.2f} ms on this machine (zcode.hardware.cost_model)"
            )
        chosen = solve_knapsack(groups, value - base_ms)
    else:
        groups = [list(options[u].values()) for u in units]
        chosen = solve_knapsack(groups, budget_bytes(profile, budget, bandwidth_gbps))
    formats = {u: names[g][i] for g, (u, i) in enumerate(zip(units, chosen))}
    predicted_ms = None
    if unit == "ms" and model is not None:
        predicted_ms = base_ms + sum(deltas[u][f] for u, f in formats.items())
    return Plan(
        formats=formats,
        predicted_kl=sum(options[u][f][0] for u, f in formats.items()),
        weight_bytes=sum(options[u][f][1] for u, f in formats.items()),
        num_weights=sum(entry["num_weights"] for entry in profile["modules"].values()),
        predicted_ms=predicted_ms,
    )


def module_formats(profile: dict, unit_formats: dict[str, str]) -> dict[str, str]:
    """unit -> format expanded to module name -> format, the map apply_precision takes."""
    return {
        member: fmt
        for unit, fmt in unit_formats.items()
        for member in profile["modules"][unit]["members"]
    }


def plan_for_budget(profile: dict, budget: str, model: nn.Module | None = None) -> dict[str, str]:
    """Module name -> format (a format of zcode.quant.FORMATS, or "fp32" for unchanged) of least
    predicted KL within `budget` ("4.5bits", "60MB", "12ms"; a latency goes through the cost
    model when the loaded `model` is given). Raises PlanError (a ValidationError) for a budget
    that cannot be parsed or met."""
    return module_formats(profile, plan(profile, budget, model=model).formats)
