"""Precision variants: up to two higher-precision variants kept in memory for a model's most
sensitive units, the precision levels the planner (zcode.harness.planner) chooses among.

Built from the unquantized model and a sensitivity profile (zcode.quant.sensitivity):

- "fast" is the base plan, the planner's least-KL plan within a budget (zcode.quant.planner),
  installed in the model and run whenever no quality is asked for;
- "balanced" and "max" run the same plan with a set of units in the first and the second
  variant format (by default int8 and the unquantized weights).

Which units get variants is a 0/1 knapsack solved exactly by the planner's DP: keep the units
whose KL saved by the "max" variant (base KL - max KL, from the profile) sums highest, subject
to the memory the variant weights take (both variants of each kept unit, as stored) <= the cap.

A plan with a variant's precision is applied by the plan executor (zcode.harness.executor): it
swaps the variant modules in, declares the plan to the model runner and puts the base back
afterwards; KV computed under a variant is salted by the plan, so its requests reuse and publish
prefix-cache blocks among themselves only.
"""

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import nn

from zcode.errors import ValidationError
from zcode.harness.plan import ExecutionPlan
from zcode.quant.apply import UNCHANGED, apply_precision, quantizable_modules
from zcode.quant.linear import Kernel, QuantizedLinear
from zcode.quant.planner import (
    BYTE_UNITS,
    DENSE_BYTES_PER_WEIGHT,
    parse_budget,
    plan,
    solve_knapsack,
)

DEFAULT_VARIANT_FORMATS = ("int8", UNCHANGED)  # "balanced", "max"


@dataclass(frozen=True)
class QualityPlan:
    """One quality level: its execution plan and the modules it runs for the variant units."""

    quality: str
    plan: ExecutionPlan
    modules: dict[str, nn.Module]  # module name -> the module this level runs there
    predicted_kl: float  # sum over units of the profile's KL of the format each unit runs
    weight_bytes: int  # bytes of the planned weights a decode step reads


def parse_memory_cap(cap: str | int) -> int:
    """Bytes of a memory cap: an int, or a string such as "40MB" / "32MiB"."""
    if isinstance(cap, int):
        value, unit = float(cap), "B"
    else:
        value, unit = parse_budget(cap)
    if unit not in BYTE_UNITS:
        raise ValidationError(f"memory cap {cap!r} must be bytes ('40MB', '32MiB', 1000000)")
    if value < 0:
        raise ValidationError(f"memory cap must not be negative, got {cap!r}")
    return int(value * BYTE_UNITS[unit])


def unit_cost(entry: dict, fmt: str) -> tuple[float, int]:
    """(KL, weight bytes) of a profiled unit in `fmt`; the unquantized weights have KL 0."""
    if fmt == UNCHANGED:
        return 0.0, DENSE_BYTES_PER_WEIGHT * entry["num_weights"]
    measured = entry["formats"][fmt]
    return measured["kl"], measured["bytes"]


def stored_bytes(module: nn.Module, resident: set[int]) -> int:
    """Bytes a module's tensors take in memory (every packed copy, scales and bias), except
    those in `resident` (data pointers of tensors kept anyway: a tied lm_head's embedding)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if t.data_ptr() not in resident)


class PrecisionVariants:
    """The base plan installed in a model, and the variant modules of its most sensitive units."""

    def __init__(
        self,
        levels: dict[str, QualityPlan],
        variant_units: list[str],
        memory_bytes: int,
        memory_cap_bytes: int,
    ) -> None:
        self.levels = levels
        self.variant_units = variant_units
        self.memory_bytes = memory_bytes  # of the variant modules held beside the base
        self.memory_cap_bytes = memory_cap_bytes

    @classmethod
    def build(
        cls,
        model: nn.Module,
        profile: dict,
        budget: str,
        memory_cap: str | int,
        formats: tuple[str, str] = DEFAULT_VARIANT_FORMATS,
        kernel: Kernel = "fast",
    ) -> "PrecisionVariants":
        """Quantizes `model` in place to the plan of least predicted KL within `budget` and keeps
        the ("balanced", "max") `formats` of the units chosen under `memory_cap`."""
        if len(formats) != 2:
            raise ValidationError(f"two variant formats (balanced, max), got {formats!r}")
        unprofiled = [f for f in formats if f != UNCHANGED and f not in profile["formats"]]
        if unprofiled:
            raise ValidationError(f"variant formats {unprofiled} are not in the profile")
        names = quantizable_modules(model)
        if any(isinstance(m, QuantizedLinear) for m in model.modules()):
            raise NotImplementedError(
                "precision variants of an already quantized model: build them from the "
                "unquantized model, whose weights the variants are made from"
            )
        cap = parse_memory_cap(memory_cap)
        base = plan(profile, budget)
        entries = profile["modules"]
        profiled = {m for e in entries.values() for m in e["members"]}
        if profiled != set(names):
            mismatch = sorted(profiled ^ set(names))[:3]
            raise ValidationError(f"the profile is not of this model's modules: {mismatch}")
        modules = dict(model.named_modules())
        resident = {  # tensors that stay in memory whatever the plan: embeddings, norms
            t.data_ptr()
            for name, module in modules.items()
            if name not in names
            for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        }

        # Every candidate's variant modules, built so that their memory is known exactly.
        built: dict[str, dict[str, dict[str, nn.Module]]] = {}  # unit -> format -> modules
        candidates, groups = [], []
        for unit, base_fmt in base.formats.items():
            gain = unit_cost(entries[unit], base_fmt)[0] - unit_cost(entries[unit], formats[1])[0]
            if gain <= 0:
                continue
            built[unit] = {
                fmt: {
                    m: modules[m]
                    if fmt == UNCHANGED
                    else QuantizedLinear.from_linear(modules[m], fmt, kernel)
                    for m in entries[unit]["members"]
                }
                for fmt in formats
                if fmt != base_fmt
            }
            extra = sum(
                stored_bytes(module, resident)
                for per_module in built[unit].values()
                for module in per_module.values()
            )
            if extra <= cap:
                candidates.append(unit)
                groups.append([(gain, 0.0), (0.0, float(extra))])
        if not candidates:
            raise ValidationError(
                f"a memory cap of {cap:,} bytes holds no unit's variants that would gain "
                f"quality over the {budget} plan"
            )
        chosen = [u for u, keep in zip(candidates, solve_knapsack(groups, float(cap))) if keep]

        originals = {m: modules[m] for u in chosen for m in entries[u]["members"]}
        base_modules = apply_precision(
            model, {m: f for u, f in base.formats.items() for m in entries[u]["members"]}, kernel
        )
        at_base = {m: base_modules.get(m, original) for m, original in originals.items()}
        levels = {"fast": cls._level("fast", base.formats, at_base, entries)}
        for quality, fmt in zip(("balanced", "max"), formats):
            variant = {
                m: built[u].get(fmt, {m: at_base[m]})[m]
                for u in chosen
                for m in entries[u]["members"]
            }
            unit_formats = {**base.formats, **{u: fmt for u in chosen}}
            levels[quality] = cls._level(quality, unit_formats, variant, entries)
        held = sum(
            stored_bytes(module, resident)
            for u in chosen
            for per_module in built[u].values()
            for module in per_module.values()
        )
        return cls(levels, chosen, held, cap)

    @staticmethod
    def _level(
        quality: str,
        unit_formats: dict[str, str],
        modules: dict[str, nn.Module],
        entries: dict,
    ) -> QualityPlan:
        precision = tuple(
            sorted(
                (m, f)
                for u, f in unit_formats.items()
                if f != UNCHANGED
                for m in entries[u]["members"]
            )
        )
        costs = [unit_cost(entries[u], f) for u, f in unit_formats.items()]
        num_weights = sum(e["num_weights"] for e in entries.values())
        weight_bytes = sum(b for _, b in costs)
        name = f"quality={quality}: {8 * weight_bytes / num_weights:.3f} bits/weight"
        return QualityPlan(
            quality=quality,
            plan=ExecutionPlan(name=name, precision=precision),
            modules=modules,
            predicted_kl=sum(kl for kl, _ in costs),
            weight_bytes=weight_bytes,
        )


def swap(model: nn.Module, modules: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """Puts `modules` in place by name; returns the ones they replaced."""
    replaced = {}
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        replaced[name] = getattr(model.get_submodule(parent), child)
        setattr(model.get_submodule(parent), child, module)
    return replaced


def copy_with(model: nn.Module, modules: dict[str, nn.Module]) -> nn.Module:
    """A second module tree over the model's tensors (parameters, buffers, the KV cache's
    dicts), with `modules` in place by name: a cheaper plan that runs, and compiles, beside the
    model without changing it. Private dicts (children, hooks, kernel choices) are the copy's
    own; public dict attributes such as `cache` stay shared."""

    def tree(module: nn.Module) -> nn.Module:
        clone = copy.copy(module)
        for attr, value in vars(module).items():
            if attr.startswith("_") and isinstance(value, dict):
                clone.__dict__[attr] = type(value)(value)
        clone.__dict__["_modules"] = {
            name: None if child is None else tree(child) for name, child in module._modules.items()
        }
        return clone

    clone = tree(model)
    swap(clone, modules)
    return clone


@contextmanager
def swapped(model: nn.Module, modules: dict[str, nn.Module]) -> Iterator[None]:
    """The model with `modules` in place by name, its own put back on exit."""
    replaced = swap(model, modules)
    try:
        yield
    finally:
        swap(model, replaced)


def attach_variants(llm, profile: dict, budget: str, memory_cap: str | int, **options) -> dict:
    """Builds PrecisionVariants on `llm` (see PrecisionVariants.build), installs the base plan and
    declares it; the planner (zcode.harness.planner) then chooses among the levels. Returns the
    base plan's summary. With a calibration artifact (`llm.sparsity`) the FFNs are its dimension
    (sparse levels on fp32 or int8 rows): they become SparseMLPs first (at the dense level, the
    same outputs), so the variants cover the other units, as the artifact's profile does."""
    if llm.sparsity is not None:
        from zcode.sparsity.apply import sparse_ffns

        sparse_ffns(llm.model, llm.sparsity)
    variants = PrecisionVariants.build(llm.model, profile, budget, memory_cap, **options)
    llm.precision_variants = variants
    llm.declare_default_plan()
    fast = variants.levels["fast"]
    return {
        "plan": fast.plan.name,
        "signature": fast.plan.signature(),
        "variant_units": list(variants.variant_units),
        "predicted_kl": round(fast.predicted_kl, 6),
        "weight_bytes": fast.weight_bytes,
        "variant_memory_bytes": variants.memory_bytes,
        "memory_cap_bytes": variants.memory_cap_bytes,
    }
