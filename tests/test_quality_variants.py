"""generate(quality=): the variant plan runs, matches transformers running the same dequantized
weights, is reported, and is undone; the memory cap holds; bad input is a ValidationError."""

import copy

import pytest
import torch

from zcode.errors import ValidationError
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
    return checkpoint, llm, profile, report


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
        (out,) = llm.generate(PROMPT, PARAMS, quality=quality)
        outputs[quality] = out
        assert out.plan["quality"] == quality
        assert out.plan["plan"].startswith(f"quality={quality}")
        unit_formats = {**base, **{u: fmt for u in variants.variant_units if fmt is not None}}
        expected = oracle_logprobs(checkpoint.oracle, unit_formats, profile, PROMPT + out.token_ids)
        for i, token in enumerate(out.token_ids):
            step = expected[len(PROMPT) - 1 + i]
            assert token == int(step.argmax()), (quality, i)
            assert out.logprobs[i][token] == pytest.approx(step[token].item(), abs=1e-3)
    signatures = {out.plan["signature"] for out in outputs.values()}
    assert len(signatures) == 3  # three different plans ran
    # The variants change what the model computes, and the predictions say "max" loses least.
    assert outputs["max"].logprobs != outputs["fast"].logprobs
    kl = {q: out.plan["predicted_kl"] for q, out in outputs.items()}
    assert kl["max"] < kl["fast"]


def test_base_plan_and_prefix_cache_come_back(tiny):
    _, llm, _, report = tiny
    (before,) = llm.generate(PROMPT, PARAMS)
    llm.generate(PROMPT, PARAMS, quality="max")
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
        llm.generate(prompt, PARAMS, quality=quality)
        return stats()["prefix_cache_hits"] - before

    blocks = 2 * llm.engine.config.block_size
    assert hits_of(None) == 0 and hits_of("max") == 0
    assert hits_of("max") == blocks and hits_of(None) == blocks and hits_of("balanced") == 0


def test_bad_quality_requests(tiny):
    _, llm, _, _ = tiny
    with pytest.raises(ValidationError, match="quality must be one of"):
        llm.generate(PROMPT, PARAMS, quality="best")
    with pytest.raises(ValidationError, match="not both"):
        llm.generate(PROMPT, PARAMS, quality="max", max_latency_ms=10)
    with pytest.raises(ValidationError, match="memory cap"):
        parse_memory_cap("4.5bits")


def test_quality_needs_variants(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("llama").path, dtype="float32")
    with pytest.raises(ValidationError, match="attach_variants"):
        llm.generate(PROMPT, PARAMS, quality="max")


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
        (["--quality", "max"], "needs --profile"),
        (["--quality", "max", "--profile", "/nonexistent.json", "--budget", "4.5bits"], "no such"),
        (["--quality", "max", "--profile", "p", "--budget", "4.5bits", "--stream"], "--stream"),
    ],
)
def test_cli_quality_errors_before_loading(argv, message, capsys):
    from zcode import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "Hi", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
