"""Per-request plans in one batch (issue 17, phase 2): requests with different plans share each
engine step, one forward per precision (FFN levels are per token, skips per row), and each gets
exactly the tokens it gets running alone with its plan, for every dimension that is model state
(FFN sparsity levels, precision levels) and with per-request skipped layers and KV heads among
them; compiled decode gives eager's tokens for every plan of a mixed sequence of requests."""

import dataclasses

import pytest
from artifacts import synthetic_artifact

from zcode.errors import ValidationError
from zcode.harness.plan import ExecutionPlan
from zcode.llm import LLM
from zcode.quant.sensitivity import profile_sensitivity
from zcode.quant.variants import attach_variants
from zcode.sampling_params import SamplingParams
from zcode.sparsity.artifact import FFNLevel, SparsityArtifact

PROMPTS = [[5, 17, 200, 3, 99, 42, 7], [7, 130, 250, 11, 64], [8, 190, 33, 2, 9, 120], [77, 150]]
CALIBRATION = [9, 120, 77, 150, 31, 4, 88, 210, 16, 23, 140, 61, 5, 240, 12, 70, 101, 44, 3, 199]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
# Enough for these prompts; with the default 1 GiB each, 4.45 GB more stayed resident in the
# suite's process after this module (what holds it is not found yet).
KV_CACHE_BYTES = 4 << 20
SPARSITIES = (0.0, 0.25, 0.5)  # FFN levels: down inputs below 0, 0.02, 0.05 in magnitude skipped


def _artifact(model) -> SparsityArtifact:
    levels = [
        FFNLevel(0.0, s, s / 3, 1 + s / 10, weight_ppl_ratios={"int8": 1.01 + s / 10})
        for s in SPARSITIES
    ]
    return synthetic_artifact(model, levels, thresh_mid=[-1.0, 0.02, 0.05])


def _with_skips(plan: ExecutionPlan) -> ExecutionPlan:
    return dataclasses.replace(plan, skip_layers=(1,), skip_kv_heads=((0, 1),))


def _ffn_llm(path, **engine_args) -> LLM:
    engine_args.setdefault("kv_cache_bytes", KV_CACHE_BYTES)
    llm = LLM(path, dtype="float32", per_request_depth=True, **engine_args)
    llm.sparsity = _artifact(llm.model)
    llm.declare_default_plan()
    return llm


def _ffn_level_plans(llm, rows: str) -> list[ExecutionPlan]:
    """The plans of the three FFN levels reading `rows` (fp32, int8), at full depth."""
    plans = {}
    for c in llm.planner().candidates():
        extras = dict(c.plan.extras)
        if extras.get("ffn_weights", "fp32") == rows and not c.plan.skip_kv_heads:
            plans[extras["ffn_sparsity_mid"]] = c.plan
    return [plans[f"{s:g}"] for s in SPARSITIES]


def _ffn_plans(llm) -> list[ExecutionPlan]:
    """The three FFN levels, and the dense one with a skipped layer and KV head."""
    dense, quarter, half = _ffn_level_plans(llm, "fp32")
    return [dense, half, quarter, _with_skips(dense)]


def _ffn_rows_plans(llm) -> list[ExecutionPlan]:
    """FFN levels on fp32 and on int8 rows, the dense level on both: two forwards a step (the
    rows are model state)."""
    dense, quarter, _ = _ffn_level_plans(llm, "fp32")
    dense_int8, _, half_int8 = _ffn_level_plans(llm, "int8")
    return [dense, half_int8, quarter, dense_int8]


def _precision_plans(llm) -> list[ExecutionPlan]:
    """The three precision levels, and the default one with a skipped layer and KV head."""
    levels = llm.precision_variants.levels
    default = llm.executor().default
    return [levels["max"].plan, levels["fast"].plan, levels["balanced"].plan, _with_skips(default)]


@pytest.fixture(scope="module")
def ffn(tiny_checkpoint):
    return _ffn_llm(tiny_checkpoint("llama").path)


@pytest.fixture(scope="module")
def precision(tiny_checkpoint):
    llm = LLM(
        tiny_checkpoint("llama").path,
        dtype="float32",
        per_request_depth=True,
        kv_cache_bytes=KV_CACHE_BYTES,
    )
    profile = profile_sensitivity(
        llm.model, CALIBRATION, ("int8", "int4-g64"), "reference", progress=False
    )
    attach_variants(llm, profile, "6bits", "1MB", kernel="reference")
    return llm


def _alone(llm, plans) -> list[list[int]]:
    return [llm.generate(p, GREEDY, plan=plan)[0].token_ids for p, plan in zip(PROMPTS, plans)]


@pytest.mark.parametrize("kind", ["ffn", "ffn-rows", "precision"])
def test_a_batch_of_four_plans_gives_each_request_its_own_tokens(kind, request):
    llm = request.getfixturevalue("precision" if kind == "precision" else "ffn")
    plans = {"ffn": _ffn_plans, "ffn-rows": _ffn_rows_plans, "precision": _precision_plans}[kind](
        llm
    )
    assert len({p.signature() for p in plans}) == 4
    alone = _alone(llm, plans)
    batched = llm.generate(PROMPTS, GREEDY, plan=plans)
    assert [out.token_ids for out in batched] == alone
    assert [out.plan.signature for out in batched] == [p.signature() for p in plans]
    # Each plan computes differently: on one prompt, every plan's first log-probs differ from
    # the others' (so the batch above is not equal by running one plan for all).
    params = dataclasses.replace(GREEDY, max_tokens=1, logprobs=0)
    firsts = [out.logprobs[0] for out in llm.generate([PROMPTS[0]] * 4, params, plan=plans)]
    assert all(firsts[i] != firsts[j] for i in range(4) for j in range(i))


def test_requests_at_different_ffn_levels_share_each_forward(ffn, monkeypatch):
    """FFN levels are per token (a threshold per token in each sparse FFN): the four FFN plans,
    one precision, run every step in one forward of all four rows."""
    rows_per_forward = []
    execute = ffn.engine.runner.execute

    def counting(scheduled, row_settings=None):
        rows_per_forward.append(len(scheduled))
        return execute(scheduled, row_settings)

    monkeypatch.setattr(ffn.engine.runner, "execute", counting)
    ffn.generate(PROMPTS, GREEDY, plan=_ffn_plans(ffn))
    assert rows_per_forward == [4] * GREEDY.max_tokens


def test_per_prompt_hints_are_one_per_prompt(ffn):
    with pytest.raises(ValidationError, match="2 values for 4 prompts"):
        ffn.generate(PROMPTS, GREEDY, plan=_ffn_plans(ffn)[:2])
    with pytest.raises(ValidationError, match="must be an ExecutionPlan"):
        ffn.engine.add_request(PROMPTS[0], GREEDY, plan="fast")
    unknown = ExecutionPlan(extras=(("ffn_sparsity_in", "0"), ("ffn_sparsity_mid", "0.7")))
    with pytest.raises(ValidationError, match="not one this model can run"):
        ffn.generate(PROMPTS, GREEDY, plan=[None, None, None, unknown])
    assert not ffn.engine.has_unfinished()  # all or none


@pytest.mark.parametrize(
    "make_plans",
    # whole-model FFN levels compile a graph per level (~40 s on 2 cores): `make test-slow`
    [pytest.param(_ffn_plans, marks=pytest.mark.slow), _ffn_rows_plans],
)
def test_compiled_decode_follows_every_plan_of_a_mixed_sequence(tiny_checkpoint, ffn, make_plans):
    """Requests one after another, each plan in turn, then all together: a compiled engine gives
    eager's tokens for every one (no cached graph runs another plan's model state: FFN levels,
    the rows the FFNs read)."""
    compiled = _ffn_llm(tiny_checkpoint("llama").path, compile=True)
    plans = make_plans(compiled)
    want = _alone(ffn, make_plans(ffn))
    for i in [0, 2, 1, 2, 3, 0, 1]:
        (out,) = compiled.generate(PROMPTS[i], GREEDY, plan=plans[i])
        assert out.token_ids == want[i], plans[i].name
    batched = compiled.generate(PROMPTS, GREEDY, plan=plans)
    assert [out.token_ids for out in batched] == want
    assert compiled.engine.runner.num_graph_compiles > 0


def test_a_plan_that_quantizes_ffns_at_a_sparse_level_is_refused(precision, ffn):
    """The sparse FFN kernel reads its own rows (fp32, or int8 made from them): a precision
    level that swaps FFN linears cannot run at a sparse FFN level nor name the FFNs' rows (the
    planner never combines them; a plan given directly to the engine is refused the same way),
    while its dense level runs."""
    from zcode.harness.executor import PlanExecutor
    from zcode.harness.planner import quantizes_ffn

    # the levels of the same checkpoint (the float model's: the quantized one has no rows)
    executor = PlanExecutor(precision.engine, precision.precision_variants, _artifact(ffn.model))
    fast = precision.precision_variants.levels["fast"].plan
    assert quantizes_ffn(fast.precision)

    def at(mid: float, rows: tuple = ()) -> ExecutionPlan:
        extras = (("ffn_sparsity_in", "0"), ("ffn_sparsity_mid", f"{mid:g}"), *rows)
        return dataclasses.replace(fast, extras=tuple(sorted(extras)))

    with pytest.raises(ValidationError, match="quantizes FFN linears and names a sparse FFN"):
        executor.check(at(0.5))
    with pytest.raises(ValidationError, match="quantizes FFN linears and names a sparse FFN"):
        executor.check(at(0.0, (("ffn_weights", "int8"),)))
    executor.check(at(0.0))
