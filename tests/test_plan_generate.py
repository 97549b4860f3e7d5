"""generate() with planning hints on a tiny llama calibrated for real (zcode calibrate on random
token ids): every combination of hints in one call, each request's tokens against the same plan
applied statically (modules swapped before the engine is built: another code path), reports, and
compiled decode following every plan change."""

import dataclasses
import itertools
import random

import pytest
from cost_models import synthetic_cost_model

from zcode.engine.request_output import RequestOutput
from zcode.harness.plan import ExecutionPlan
from zcode.harness.planner import Hints
from zcode.harness.report import PlanReport
from zcode.llm import LLM
from zcode.sampling_params import SamplingParams
from zcode.sparsity.calibrate import calibrate

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
PROMPT = [5, 17, 200, 3, 99, 42, 7, 7, 130, 250, 11]
LEVELS = ((0.0, 0.0), (0.0, 0.5), (0.3, 0.5), (0.5, 0.7))


def cost_model():
    return synthetic_cost_model(mb_ms=20.0)


@pytest.fixture(scope="module")
def artifact(tiny_checkpoint):
    """A real calibration of the tiny llama on random token ids."""
    llm = LLM(tiny_checkpoint("llama").path, dtype="float32")
    rng = random.Random(0)
    tokens = [rng.randrange(3, 256) for _ in range(384 + 128)]
    return calibrate(
        llm, num_tokens=384, num_eval_tokens=128, levels=LEVELS, progress=False, tokens=tokens
    )


def planned_llm(path, artifact, **engine_args) -> LLM:
    llm = LLM(path, dtype="float32", kv_cache_bytes=1 << 20, **engine_args)
    llm.sparsity, llm.cost_model = artifact, cost_model()
    llm.declare_default_plan()
    return llm


@pytest.fixture(scope="module")
def paged(tiny_checkpoint, artifact):
    return planned_llm(tiny_checkpoint("llama").path, artifact, per_request_depth=True)


def static_tokens(path, artifact, plan: ExecutionPlan) -> list[int]:
    """The oracle: the plan's FFN level (and rows), skipped layers and pruned KV groups swapped
    into the modules before the engine is built (zcode.sparsity.apply), no planner or
    executor."""
    from zcode.sparsity.apply import apply_to_llm

    llm = LLM(path, dtype="float32", kv_cache_bytes=1 << 20)
    extras = dict(plan.extras)
    static = ExecutionPlan(
        skip_layers=plan.skip_layers,
        extras=(
            ("drop_heads", ",".join(f"{i}:{g}" for i, g in plan.skip_kv_heads)),
            ("ffn_sparsity_in", extras["ffn_sparsity_in"]),
            ("ffn_sparsity_mid", extras["ffn_sparsity_mid"]),
            ("ffn_weights", extras.get("ffn_weights", "fp32")),
        ),
    )
    apply_to_llm(llm, artifact, static)
    return llm.generate(PROMPT, GREEDY)[0].token_ids


def hint_values(llm: LLM) -> dict:
    planner = llm.planner()
    candidates = planner.candidates()
    dense_ms = max(c.ms_per_token for c in candidates)
    sparse = next(c.plan for c in candidates if c.plan.ffn_density < 1 and not c.plan.skip_kv_heads)
    kv_all = max(c.kv_bytes_per_token for c in candidates)
    return {
        "max_latency_ms": dense_ms - 1e-6,  # some sparse FFN level must run
        "max_quality_loss": 30.0,
        "quality": "balanced",
        "max_kv_bytes": kv_all - 1,  # some KV head must go
        "plan": sparse,
        "skip_layers": [1],
    }


COMBINATIONS = [
    combo
    for n in range(1, 7)
    for combo in itertools.combinations(
        ["max_latency_ms", "max_quality_loss", "quality", "max_kv_bytes", "plan", "skip_layers"], n
    )
]


def test_every_combination_of_hints_runs_its_plan(paged, tiny_checkpoint, artifact):
    values = hint_values(paged)
    planner = paged.planner()
    oracle: dict[str, list[int]] = {}
    for combo in COMBINATIONS:
        kwargs = {name: values[name] for name in combo}
        (out,) = paged.generate(PROMPT, GREEDY, **kwargs)
        report = out.plan
        assert isinstance(report, PlanReport), combo
        hints = Hints(**{**kwargs, "skip_layers": tuple(kwargs.get("skip_layers", ()))})
        choice = planner.choose(hints, batch_size=1, context_len=16)  # len(PROMPT) + 2.5, up
        assert report.signature == choice.plan.signature(), combo
        assert report.binding == ("override" if "plan" in combo else choice.binding), combo
        met = all(
            value is not None and value <= limit
            for value, limit in (
                (report.predicted_ms_per_token, kwargs.get("max_latency_ms")),
                (report.predicted_quality_loss_pct, hints.quality_budget_pct),
                (report.kv_bytes_per_token, kwargs.get("max_kv_bytes")),
            )
            if limit is not None
        )
        assert report.target_met == met, combo
        assert report.measured_ms_per_token > 0
        if "skip_layers" in combo:
            assert choice.plan.skip_layers == (1,)
        if report.signature not in oracle:
            path = tiny_checkpoint("llama").path
            oracle[report.signature] = static_tokens(path, artifact, choice.plan)
        assert out.token_ids == oracle[report.signature], combo
    assert len(oracle) >= 4  # the hints did choose different plans
    # the default plan is back: a request without hints runs as before any of them
    default = planner.choose(Hints()).plan
    if default.signature() not in oracle:
        path = tiny_checkpoint("llama").path
        oracle[default.signature()] = static_tokens(path, artifact, default)
    assert paged.generate(PROMPT, GREEDY)[0].token_ids == oracle[default.signature()]


def test_latency_feedback_scales_the_next_requests_predictions(tiny_checkpoint, artifact):
    """With latency feedback on, each planned request's measured over predicted ms is recorded
    (generate and the server's RequestPlans share the LLM's record), and the next request's
    plan is chosen and reported at that scale; an explicit plan keeps the cost model's own."""
    from zcode.harness.request_plans import RequestPlans

    llm = planned_llm(tiny_checkpoint("llama").path, artifact, latency_feedback=True)
    assert LLM(tiny_checkpoint("llama").path, kv_cache_bytes=1 << 20).latency_feedback is None
    target = max(c.ms_per_token for c in llm.planner().candidates())
    (first,) = llm.generate(PROMPT, GREEDY, max_latency_ms=target)
    assert first.plan.latency_scale == 1.0  # nothing measured before it
    ratio = first.plan.measured_ms_per_token / first.plan.predicted_ms_per_token
    assert list(llm.latency_feedback.ratios) == [pytest.approx(ratio)]
    scale = llm.latency_feedback.scale()
    (second,) = llm.generate(PROMPT, GREEDY, max_latency_ms=target)
    assert second.plan.latency_scale == pytest.approx(scale)
    chosen = llm.planner().choose(Hints(max_latency_ms=target), 1, 16, latency_scale=scale)
    assert second.plan.signature == chosen.plan.signature()
    assert second.plan.predicted_ms_per_token == pytest.approx(chosen.predicted_ms_per_token)
    assert len(llm.latency_feedback.ratios) == 2
    served = RequestPlans.for_llm(llm)
    assert served.feedback is llm.latency_feedback
    planned = served.plan(Hints(max_latency_ms=target))
    assert planned.choice.latency_scale == pytest.approx(llm.latency_feedback.scale())


def other_plan(llm: LLM) -> ExecutionPlan:
    """A plan whose KV differs from the default plan's."""
    planner = llm.planner()
    default = planner.default_plan().kv_signature()
    return next(c.plan for c in planner.candidates() if c.plan.kv_signature() != default)


def test_another_plans_kv_is_salted(paged):
    prompt = list(range(3, 40))  # full blocks to cache
    stats = paged.engine.stats
    dense = paged.generate(prompt, GREEDY)[0].token_ids
    hits = stats()["prefix_cache_hits"]
    other = paged.generate(prompt, GREEDY, plan=other_plan(paged))[0]
    assert stats()["prefix_cache_hits"] == hits  # the default plan's KV was not reused
    again = paged.generate(prompt, GREEDY, plan=other_plan(paged))[0]
    assert stats()["prefix_cache_hits"] > hits and again.token_ids == other.token_ids
    assert paged.generate(prompt, GREEDY)[0].token_ids == dense


def test_a_plan_runs_beside_running_requests_of_another(paged):
    """A request already running under the default plan and a generate call with another plan
    share the steps; each gets its own plan's tokens."""
    other = other_plan(paged)
    want_default = paged.generate(PROMPT, GREEDY)[0].token_ids
    want_other = paged.generate(PROMPT, GREEDY, plan=other)[0].token_ids
    assert want_other != want_default
    seq = paged.engine.add_request(PROMPT, GREEDY)
    paged.engine.step()  # it prefills alone
    (out,) = paged.generate(PROMPT, GREEDY, plan=other)
    assert out.token_ids == want_other
    assert seq.is_finished and seq.output_token_ids == want_default


def test_bad_hints_leave_no_request(paged):
    from zcode.errors import ValidationError

    for kwargs, match in (
        ({"max_latency_ms": -1}, "max_latency_ms"),
        ({"quality": "best"}, "quality"),
        ({"skip_layers": [9], "max_quality_loss": 1.0}, "out of range"),
        ({"plan": ExecutionPlan(precision=(("lm_head", "int8"),))}, "not one this model"),
    ):
        with pytest.raises(ValidationError, match=match):
            paged.generate(PROMPT, GREEDY, **kwargs)
    assert not paged.engine.has_unfinished()


def test_compiled_decode_follows_every_plan_change(tiny_checkpoint, artifact):
    """Before the executor, generate(max_latency_ms=) swapped sparse FFNs in without declaring a
    plan, and a compiled engine kept running its cached dense graph (tokens neither dense nor
    sparse) while the report named the sparse level."""
    path = tiny_checkpoint("llama").path
    eager, compiled = planned_llm(path, artifact), planned_llm(path, artifact, compile=True)
    values = hint_values(eager)
    by_level = {
        dict(c.plan.extras)["ffn_sparsity_mid"]: c.plan
        for c in eager.planner().candidates()
        if "ffn_weights" not in dict(c.plan.extras)  # the fp32 rows
    }
    dense, sparsest = by_level["0"], by_level["0.7"]
    sequence = [
        {},
        {"plan": sparsest},
        {"plan": dense},
        {"max_latency_ms": values["max_latency_ms"]},
        {},
        {"plan": sparsest},
        {"max_quality_loss": 0.0},
        {},
    ]
    outputs: list[tuple[RequestOutput, RequestOutput]] = []
    for kwargs in sequence:
        want, got = (llm.generate(PROMPT, GREEDY, **kwargs)[0] for llm in (eager, compiled))
        assert got.token_ids == want.token_ids, kwargs
        outputs.append((want, got))
    assert outputs[1][0].token_ids != outputs[2][0].token_ids  # the sparse level did differ
    assert compiled.engine.runner.num_graph_compiles > 0  # dense plans ran compiled
    assert outputs[-1][1].token_ids == outputs[0][1].token_ids


def test_calibration_profiles_precision_of_the_units_outside_the_leveled_ffns(artifact):
    """The one artifact holds the sensitivity profile precision levels are built from: each
    attention projection and the LM head in each format, not the FFNs (their precision is the
    sparse FFN's rows)."""
    from zcode.quant.sensitivity import DEFAULT_FORMATS

    profile = artifact.sensitivity
    attention = {f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"}
    assert set(profile["modules"]) == attention | {"lm_head"}
    assert all(set(e["formats"]) == set(DEFAULT_FORMATS) for e in profile["modules"].values())

    def total_kl(fmt: str) -> float:
        return sum(e["formats"][fmt]["kl"] for e in profile["modules"].values())

    assert total_kl("int4-g32") > total_kl("int8") > 0


def _precision_ffn_plans(llm: LLM) -> list[ExecutionPlan]:
    """Four plans, each a precision level at an FFN level: fast/dense, fast/sparse on int8 rows,
    balanced/sparse, max/sparse."""
    by_key = {}
    for c in llm.planner().candidates():
        extras = dict(c.plan.extras)
        level = c.plan.name.split(":")[0], extras["ffn_sparsity_mid"], extras.get("ffn_weights")
        by_key.setdefault(level, c.plan)
    keys = [
        ("quality=fast", "0", None),
        ("quality=fast", "0.5", "int8"),
        ("quality=balanced", "0.5", None),
        ("quality=max", "0.7", None),
    ]
    return [by_key[k] for k in keys]


def test_precision_levels_from_the_artifact_run_at_every_ffn_level(tiny_checkpoint, artifact):
    """--budget's precision levels (the artifact's profile) and FFN levels in one plan: in a
    mixed batch each request gets the tokens of its plan applied statically (attention
    quantized by apply_precision, FFN level swapped in; no planner or executor)."""
    from zcode.quant.apply import apply_precision
    from zcode.quant.variants import attach_variants
    from zcode.sparsity.apply import apply_to_llm

    path = tiny_checkpoint("llama").path
    llm = planned_llm(path, artifact)
    attach_variants(llm, artifact.sensitivity, "6bits", "1MB", kernel="reference")
    plans = _precision_ffn_plans(llm)
    assert all(p.precision for p in plans[:3]) and len({p.signature() for p in plans}) == 4
    prompts = [PROMPT, PROMPT[3:], PROMPT[:6], PROMPT[::-1]]
    batched = llm.generate(prompts, GREEDY, plan=plans)
    for prompt, plan, out in zip(prompts, plans, batched):
        static = LLM(path, dtype="float32", kv_cache_bytes=1 << 20)
        apply_to_llm(static, artifact, ExecutionPlan(extras=plan.extras))
        apply_precision(static.model, dict(plan.precision), kernel="reference")
        assert out.token_ids == static.generate(prompt, GREEDY)[0].token_ids, plan.name
    # Each plan computes differently (so the batch above is not equal by running one plan)
    params = dataclasses.replace(GREEDY, max_tokens=1, logprobs=0)
    firsts = [out.logprobs[0] for out in llm.generate([PROMPT] * 4, params, plan=plans)]
    assert all(firsts[i] != firsts[j] for i in range(4) for j in range(i))


def test_precision_levels_attach_when_the_default_ffn_level_is_dense(
    tiny_checkpoint, artifact, tmp_path
):
    """Loaded with an artifact whose default FFN level is dense, the FFNs are still the dense
    modules: attaching precision levels leaves them to the FFN dimension (as the profile does)."""
    from zcode.quant.variants import attach_variants

    levels = [
        dataclasses.replace(lv, ppl_ratio=1.5) if lv.flops_skipped else lv for lv in artifact.levels
    ]
    dataclasses.replace(artifact, levels=levels).save(tmp_path / "dense.pt")
    llm = LLM(tiny_checkpoint("llama").path, sparsity=tmp_path / "dense.pt", kv_cache_bytes=1 << 20)
    llm.cost_model = cost_model()
    assert llm.executor().default.ffn_density == 1
    attach_variants(llm, artifact.sensitivity, "6bits", "1MB", kernel="reference")
    assert any(c.plan.precision and c.plan.ffn_density < 1 for c in llm.planner().candidates())


def test_zcode_plan_prints_the_choice(tiny_checkpoint, artifact, tmp_path, capsys, monkeypatch):
    import json

    from zcode import cli
    from zcode.hardware.cost_model import CostModel

    path = tmp_path / "artifact.pt"
    artifact.save(path)
    model = str(tiny_checkpoint("llama").path)
    argv = ["plan", model, "--sparsity", str(path), "--per-request-depth", "--json"]
    load = cli.options.load_llm  # each load's KV cache 1 MiB, not the default 1 GiB
    monkeypatch.setattr(
        cli.options, "load_llm", lambda *a, **k: load(*a, **k, kv_cache_bytes=1 << 20)
    )
    monkeypatch.setattr(CostModel, "cached", classmethod(lambda cls, info, cache_dir=None: None))
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--max-latency-ms", "5"])
    assert exit_info.value.code == 2 and "zcode hw --fit-cost" in capsys.readouterr().err
    # fp32 K and V of 16 dims per KV head (128 bytes a token), 2 layers x 2 KV heads: at most 3
    monkeypatch.setattr(
        CostModel, "cached", classmethod(lambda cls, info=None, cache_dir=None: cost_model())
    )
    hints = ["--max-quality-loss", "50", "--max-kv-bytes", str(3 * 128)]
    cli.main([*argv, *hints])
    row = json.loads(capsys.readouterr().out)
    assert row["kv_bytes_per_token"] <= 3 * 128 and row["target_met"]
    assert row["predicted_quality_loss_pct"] <= 50 and row["predicted_ms_per_token"] > 0
    assert "skip 1 KV heads" in row["plan"] or "skip 2 KV heads" in row["plan"]
    assert "speculation_gain" not in row
    # --budget: the artifact's precision levels searched with the rest
    cli.main([*argv, *hints, "--budget", "6bits", "--variant-cap", "1MB"])
    precise = json.loads(capsys.readouterr().out)
    assert precise["plan"].startswith("quality=") and precise["target_met"]
    # With drafts: the same plan, its ms per token over the predicted gain at the prior 0.5
    cli.main([*argv, *hints, "--speculative", "ngram"])
    drafting = json.loads(capsys.readouterr().out)
    assert drafting["plan"] == row["plan"] and drafting["speculation_acceptance"] == 0.5
    assert drafting["predicted_ms_per_token"] == pytest.approx(
        row["predicted_ms_per_token"] / drafting["speculation_gain"]
    )
