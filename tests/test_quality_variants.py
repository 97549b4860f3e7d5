"""Precision variants as the planner's precision levels: each level's plan runs, matches
transformers running the same dequantized weights, is reported, and is undone; quality presets
pick the fastest level within their budget; the memory cap holds; bad input is a
ValidationError."""

import copy
import dataclasses
import math

import pytest
import torch

from zcode.errors import ValidationError
from zcode.hardware.cost_model import CostModel
from zcode.harness.planner import QUALITY_BUDGETS_PCT
from zcode.llm import LLM
from zcode.quant.apply import UNCHANGED
from zcode.quant.linear import QuantizedLinear, quantize_weight
from zcode.quant.sensitivity import profile_sensitivity
from zcode.quant.variants import attach_variants, parse_memory_cap
from zcode.sampling_params import SamplingParams

PROMPT = [5, 17, 200, 3, 99, 42, 7, 7, 130, 250, 11, 64, 8, 190, 33, 2]
CALIBRATION = [9, 120, 77, 150, 31, 4, 88, 210, 16, 23, 140, 61, 5, 240, 12, 70, 101, 44, 3, 199]
BASE_FORMAT = "int4-g64"  # the coarsest format at K = 64: the variants have something to fix
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    checkpoint = tiny_checkpoint("llama")
    llm = LLM(checkpoint.path, dtype="float32")
    profile = profile_sensitivity(
        llm.model, CALIBRATION, formats=("int8", BASE_FORMAT), kernel="reference", progress=False
    )
    num_weights = sum(e["num_weights"] for e in profile["modules"].values())
    base_bytes = sum(e["formats"][BASE_FORMAT]["bytes"] for e in profile["modules"].values())
    assert 8 * base_bytes / num_weights < 8
    # Exactly uniform BASE_FORMAT's bytes: the base plan is that format everywhere.
    report = attach_variants(llm, profile, f"{base_bytes}B", "60kB", kernel="reference")
    # ms per MB alike for every kind: the faster level is the one reading fewer weight bytes
    kinds = ("dense-float32", "int8", "int4")
    coefficients = {f"{k}:{f}": float(f == "MB") for k in kinds for f in ("MB", "calls", "GFLOP")}
    coefficients |= {"step": 1.0, "seqs": 0.0, "kv:MB": 0.0, "attn:GFLOP": 0.0}
    llm.cost_model = CostModel(coefficients, {}, "test")
    return checkpoint, llm, profile, report


def level_plan(llm, quality: str):
    return llm.precision_variants.levels[quality].plan


def oracle_logprobs(oracle, unit_formats: dict, profile: dict, token_ids: list[int]):
    """transformers on the dequantized weights of a plan: [T, V] log-probs."""
    model = copy.deepcopy(oracle)
    for unit, fmt in unit_formats.items():
        for name in profile["modules"][unit]["members"]:
            linear = model.get_submodule(name)
            if fmt != UNCHANGED:
                weight = quantize_weight(linear.weight, fmt).dequantize()
                linear.weight = torch.nn.Parameter(weight)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), -1)


def test_each_quality_runs_its_plan_as_transformers_does(tiny):
    checkpoint, llm, profile, _ = tiny
    variants = llm.precision_variants
    assert variants.variant_units, "the cap should hold some unit's variants"
    assert variants.memory_bytes <= variants.memory_cap_bytes
    base = {u: BASE_FORMAT for u in profile["modules"]}
    formats = {"fast": None, "balanced": "int8", "max": UNCHANGED}
    outputs = {}
    for quality, fmt in formats.items():
        (out,) = llm.generate(PROMPT, PARAMS, plan=level_plan(llm, quality))
        outputs[quality] = out
        assert out.plan.binding == "override"
        assert out.plan.plan.startswith(f"quality={quality}")
        unit_formats = {**base, **{u: fmt for u in variants.variant_units if fmt is not None}}
        expected = oracle_logprobs(checkpoint.oracle, unit_formats, profile, PROMPT + out.token_ids)
        for i, token in enumerate(out.token_ids):
            step = expected[len(PROMPT) - 1 + i]
            assert token == int(step.argmax()), (quality, i)
            assert out.logprobs[i][token] == pytest.approx(step[token].item(), abs=1e-3)
    signatures = {out.plan.signature for out in outputs.values()}
    assert len(signatures) == 3  # three different plans ran
    # The variants change what the model computes, and the predictions say "max" loses least.
    assert outputs["max"].logprobs != outputs["fast"].logprobs
    loss = {q: out.plan.predicted_quality_loss_pct for q, out in outputs.items()}
    assert loss["max"] < loss["fast"]
    kl = llm.precision_variants.levels["fast"].predicted_kl
    assert loss["fast"] == pytest.approx(100 * math.expm1(kl))


@pytest.mark.parametrize("quality", ["max", "balanced", "fast"])
def test_a_quality_preset_runs_the_fastest_level_within_its_budget(tiny, quality):
    _, llm, _, _ = tiny
    levels = llm.precision_variants.levels
    loss_pct = {q: 100 * math.expm1(lv.predicted_kl) for q, lv in levels.items()}
    within = [q for q in levels if loss_pct[q] <= QUALITY_BUDGETS_PCT[quality]]
    (out,) = llm.generate(PROMPT, PARAMS, quality=quality)
    if within:  # fewer weight bytes: faster under the test's cost model
        expected = min(within, key=lambda q: levels[q].weight_bytes)
        assert out.plan.target_met
    else:  # nothing within the budget: the level that loses least, and the report says so
        expected = min(levels, key=lambda q: loss_pct[q])
        assert not out.plan.target_met and out.plan.binding == "quality"
    assert out.plan.plan.startswith(f"quality={expected}:")
    (want,) = llm.generate(PROMPT, PARAMS, plan=level_plan(llm, expected))
    assert out.token_ids == want.token_ids


def test_base_plan_and_prefix_cache_come_back(tiny):
    _, llm, _, report = tiny
    (before,) = llm.generate(PROMPT, PARAMS)
    llm.generate(PROMPT, PARAMS, plan=level_plan(llm, "max"))
    (after,) = llm.generate(PROMPT, PARAMS)
    # A "max" run neither left its modules in nor published KV the base plan then reused.
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs
    assert llm.engine.runner.plan.name == report["plan"]
    for name in llm.precision_variants.variant_units:
        assert isinstance(llm.model.get_submodule(name), QuantizedLinear)
    assert llm.engine.block_manager.enable_prefix_caching


def test_a_variant_shares_prefix_blocks_with_its_own_requests_only(tiny):
    _, llm, _, _ = tiny
    prompt = list(range(3, 3 + 2 * llm.engine.config.block_size + 1))
    stats = llm.engine.stats

    def hits_of(quality: str | None) -> int:
        before = stats()["prefix_cache_hits"]
        llm.generate(prompt, PARAMS, plan=level_plan(llm, quality) if quality else None)
        return stats()["prefix_cache_hits"] - before

    blocks = 2 * llm.engine.config.block_size
    assert hits_of(None) == 0 and hits_of("max") == 0
    assert hits_of("max") == blocks and hits_of(None) == blocks and hits_of("balanced") == 0


def test_bad_quality_requests(tiny):
    _, llm, _, _ = tiny
    with pytest.raises(ValidationError, match="quality must be one of"):
        llm.generate(PROMPT, PARAMS, quality="best")
    with pytest.raises(ValidationError, match="none of the model's precision variants"):
        llm.executor().apply(dataclasses.replace(level_plan(llm, "max"), precision=()))
    with pytest.raises(ValidationError, match="memory cap"):
        parse_memory_cap("4.5bits")


def test_without_variants_quality_runs_the_model_as_loaded(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("llama").path, dtype="float32")
    (plain,) = llm.generate(PROMPT, PARAMS)
    (out,) = llm.generate(PROMPT, PARAMS, quality="max")
    assert out.token_ids == plain.token_ids and out.plan.plan == "as loaded"
    assert out.plan.predicted_quality_loss_pct == 0.0 and out.plan.target_met


def test_cap_too_small_for_any_variant(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("llama").path, dtype="float32")
    profile = profile_sensitivity(
        llm.model, CALIBRATION, formats=("int8", BASE_FORMAT), kernel="reference", progress=False
    )
    with pytest.raises(ValidationError, match="holds no unit"):
        attach_variants(llm, profile, "4.5bits", "1B")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--budget", "4.5bits"], "add --sparsity"),
        (["--quality", "max", "--sparsity", "/nonexistent.pt", "--budget", "4.5bits"], "no such"),
        (["--quality", "max", "--sparsity", "p", "--budget", "4.5bits", "--stream"], "--stream"),
    ],
)
def test_cli_quality_errors_before_loading(argv, message, capsys):
    from zcode import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "Hi", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
