"""The planner: a request's hints in, one ExecutionPlan out. The one place plans are made.

Dimensions searched jointly (their product), each where its calibration data exists:

- precision: the precision variants attached to the LLM (zcode.quant.variants: "fast", the base
  plan installed in the model, and the "balanced" / "max" variants of its most sensitive units),
  else the weights as loaded;
- FFN level: the sparsity artifact's calibrated levels (zcode calibrate), each on the float rows
  and on the int8 rows calibration measured it with (the row-skipping kernel reads either), when
  no precision level quantizes an FFN (the sparse FFN reads its own rows, not a variant's);
- KV heads: the artifact's least important KV groups skipped per request (needs an engine with
  `per_request_depth`): the k least important for each k calibration measured them together;
- experts per token (MoE models): each token's k highest-weighted routed experts of its top_k,
  for each k calibration measured (per token, so rows of one step run their own).

- skipped layers: the router's sets (zcode.harness.router, needs `per_request_depth`), each at
  its calibration mean loss, or at the router's prediction for this input when the LLM routes
  (`routed`); the sparsity artifact's layer scores are block influence, not a quality loss, and
  an explicit `skip_layers` runs as given, with an unknown predicted loss.

Quality model (an assumption, to be checked on held-out text: bench/bench_plan.py prints the
Spearman correlation of predicted and measured increases over combined plans): each dimension's
calibrated loss is an increase of log-perplexity (nats per token), and these add across
dimensions and units:

- a precision level: the sensitivity profile's KL(dense || quantized) summed over its units
  (the expected increase of next-token cross-entropy when the dense model's distribution is the
  text's; the precision planner already adds it across units);
- an FFN level: log(ppl_ratio) measured for the level on calibration text, on the rows it reads
  (int8 rows at a sparse level: measured together, not added);
- experts per token: log(ppl_ratio) measured for k on calibration text, every MoE layer at k;
- skipped KV groups: log of the perplexity ratio of ablating them together, as calibration
  measured for the k least important; any other set (named by the caller, or from an artifact
  written before the joint measurement) sums its groups' single ablations, which underestimates
  (SmolLM2-135M's four least important groups: 0.1% summed, 9% together);

the last two clamped at 0: dropping work is never predicted to help (a ratio under 1 is
calibration noise).

Predicted quality loss % = 100 * (exp(sum) - 1): a perplexity increase in percent.

Latency: the one hardware cost model (zcode.hardware.cost_model) predicts every candidate's
decode ms per step. With speculative decoding (an engine with a drafter and the adaptive draft
policy, `Speculation`), a candidate's ms per token is its step's over the tokens a step is
predicted to yield: the draft policy's predicted gain (zcode.spec.policy: verifying k drafts,
drafting them, and E(a, k) of them accepted) at the engine's acceptance rate so far, for the
draft count up to the plan's that it favours (none where no drafting pays, e.g. large
batches). Drafting costs no quality, so a latency target is met by speculation where it can be
before any lossy dimension is cut.

An FFN level is the fraction of FFN weight rows a step of one token reads
(`ffn_read_fraction`), at the sparse FFN kernel's own fitted rate for the rows' format
(`sparse-float32`, `sparse-int8`); experts per token, the share of each MoE layer's routed
experts a step is expected to read; skipped KV heads are not in
the cost model's features yet (their saved KV reads are not predicted: a conservative
prediction).

Search: with a latency target the least predicted loss among the plans meeting every target
(latency, memory, quality), else the fastest; when no plan meets them all, the plan nearest to
them, in the order memory, latency, quality (with a latency target alone: the fastest plan),
with `target_met` False. The binding constraint is the first target whose removal would give
a better plan by the same objective ("none" when none would).
"""

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from torch import nn

from zcode.engine.kv_cache import cache_dtype
from zcode.errors import ValidationError
from zcode.harness.plan import ExecutionPlan
from zcode.layers.moe import moe_layers

# quality= presets as budgets of predicted perplexity increase, %.
QUALITY_BUDGETS_PCT = {"max": 0.5, "balanced": 2.0, "fast": 10.0}
TARGETS = ("latency", "memory", "quality")
FALLBACK_ORDER = ("memory", "latency", "quality")  # which unmet target a fallback nears first


@dataclass(frozen=True)
class Hints:
    """What a request asks of its plan; all optional, any combination."""

    max_latency_ms: float | None = None  # predicted decode ms per output token
    max_quality_loss: float | None = None  # predicted perplexity increase, %
    quality: str | None = None  # shorthand for a max_quality_loss (QUALITY_BUDGETS_PCT)
    max_kv_bytes: int | None = None  # KV cache bytes per token
    plan: ExecutionPlan | None = None  # an explicit plan: runs as given, targets only reported
    # Explicit depth and routed experts per token (MoE; at or above the router's top_k: all):
    # the other dimensions are still searched (or `plan` runs with them).
    skip_layers: tuple[int, ...] = ()
    skip_kv_heads: tuple[tuple[int, int], ...] = ()
    experts_per_token: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_latency_ms", "max_quality_loss"):
            value = getattr(self, name)
            if value is not None and not _positive(value, allow_zero=name == "max_quality_loss"):
                raise ValidationError(f"{name} must be a finite number > 0, got {value!r}")
        if self.max_kv_bytes is not None and not (
            isinstance(self.max_kv_bytes, int)
            and not isinstance(self.max_kv_bytes, bool)
            and self.max_kv_bytes > 0
        ):
            raise ValidationError(f"max_kv_bytes must be a positive int, got {self.max_kv_bytes!r}")
        if self.quality is not None and self.quality not in QUALITY_BUDGETS_PCT:
            raise ValidationError(
                f"quality must be one of {', '.join(QUALITY_BUDGETS_PCT)}, got {self.quality!r}"
            )
        if self.plan is not None and not isinstance(self.plan, ExecutionPlan):
            raise ValidationError(f"plan must be an ExecutionPlan, got {type(self.plan).__name__}")
        count = self.experts_per_token
        if count is not None and not (isinstance(count, int) and not isinstance(count, bool)):
            raise ValidationError(f"experts_per_token must be an int >= 1, got {count!r}")
        if count is not None and count < 1:
            raise ValidationError(f"experts_per_token must be an int >= 1, got {count!r}")
        if self.plan is not None and count is not None:
            raise ValidationError("pass experts per token in the plan or as experts_per_token")
        plan_skips = self.plan is not None and (self.plan.skip_layers or self.plan.skip_kv_heads)
        if plan_skips and (self.skip_layers or self.skip_kv_heads):
            raise ValidationError(
                "pass skips in the plan or as skip_layers / skip_kv_heads, not both"
            )

    @property
    def quality_budget_pct(self) -> float | None:
        """The tighter of max_quality_loss and the quality preset's budget."""
        budgets = [self.max_quality_loss]
        if self.quality is not None:
            budgets.append(QUALITY_BUDGETS_PCT[self.quality])
        return min((b for b in budgets if b is not None), default=None)

    def limits(self) -> dict[str, float]:
        """{target: limit} of the targets given, in TARGETS order."""
        limits = {
            "latency": self.max_latency_ms,
            "memory": self.max_kv_bytes,
            "quality": self.quality_budget_pct,
        }
        return {name: limit for name, limit in limits.items() if limit is not None}


def _positive(value, allow_zero: bool) -> bool:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return ok and (value > 0 or (allow_zero and value == 0))


@dataclass(frozen=True)
class Speculation:
    """The engine's speculative decoding, as the planner predicts it."""

    policy: object  # zcode.spec.policy.DraftPolicy: prices verifying and drafting
    max_drafts: int  # the engine's num_draft_tokens
    acceptance: Callable[[], float]  # the rate predicted with: the engine's so far


@dataclass(frozen=True)
class SpeculationPrediction:
    acceptance: float  # the acceptance rate predicted with
    num_draft_tokens: int  # drafts per step the prediction favours (0: none pays)
    gain: float  # predicted decode speed over the same plan without drafts


@dataclass(frozen=True)
class Candidate:
    """One plan the model can run, with its predictions."""

    plan: ExecutionPlan
    # Cost model's decode ms per output token (per step, over the tokens a step yields with
    # drafts); None without a cost model.
    ms_per_token: float | None
    quality_loss_pct: float | None  # None where a dimension has no calibrated loss
    kv_bytes_per_token: int
    speculation: SpeculationPrediction | None = None
    modules: dict = field(default_factory=dict, compare=False, repr=False)  # its precision's

    def value(self, target: str) -> float:
        value = {
            "latency": self.ms_per_token,
            "memory": self.kv_bytes_per_token,
            "quality": self.quality_loss_pct,
        }[target]
        return math.inf if value is None else value


@dataclass(frozen=True)
class PlanChoice:
    plan: ExecutionPlan
    predicted_ms_per_token: float | None
    predicted_quality_loss_pct: float | None
    kv_bytes_per_token: int
    binding: str  # "latency", "quality", "memory", "override" or "none"
    target_met: bool  # every target given is met by the predictions
    speculation: SpeculationPrediction | None = None
    latency_scale: float = 1.0  # the predictions' factor (choose's latency_scale)


def search(candidates: list[Candidate], hints: Hints) -> PlanChoice:
    """The candidate the hints ask for (see the module docstring); `hints.plan` and skips are
    handled by the planner, which narrows `candidates` before."""
    if not candidates:
        raise ValidationError("no plan to choose from")
    limits = hints.limits()
    if "latency" in limits or "quality" not in limits:
        objective = ("quality", "latency")  # the least loss, then the fastest
    else:
        objective = ("latency", "quality")  # the fastest within the quality budget

    def key(c: Candidate) -> tuple:
        return tuple(c.value(t) for t in objective)

    def meeting(targets: Iterable[str]) -> list[Candidate]:
        return [c for c in candidates if all(c.value(t) <= limits[t] for t in targets)]

    feasible = meeting(limits)
    if feasible:
        best = min(feasible, key=key)
        binding = next(
            (t for t in limits if key(min(meeting(set(limits) - {t}), key=key)) < key(best)),
            "none",
        )
        return _choice(best, binding, True)

    def excess(c: Candidate) -> tuple:
        return tuple(max(0.0, c.value(t) - limits[t]) for t in FALLBACK_ORDER if t in limits)

    best = min(candidates, key=lambda c: (*excess(c), *key(c)))
    binding = next(t for t in FALLBACK_ORDER if t in limits and best.value(t) > limits[t])
    return _choice(best, binding, False)


def _choice(c: Candidate, binding: str, target_met: bool) -> PlanChoice:
    return PlanChoice(
        c.plan,
        c.ms_per_token,
        c.quality_loss_pct,
        c.kv_bytes_per_token,
        binding,
        target_met,
        c.speculation,
    )


@dataclass(frozen=True)
class Option:
    """One setting of one dimension: what it puts in the plan and its calibrated loss."""

    label: str  # its part of the plan's name
    log_loss: float | None  # predicted log-perplexity increase, nats/token; None: uncalibrated
    precision: tuple[tuple[str, str], ...] = ()
    modules: dict = field(default_factory=dict, compare=False)  # name -> module it runs there
    touches_ffn: bool = False  # quantizes an FFN linear (no FFN sparsity on top)
    ffn_level: tuple[float, float] | None = None  # (sparsity_in, sparsity_mid)
    ffn_weights: str = "fp32"  # the rows a sparse FFN reads: as loaded, or "int8"
    ffn_density: float = 1.0  # fraction of FFN weight rows a step reads
    skip_layers: tuple[int, ...] = ()
    skip_kv_heads: tuple[tuple[int, int], ...] = ()
    experts_per_token: int | None = None  # routed experts a token runs (None: its top_k)


ALL_EXPERTS = Option("", 0.0)


class Planner:
    """Candidates from the model's calibration data and the one cost model; `choose(hints)`."""

    def __init__(
        self,
        model: nn.Module,
        cost=None,  # zcode.hardware.cost_model.CostModel, or None: no latency predictions
        variants=None,  # zcode.quant.variants.PrecisionVariants
        sparsity=None,  # zcode.sparsity.artifact.SparsityArtifact
        kv_paged: bool = False,  # the engine keeps KV per head (per_request_depth)
        router=None,  # zcode.harness.router.Router: skipped-layer depths, routed by input
        speculation: Speculation | None = None,  # the engine drafts (an adaptive policy)
        compiled: bool = False,  # decode steps are compiled graphs, priced by their own fit
    ) -> None:
        self.model, self.cost, self.kv_paged, self.router = model, cost, kv_paged, router
        self.compiled = compiled
        self.speculation = speculation if cost is not None else None
        self.kv_bytes_per_head = kv_bytes_per_head(model)
        self.precisions = precision_options(variants)
        self.ffn_levels = ffn_options(sparsity, any(p.touches_ffn for p in self.precisions))
        self.head_losses = HeadLosses.of(sparsity)
        self.expert_counts = expert_options(sparsity)
        self.top_k = min((moe.gate.top_k for moe in moe_layers(model)), default=None)
        self.depths = [Option("", 0.0)]
        if kv_paged:
            self.depths += self.head_losses.options()
            self.depths += layer_options(router)
        self.default_ffn = self.ffn_levels[0]
        if sparsity is not None:
            from zcode.sparsity.apply import DEFAULT_MAX_PPL_RATIO

            level = sparsity.best_level(DEFAULT_MAX_PPL_RATIO)  # what LLM(sparsity=) installs
            default = ((level.sparsity_in, level.sparsity_mid), "fp32")
            self.default_ffn = next(
                f for f in self.ffn_levels if (f.ffn_level, f.ffn_weights) == default
            )
        self._memo: dict[tuple, list[Candidate]] = {}

    def default_plan(self) -> ExecutionPlan:
        """The plan the model runs as loaded: the base precision, the default FFN level."""
        return self.plan_of(self.precisions[0], self.default_ffn, self.depths[0])

    def plan_of(
        self, precision: Option, ffn: Option, depth: Option, experts: Option = ALL_EXPERTS
    ) -> ExecutionPlan:
        extras = []
        if ffn.ffn_level is not None:
            s_in, s_mid = ffn.ffn_level
            extras += [("ffn_sparsity_in", f"{s_in:g}"), ("ffn_sparsity_mid", f"{s_mid:g}")]
            if ffn.ffn_weights != "fp32":
                extras.append(("ffn_weights", ffn.ffn_weights))
        if experts.experts_per_token is not None:
            extras.append(("experts_per_token", str(experts.experts_per_token)))
        options = (precision, ffn, experts, depth)
        name = ", ".join(o.label for o in options if o.label) or "as loaded"
        return ExecutionPlan(
            name=name,
            precision=precision.precision,
            ffn_density=ffn.ffn_density,
            skip_layers=depth.skip_layers,
            skip_kv_heads=depth.skip_kv_heads,
            extras=tuple(sorted(extras)),
        )

    def candidates(
        self,
        depth: Option | None = None,
        batch_size: int = 1,
        context_len: int = 512,
        experts: Option | None = None,
    ) -> list[Candidate]:
        """Every plan of the product of dimensions (with `depth` and `experts` fixed when
        given)."""
        key = (depth, batch_size, context_len, experts)
        if key not in self._memo:
            depths = self.depths if depth is None else [depth]
            counts = self.expert_counts if experts is None else [experts]
            self._memo[key] = [
                self._candidate(p, f, e, d, batch_size, context_len)
                for p in self.precisions
                for f in self.ffn_levels
                for e in counts
                for d in depths
            ]
        return self._memo[key]

    def _candidate(
        self,
        precision: Option,
        ffn: Option,
        experts: Option,
        depth: Option,
        batch_size: int,
        context_len: int,
    ) -> Candidate:
        plan = self.plan_of(precision, ffn, depth, experts)
        ms = None
        if self.cost is not None:
            try:
                ms = self.cost.predict_decode_ms(
                    self.model,
                    plan,
                    modules=precision.modules,
                    batch_size=batch_size,
                    context_len=context_len,
                    compiled=self.compiled,
                    kv_paged=self.kv_paged,
                )
            except ValueError as e:  # a kernel kind the fit never measured
                raise ValidationError(
                    f"the cost model cannot predict plan {plan.name!r}: {e}"
                ) from None
        losses = [o.log_loss for o in (precision, ffn, experts, depth)]
        loss_pct = None if None in losses else 100 * math.expm1(sum(losses))
        return Candidate(plan, ms, loss_pct, self.kv_bytes(depth), modules=precision.modules)

    def _speculating(
        self, candidates: list[Candidate], batch_size: int, context_len: int
    ) -> list[Candidate]:
        """The candidates with the engine's drafting in their ms per token: each verifies up
        to its plan's drafts (None: the engine's), as many as the predictions favour."""
        if self.speculation is None:
            return candidates
        spec, acceptance = self.speculation, self.speculation.acceptance()
        out = []
        for c in candidates:
            limit = c.plan.num_draft_tokens
            drafts, gain = spec.policy.best_gain(
                acceptance,
                spec.max_drafts if limit is None else min(limit, spec.max_drafts),
                num_seqs=batch_size,
                context_len=context_len,
                plan=c.plan,
                modules=c.modules,
            )
            prediction = SpeculationPrediction(acceptance, drafts, gain)
            out.append(replace(c, ms_per_token=c.ms_per_token / gain, speculation=prediction))
        return out

    def kv_bytes(self, depth: Option) -> int:
        skipped_heads = [0] * len(self.kv_bytes_per_head)
        for layer, _ in depth.skip_kv_heads:
            skipped_heads[layer] += 1
        return sum(
            per_head * (heads - skipped_heads[i])
            for i, (per_head, heads) in enumerate(self.kv_bytes_per_head)
            if i not in depth.skip_layers
        )

    def choose(
        self,
        hints: Hints,
        batch_size: int = 1,
        context_len: int = 512,
        routed: list[float] | None = None,
        latency_scale: float = 1.0,
    ) -> PlanChoice:
        """`routed`: the router's predicted log-loss of this input under each of its depths,
        in place of their calibration means. `latency_scale`: measured over predicted ms of
        the engine's latest requests (zcode.harness.report.LatencyFeedback), which multiplies
        the predictions a latency target is checked against; an explicit plan is not chosen
        by them and keeps the cost model's."""
        if hints.max_latency_ms is not None and self.cost is None:
            raise ValidationError(
                "max_latency_ms predicts with this machine's fitted cost model: fit it once with "
                "`zcode hw --fit-cost`"
            )
        if hints.plan is not None:
            return self._override(hints, batch_size, context_len)
        depth = None
        if hints.skip_layers or hints.skip_kv_heads:
            depth = self.explicit_depth(hints.skip_layers, hints.skip_kv_heads)
        experts = None
        if hints.experts_per_token is not None:
            experts = self.explicit_experts(hints.experts_per_token)
        candidates = self.candidates(depth, batch_size, context_len, experts)
        if routed is not None and depth is None:
            candidates = self._routed(candidates, routed)
        candidates = self._speculating(candidates, batch_size, context_len)
        if latency_scale != 1.0:
            candidates = [_scaled(c, latency_scale) for c in candidates]
        if not hints.limits():
            depth, experts = depth or self.depths[0], experts or ALL_EXPERTS
            default = self.plan_of(self.precisions[0], self.default_ffn, depth, experts)
            found = next(c for c in candidates if c.plan.signature() == default.signature())
            return replace(_choice(found, "none", True), latency_scale=latency_scale)
        return replace(search(candidates, hints), latency_scale=latency_scale)

    def _routed(self, candidates: list[Candidate], routed: list[float]) -> list[Candidate]:
        """The candidates with the routed depths' losses for this input: each skipped-layer
        set's calibration mean replaced by the router's prediction (log-losses add)."""
        shift = {
            depth: predicted - mean
            for depth, mean, predicted in zip(
                self.router.depths, self.router.mean_log_loss, routed, strict=True
            )
        }
        out = []
        for c in candidates:
            routes = c.plan.skip_layers and not c.plan.skip_kv_heads
            delta = shift.get(c.plan.skip_layers) if routes else None
            if delta is None or c.quality_loss_pct is None:
                out.append(c)
                continue
            log_loss = max(0.0, math.log1p(c.quality_loss_pct / 100) + delta)
            out.append(replace(c, quality_loss_pct=100 * math.expm1(log_loss)))
        return out

    def explicit_depth(self, skip_layers, skip_kv_heads) -> Option:
        """A depth option for skips the caller names; its loss is known only for KV heads the
        artifact scored and no skipped layer (layer scores are not a quality loss)."""
        layers = tuple(sorted(set(skip_layers)))
        heads = tuple(sorted({tuple(p) for p in skip_kv_heads}))
        log_loss = None if layers else self.head_losses.log_loss(heads)
        labels = [f"skip layers {list(layers)}" if layers else "", _heads_label(heads)]
        return Option(
            ", ".join(filter(None, labels)), log_loss, skip_layers=layers, skip_kv_heads=heads
        )

    def explicit_experts(self, count: int) -> Option:
        """An experts option for a count the caller names (all of them at or above the router's
        top_k); its loss is known where calibration measured that count."""
        if self.top_k is None:
            raise ValidationError("experts per token: this model has no MoE layers")
        if count < 1:
            raise ValidationError(f"experts_per_token must be an int >= 1, got {count}")
        if count >= self.top_k:
            return ALL_EXPERTS
        known = {o.experts_per_token: o for o in self.expert_counts}
        return known.get(count) or Option(f"{count} experts/token", None, experts_per_token=count)

    def _override(self, hints: Hints, batch_size: int, context_len: int) -> PlanChoice:
        plan = hints.plan
        if hints.skip_layers or hints.skip_kv_heads:
            plan = replace(plan, skip_layers=hints.skip_layers, skip_kv_heads=hints.skip_kv_heads)
        depth = self.explicit_depth(plan.skip_layers, plan.skip_kv_heads)
        experts = None
        if (count := dict(plan.extras).get("experts_per_token")) is not None:
            if not count.isdigit():
                raise ValidationError(f"the plan's experts_per_token {count!r} is not an int >= 1")
            experts = self.explicit_experts(int(count))
        candidates = self.candidates(depth, batch_size, context_len, experts)
        found = next((c for c in candidates if c.plan.kv_signature() == plan.kv_signature()), None)
        if found is None:
            known = sorted(c.plan.name for c in candidates)
            raise ValidationError(
                f"plan {plan.name!r} is not one this model can run; its plans: {known[:8]}"
            )
        drafting = replace(found.plan, num_draft_tokens=plan.num_draft_tokens)
        found = self._speculating([replace(found, plan=drafting)], batch_size, context_len)[0]
        limits = hints.limits()
        met = all(found.value(t) <= limit for t, limit in limits.items())
        return _choice(found, "override", met)


def _scaled(c: Candidate, scale: float) -> Candidate:
    return c if c.ms_per_token is None else replace(c, ms_per_token=c.ms_per_token * scale)


def _heads_label(heads: tuple[tuple[int, int], ...]) -> str:
    return f"skip {len(heads)} KV heads" if heads else ""


def precision_options(variants) -> list[Option]:
    """The base precision first (the weights as loaded, or the variants' "fast" plan), then the
    variants' "balanced" and "max" levels. Loss: the profile's summed KL."""
    if variants is None:
        return [Option("", 0.0)]
    options = []
    for quality in ("fast", "balanced", "max"):
        level = variants.levels[quality]
        options.append(
            Option(
                level.plan.name,
                level.predicted_kl,
                precision=level.plan.precision,
                modules=level.modules,
                touches_ffn=quantizes_ffn(level.plan.precision),
            )
        )
    return options


def quantizes_ffn(precision: tuple[tuple[str, str], ...]) -> bool:
    """Whether a plan's precision swaps an FFN linear: the sparse FFN kernel, which reads its
    own rows (fp32 or int8), cannot run on top of it."""
    return any(".mlp." in name for name, _ in precision)


def ffn_read_fraction(sparsity_in: float, sparsity_mid: float) -> float:
    """Fraction of a SwiGLU FFN's weight bytes a decode step of one token reads at a TEAL level:
    gate and up read their kept input rows, down its kept rows (three matrices of one size).
    The row kernel reads only the kept rows at any share below 16 tokens a step
    (zcode.sparsity.kernel); a batch reads the union of its tokens' rows, more than this."""
    return (2 * (1 - sparsity_in) + (1 - sparsity_mid)) / 3


def ffn_options(sparsity, precision_touches_ffn: bool) -> list[Option]:
    """The artifact's levels, dense first, each on the float rows then on each other format's
    rows it was calibrated with; only the dense float one when no artifact, or when a precision
    level quantizes FFNs (SparseMLP reads its own rows)."""
    if sparsity is None:
        return [Option("", 0.0)]
    levels = sorted(sparsity.levels, key=lambda lv: lv.flops_skipped)
    options = []
    for lv in levels:
        dense = (lv.sparsity_in, lv.sparsity_mid) == (0.0, 0.0)
        if precision_touches_ffn and not dense:
            continue
        label = f"ffn in {lv.sparsity_in:g} / mid {lv.sparsity_mid:g}"
        ratios = {"fp32": lv.ppl_ratio}
        if not precision_touches_ffn:
            ratios.update(lv.weight_ppl_ratios)
        for weights, ratio in ratios.items():
            options.append(
                Option(
                    label if weights == "fp32" else f"{label}, {weights} rows",
                    max(0.0, math.log(ratio)),
                    ffn_level=(lv.sparsity_in, lv.sparsity_mid),
                    ffn_weights=weights,
                    ffn_density=ffn_read_fraction(lv.sparsity_in, lv.sparsity_mid),
                )
            )
    if not options or options[0].ffn_level != (0.0, 0.0):
        raise ValidationError("the sparsity artifact has no dense FFN level (0, 0): recalibrate")
    return options


@dataclass(frozen=True)
class HeadLosses:
    """Calibrated log-perplexity losses of skipping KV groups: each (layer, group) alone, and
    the k least important together for each k measured."""

    single: dict[tuple[int, int], float]  # clamped at 0
    together: dict[tuple[tuple[int, int], ...], float]  # sorted set -> loss, clamped at 0

    @classmethod
    def of(cls, sparsity) -> "HeadLosses":
        if sparsity is None:
            return cls({}, {})
        from zcode.sparsity.head_skip import prune_order

        scores = sparsity.head_scores
        order = prune_order(scores)
        single = {p: max(0.0, math.log(float(scores[p]))) for p in order}
        together = {
            tuple(sorted(order[:k])): max(0.0, math.log(ratio))
            for k, ratio in sparsity.head_count_ratios.items()
        }
        if not together:  # an older artifact: the k least important, their sum
            from zcode.sparsity.head_skip import HEAD_COUNTS

            together = {
                heads: sum(single[p] for p in heads)
                for heads in (tuple(sorted(order[:k])) for k in HEAD_COUNTS if k <= len(order))
            }
        return cls(single, together)

    def log_loss(self, heads: tuple[tuple[int, int], ...]) -> float | None:
        """The loss of skipping `heads` (sorted), None when a group was not scored."""
        if heads in self.together:
            return self.together[heads]
        if all(p in self.single for p in heads):
            return sum(self.single[p] for p in heads)
        return None

    def options(self) -> list[Option]:
        """Skipping the k least important KV groups, for each k measured."""
        return [
            Option(_heads_label(heads), loss, skip_kv_heads=heads)
            for heads, loss in sorted(self.together.items(), key=lambda kv: len(kv[0]))
        ]


def expert_options(sparsity) -> list[Option]:
    """All of each token's top_k routed experts first, then each count k calibration measured
    (MoE models), at its measured loss."""
    ratios = {} if sparsity is None else sparsity.expert_count_ratios
    return [ALL_EXPERTS] + [
        Option(f"{k} experts/token", max(0.0, math.log(ratio)), experts_per_token=k)
        for k, ratio in sorted(ratios.items(), reverse=True)
    ]


def layer_options(router) -> list[Option]:
    """The router's skipped-layer sets, at their calibration mean loss (the router's prediction
    for a given input replaces it: Planner.choose's `routed`)."""
    if router is None:
        return []
    return [
        Option(f"skip {len(depth)} layers", log_loss, skip_layers=depth)
        for depth, log_loss in zip(router.depths, router.mean_log_loss)
        if depth
    ]


def kv_bytes_per_head(model: nn.Module) -> list[tuple[int, int]]:
    """Per attention layer: (KV cache bytes per token of one KV head, KV heads), from what each
    layer caches (`cache_spec`) in the KV cache's dtype."""
    dtype_bytes = cache_dtype(model).itemsize
    out = []
    for layer in model.attention_layers():
        spec = layer.cache_spec()
        total = sum(math.prod(shape) for shape in spec.values()) * dtype_bytes
        heads = getattr(layer, "num_kv_heads", 1) if spec else 1
        out.append((total // heads, heads))
    return out
