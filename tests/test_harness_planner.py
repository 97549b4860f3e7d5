"""The planner: hint validation, the joint search on synthetic candidates (expected choices worked
out by hand), and the candidates it builds from a model, a sparsity artifact and a cost model
(predictions checked against the formulas computed here from the model's sizes)."""

import math
from dataclasses import replace

import pytest
import torch
from artifacts import synthetic_artifact
from cost_models import synthetic_coefficients, synthetic_cost_model

from zcode.errors import ValidationError
from zcode.harness.plan import ExecutionPlan
from zcode.harness.planner import Candidate, Hints, Planner, ffn_read_fraction, search

# name: (ms per token, quality loss %, KV bytes per token)
TABLE = {
    "A": (30.0, 0.0, 100),
    "B": (20.0, 1.0, 100),
    "C": (12.0, 5.0, 100),
    "D": (25.0, 0.5, 50),
    "E": (10.0, 20.0, 50),
}
CANDIDATES = [
    Candidate(ExecutionPlan(name=name, ffn_density=1 - i / 10), ms, loss, kv)
    for i, (name, (ms, loss, kv)) in enumerate(TABLE.items())
]


@pytest.mark.parametrize(
    "hints, name, binding, met",
    [
        (Hints(), "A", "none", True),  # no target: the least loss
        (Hints(max_latency_ms=22), "B", "latency", True),  # B C E meet it; B loses least
        (Hints(max_latency_ms=26), "D", "latency", True),
        (Hints(max_latency_ms=40), "A", "none", True),  # everything meets it
        (Hints(max_quality_loss=2.0), "B", "quality", True),  # A B D within; B fastest
        (Hints(quality="balanced"), "B", "quality", True),  # balanced = 2%
        (Hints(quality="max", max_quality_loss=5.0), "D", "quality", True),  # the tighter: 0.5%
        (Hints(max_kv_bytes=60), "D", "memory", True),  # D E fit; D loses least
        # only E meets both; without the latency target D would lose less
        (Hints(max_latency_ms=22, max_kv_bytes=60), "E", "latency", True),
        (Hints(max_latency_ms=5), "E", "latency", False),  # nothing meets it: the fastest
        # nothing within 0.1% at 11 ms: E meets the latency, nears the loss least of those that do
        (Hints(max_latency_ms=11, max_quality_loss=0.1), "E", "quality", False),
        (Hints(max_kv_bytes=10, max_latency_ms=11), "E", "memory", False),
    ],
)
def test_search_obeys_each_constraint(hints, name, binding, met):
    choice = search(CANDIDATES, hints)
    assert (choice.plan.name, choice.binding, choice.target_met) == (name, binding, met)
    ms, loss, kv = TABLE[name]
    assert (choice.predicted_ms_per_token, choice.predicted_quality_loss_pct) == (ms, loss)
    assert choice.kv_bytes_per_token == kv


def test_an_unknown_loss_never_meets_a_quality_budget():
    unknown = Candidate(ExecutionPlan(name="U", ffn_density=0.1), 1.0, None, 10)
    assert search([*CANDIDATES, unknown], Hints(max_quality_loss=50)).plan.name == "E"
    assert search([*CANDIDATES, unknown], Hints(max_latency_ms=5)).plan.name == "U"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_latency_ms": 0}, "max_latency_ms"),
        ({"max_latency_ms": math.inf}, "max_latency_ms"),
        ({"max_latency_ms": "fast"}, "max_latency_ms"),
        ({"max_quality_loss": -1}, "max_quality_loss"),
        ({"max_quality_loss": True}, "max_quality_loss"),
        ({"quality": "best"}, "quality must be one of max, balanced, fast"),
        ({"max_kv_bytes": 0}, "max_kv_bytes"),
        ({"max_kv_bytes": 1.5}, "max_kv_bytes"),
        ({"plan": "dense"}, "ExecutionPlan"),
        ({"plan": ExecutionPlan(skip_layers=(0,)), "skip_layers": (1,)}, "not both"),
    ],
)
def test_bad_hints_are_validation_errors(kwargs, match):
    with pytest.raises(ValidationError, match=match):
        Hints(**kwargs)


def test_ffn_read_fraction_counts_the_kept_rows():
    # gate and up keep 90% of their input rows, down 70% of its rows: a decode step's row
    # kernel reads only those, however many (no dense fallback below 16 tokens)
    assert ffn_read_fraction(0.1, 0.3) == pytest.approx((2 * 0.9 + 0.7) / 3)
    assert ffn_read_fraction(0.0, 0.0) == 1.0


# --- candidates from a model ---------------------------------------------------------------

LEVELS = ((0.0, 0.0, 1.0), (0.0, 0.5, 1.05), (0.5, 0.7, 1.30))  # (in, mid, ppl ratio)
# [L=2, KVH=2] ablation ratios: (0, 1) and (1, 0) are each layer's least important group
HEAD_SCORES = torch.tensor([[1.20, 1.02], [1.01, 1.50]])
COEFFICIENTS = synthetic_coefficients(mb_ms=2.0)


def planner_artifact(model):
    from zcode.sparsity.artifact import FFNLevel
    from zcode.sparsity.calibrate import flops_skipped

    levels = [FFNLevel(i, m, flops_skipped(i, m), ratio) for i, m, ratio in LEVELS]
    return synthetic_artifact(model, levels, 0.0, 0.0, HEAD_SCORES)


@pytest.fixture(scope="module")
def tiny_net(tiny_model):
    net, _ = tiny_model("llama")
    return net


def test_candidates_predict_ms_loss_and_kv_bytes(tiny_net):
    planner = Planner(
        tiny_net, synthetic_cost_model(mb_ms=2.0), None, planner_artifact(tiny_net), True
    )
    mlp_mb = sum(p.nbytes for layer in tiny_net.model.layers for p in layer.mlp.parameters()) / 1e6
    linear_mb = (
        sum(m.weight.nbytes for m in tiny_net.modules() if isinstance(m, torch.nn.Linear)) / 1e6
    )
    # fp32 K and V of 16 dims per KV head: 128 bytes per token; 2 layers x 2 KV heads
    per_head = 2 * 16 * 4
    by_name = {c.plan.name: c for c in planner.candidates()}
    assert len(by_name) == 3 * 3  # FFN levels x (no skip, 1 group, 2 groups)

    mid = by_name["ffn in 0 / mid 0.5"]
    read = (2 * 1.0 + 0.5) / 3  # gate/up dense, half of down
    assert mid.ms_per_token == pytest.approx(1.0 + 2.0 * (linear_mb - mlp_mb * (1 - read)))
    assert mid.quality_loss_pct == pytest.approx(5.0)
    assert mid.kv_bytes_per_token == 4 * per_head

    both = by_name["ffn in 0.5 / mid 0.7, skip 2 KV heads"]
    assert both.plan.skip_kv_heads == ((0, 1), (1, 0))
    assert both.quality_loss_pct == pytest.approx(100 * (1.30 * 1.02 * 1.01 - 1))
    assert both.kv_bytes_per_token == 2 * per_head
    one = by_name["ffn in 0 / mid 0, skip 1 KV heads"]
    assert one.plan.skip_kv_heads == ((1, 0),)  # the least important group
    assert one.quality_loss_pct == pytest.approx(1.0)

    dense_ms = 1.0 + 2.0 * linear_mb
    choice = planner.choose(Hints(max_latency_ms=dense_ms - 1e-6))
    assert choice.plan.name == "ffn in 0 / mid 0.5" and choice.binding == "latency"
    # at most 3 heads' KV: skip the one group costing 1%
    choice = planner.choose(Hints(max_kv_bytes=3 * per_head))
    assert choice.plan.name == "ffn in 0 / mid 0, skip 1 KV heads"
    assert choice.binding == "memory" and choice.target_met
    # within 6%: mid 0.5 (5%) is the fastest; with the 1% group skipped too it would cost 6.05%
    choice = planner.choose(Hints(max_quality_loss=6.0))
    assert choice.plan.name == "ffn in 0 / mid 0.5" and choice.binding == "quality"


def test_ffn_levels_on_int8_rows_are_candidates_at_their_measured_loss(tiny_net):
    """Levels calibrated on int8 rows too: each is a candidate at the loss calibration measured
    for it (not a sum), priced at the int8 format's bytes; a latency target only int8 rows meet
    takes the least lossy of them."""
    from zcode.hardware.cost_model import format_weight_bytes

    artifact = planner_artifact(tiny_net)
    int8_ratios = [1.01, 1.2, 1.5]  # dense, (0, 0.5), (0.5, 0.7)
    artifact.levels = [
        replace(lv, weight_ppl_ratios={"int8": r}) for lv, r in zip(artifact.levels, int8_ratios)
    ]
    planner = Planner(tiny_net, synthetic_cost_model(mb_ms=2.0), None, artifact)
    by_name = {c.plan.name: c for c in planner.candidates()}
    assert len(by_name) == 3 * 2
    dense_int8 = by_name["ffn in 0 / mid 0, int8 rows"]
    assert dict(dense_int8.plan.extras)["ffn_weights"] == "int8"
    assert dense_int8.quality_loss_pct == pytest.approx(1.0)
    assert by_name["ffn in 0.5 / mid 0.7, int8 rows"].quality_loss_pct == pytest.approx(50.0)
    linears = {n: m for n, m in tiny_net.named_modules() if isinstance(m, torch.nn.Linear)}
    ffn = [m for n, m in linears.items() if ".mlp." in n]
    assert ffn
    saved_mb = sum(m.weight.nbytes - format_weight_bytes(*m.weight.shape, "int8") for m in ffn)
    dense = by_name["ffn in 0 / mid 0"]
    assert dense.ms_per_token - dense_int8.ms_per_token == pytest.approx(2.0 * saved_mb / 1e6)
    fp32_fastest = by_name["ffn in 0.5 / mid 0.7"].ms_per_token
    choice = planner.choose(Hints(max_latency_ms=min(fp32_fastest, dense_int8.ms_per_token) - 1e-6))
    assert choice.plan.name == "ffn in 0 / mid 0.5, int8 rows"  # 20% over 50%


def test_a_latency_scale_multiplies_the_predictions_a_target_is_checked_against(tiny_net):
    """Measured twice the predictions (LatencyFeedback's scale 2): a target the dense plan
    meets at 1x needs the sparse plan; the report says the scaled prediction and the scale; an
    explicit plan keeps the cost model's own prediction."""
    planner = Planner(
        tiny_net, synthetic_cost_model(mb_ms=2.0), None, planner_artifact(tiny_net), True
    )
    by_name = {c.plan.name: c for c in planner.candidates()}
    dense, mid = by_name["ffn in 0 / mid 0"], by_name["ffn in 0 / mid 0.5"]
    target = 2 * (dense.ms_per_token + mid.ms_per_token) / 2  # between 2 x mid and 2 x dense
    assert planner.choose(Hints(max_latency_ms=target)).plan.name == dense.plan.name
    choice = planner.choose(Hints(max_latency_ms=target), latency_scale=2.0)
    assert choice.plan.name == mid.plan.name and choice.binding == "latency"
    assert choice.predicted_ms_per_token == pytest.approx(2 * mid.ms_per_token)
    assert choice.latency_scale == 2.0
    explicit = planner.choose(Hints(plan=dense.plan), latency_scale=2.0)
    assert explicit.predicted_ms_per_token == pytest.approx(dense.ms_per_token)
    assert explicit.latency_scale == 1.0


def test_latency_feedback_is_the_median_measured_over_predicted_ratio():
    from zcode.harness.report import LatencyFeedback, PlanReport

    def report(predicted, measured, scale=1.0):
        return PlanReport("p", "s", predicted, measured, latency_scale=scale)

    feedback = LatencyFeedback(window=3)
    assert feedback.scale() == 1.0  # nothing measured yet
    feedback.record(report(10.0, None))  # no decode step: nothing to learn
    feedback.record(report(None, 12.0))  # no cost model
    assert feedback.scale() == 1.0
    feedback.record(report(10.0, 12.0))
    feedback.record(report(20.0, 30.0, scale=1.25))  # planned at 1.25: the model said 16
    assert feedback.scale() == pytest.approx((1.2 + 30 / 16) / 2)
    feedback.record(report(10.0, 13.0))
    assert feedback.scale() == pytest.approx(1.3)  # the median of 1.2, 1.875, 1.3
    for _ in range(3):  # the window keeps the latest 3
        feedback.record(report(10.0, 100.0))
    assert feedback.scale() == LatencyFeedback.MAX_SCALE
    for _ in range(3):
        feedback.record(report(10.0, 1.0))
    assert feedback.scale() == LatencyFeedback.MIN_SCALE


def test_explicit_plans_and_skips(tiny_net):
    planner = Planner(
        tiny_net, synthetic_cost_model(mb_ms=2.0), None, planner_artifact(tiny_net), True
    )
    sparse = next(c.plan for c in planner.candidates() if c.plan.name == "ffn in 0.5 / mid 0.7")
    choice = planner.choose(Hints(plan=sparse, max_quality_loss=1.0))
    assert choice.plan == sparse and choice.binding == "override" and not choice.target_met
    with pytest.raises(ValidationError, match="not one this model can run"):
        planner.choose(Hints(plan=ExecutionPlan(precision=(("lm_head", "int8"),))))
    # a skipped layer has no calibrated loss: a quality budget cannot be met with it
    choice = planner.choose(Hints(skip_layers=(1,), max_quality_loss=50.0))
    assert choice.plan.skip_layers == (1,) and choice.predicted_quality_loss_pct is None
    assert not choice.target_met
    choice = planner.choose(Hints(skip_kv_heads=((0, 1),), max_quality_loss=4.0))
    assert choice.plan.skip_kv_heads == ((0, 1),) and choice.target_met
    assert choice.predicted_quality_loss_pct == pytest.approx(2.0)


def test_kv_groups_skipped_together_cost_what_calibration_measured_together(tiny_net):
    """Single ablations of the two least important groups sum to 3.02%; calibration measured
    them together at 10%: the candidate, and a caller naming the same set, predict 10%."""
    artifact = planner_artifact(tiny_net)
    artifact.head_count_ratios = {1: 1.01, 2: 1.10}
    planner = Planner(tiny_net, synthetic_cost_model(mb_ms=2.0), None, artifact, True)
    by_name = {c.plan.name: c for c in planner.candidates()}
    assert by_name["ffn in 0 / mid 0, skip 2 KV heads"].quality_loss_pct == pytest.approx(10.0)
    assert by_name["ffn in 0 / mid 0, skip 1 KV heads"].quality_loss_pct == pytest.approx(1.0)
    choice = planner.choose(Hints(skip_kv_heads=((1, 0), (0, 1)), max_quality_loss=5.0))
    assert choice.predicted_quality_loss_pct == pytest.approx(10.0) and not choice.target_met
    # a set calibration did not measure together: its single ablations, summed
    choice = planner.choose(Hints(skip_kv_heads=((0, 1),)))
    assert choice.predicted_quality_loss_pct == pytest.approx(2.0)


def test_latency_needs_a_cost_model(tiny_net):
    planner = Planner(tiny_net, None, None, planner_artifact(tiny_net))
    with pytest.raises(ValidationError, match="zcode hw --fit-cost"):
        planner.choose(Hints(max_latency_ms=10))
    assert planner.choose(Hints(max_quality_loss=10)).predicted_ms_per_token is None


def test_speculation_meets_a_latency_target_without_a_loss(tiny_net):
    """With free drafts (n-gram) and a step whose ms does not grow with its tokens, k drafts at
    acceptance a make a token cost 1 / (1 + a + ... + a^k) of a step: the dense plan then meets
    a target that alone it misses, where the plain planner must cut FFN rows (5% loss). Where a
    verified token costs more than it saves (compute-bound), or nothing is accepted, no drafts
    are predicted and the plan keeps its plain ms; a plan with num_draft_tokens=0 never drafts.
    The acceptance is read at each choice (the engine's so far)."""
    from zcode.hardware.cost_model import CostModel
    from zcode.harness.planner import Speculation
    from zcode.spec.policy import DraftPolicy

    artifact = planner_artifact(tiny_net)
    acceptance = [0.8]

    def planner(cost):
        spec = Speculation(DraftPolicy(cost, tiny_net, None), 3, lambda: acceptance[0])
        return Planner(tiny_net, cost, None, artifact, True, speculation=spec)

    cost = synthetic_cost_model(mb_ms=2.0)
    linear_mb = sum(m.weight.nbytes for m in tiny_net.modules() if isinstance(m, torch.nn.Linear))
    dense_ms = 1.0 + 2.0 * linear_mb / 1e6
    target = Hints(max_latency_ms=dense_ms - 1e-6)
    assert (
        Planner(tiny_net, cost, None, artifact, True).choose(target).plan.name != "ffn in 0 / mid 0"
    )
    choice = planner(cost).choose(target)
    assert choice.plan.name == "ffn in 0 / mid 0" and choice.target_met
    assert choice.predicted_quality_loss_pct == 0.0
    assert choice.predicted_ms_per_token == pytest.approx(dense_ms / (1 + 0.8 + 0.64 + 0.512))
    assert (choice.speculation.num_draft_tokens, choice.speculation.acceptance) == (3, 0.8)

    dense = choice.plan
    off = planner(cost).choose(Hints(plan=replace(dense, num_draft_tokens=0)))
    assert off.predicted_ms_per_token == pytest.approx(dense_ms)
    assert off.speculation.num_draft_tokens == 0 and off.plan.num_draft_tokens == 0
    two = planner(cost).choose(Hints(plan=replace(dense, num_draft_tokens=2)))
    assert two.predicted_ms_per_token == pytest.approx(dense_ms / (1 + 0.8 + 0.64))

    gflop_ms = {"dense-float32:GFLOP": 1e6, "sparse-float32:GFLOP": 1e6}
    compute_bound = CostModel(COEFFICIENTS | gflop_ms, COEFFICIENTS, "test")
    choice = planner(compute_bound).choose(Hints(max_latency_ms=1e9), batch_size=16)
    assert choice.speculation.num_draft_tokens == 0 and choice.speculation.gain == 1.0
    acceptance[0] = 0.0
    assert planner(cost).choose(target).speculation.num_draft_tokens == 0
