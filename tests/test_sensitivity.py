"""The sensitivity profiler: the replay shortcut against full reruns, and its KL against
transformers running the same dequantized weight."""

import copy

import pytest
import torch

from zcode.loader import load_model
from zcode.quant.linear import quantize_weight
from zcode.quant.sensitivity import layer_and_kind, profile_sensitivity, unit_of

TOKENS = [5, 17, 200, 3, 99, 42, 7, 7, 130, 250, 11, 64, 8, 190, 33, 2, 77, 150, 9, 120]
FORMATS = ("int8", "int4-g32", "w4a8")


@pytest.mark.parametrize(
    "name",
    [
        "llama",
        pytest.param("glm4_moe", marks=pytest.mark.slow),
        pytest.param("glm_moe_dsa_shared", marks=pytest.mark.slow),
    ],
)
def test_shortcut_equals_full_rerun(tiny_checkpoint, name):
    net, _ = load_model(tiny_checkpoint(name).path)
    kwargs = dict(formats=FORMATS, kernel="reference", progress=False)
    fast = profile_sensitivity(net, TOKENS, shortcut=True, **kwargs)
    full = profile_sensitivity(net, TOKENS, shortcut=False, **kwargs)
    assert fast["modules"].keys() == full["modules"].keys()
    assert any(entry["layer"] for entry in fast["modules"].values())  # some unit is replayed
    for unit, entry in fast["modules"].items():
        for fmt, cost in entry["formats"].items():
            expected = full["modules"][unit]["formats"][fmt]
            assert cost["kl"] == pytest.approx(expected["kl"], abs=1e-6), (unit, fmt)
            assert cost["ppl_delta"] == pytest.approx(expected["ppl_delta"], abs=1e-6)
            assert cost["bytes"] == expected["bytes"]
    # Quantizing something changes the output: the measurement is not trivially zero.
    assert max(e["formats"]["w4a8"]["kl"] for e in fast["modules"].values()) > 1e-6


def test_kl_matches_transformers_with_the_dequantized_weight(tiny_checkpoint):
    checkpoint = tiny_checkpoint("llama")
    net, _ = load_model(checkpoint.path)
    units = ["model.layers.1.self_attn.v_proj", "lm_head"]
    report = profile_sensitivity(
        net, TOKENS, formats=["int4-g32"], kernel="reference", units=units, progress=False
    )
    ids = torch.tensor([TOKENS])
    with torch.no_grad():
        dense = torch.log_softmax(checkpoint.oracle(ids).logits[0].float(), -1)
        for unit in units:
            oracle = copy.deepcopy(checkpoint.oracle)
            linear = oracle.get_submodule(unit)
            linear.weight = torch.nn.Parameter(
                quantize_weight(linear.weight, "int4-g32").dequantize()
            )
            quant = torch.log_softmax(oracle(ids).logits[0].float(), -1)
            kl = (dense.exp() * (dense - quant)).sum(-1).mean().item()
            measured = report["modules"][unit]["formats"]["int4-g32"]["kl"]
            assert kl > 1e-5
            assert measured == pytest.approx(kl, rel=1e-3, abs=1e-7), unit


def test_units_group_experts_per_layer_and_projection(tiny_checkpoint):
    net, _ = load_model(tiny_checkpoint("glm4_moe").path)
    report = profile_sensitivity(
        net,
        TOKENS[:6],
        formats=["int8"],
        units=["model.layers.1.mlp.experts.*.down_proj"],
        progress=False,
    )
    (entry,) = report["modules"].values()
    assert len(entry["members"]) == 8  # one down_proj per routed expert
    assert entry["num_weights"] == 8 * 64 * 32
    assert (entry["layer"], entry["kind"]) == (1, "mlp.experts.*.down_proj")
    assert (
        unit_of("model.layers.2.mlp.experts.13.up_proj") == "model.layers.2.mlp.experts.*.up_proj"
    )
    assert layer_and_kind("lm_head") == (None, "lm_head")


def test_profiling_leaves_the_model_and_engine_as_they_were(tiny_checkpoint):
    from zcode.llm import LLM
    from zcode.sampling_params import SamplingParams

    llm = LLM(tiny_checkpoint("llama").path, kv_cache_bytes=1 << 20)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    before = llm.generate([TOKENS[:8]], params)[0].token_ids
    state = {k: v.clone() for k, v in llm.model.state_dict().items()}
    profile_sensitivity(llm.model, TOKENS, formats=["int4-g128"], progress=False)
    assert llm.model.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in llm.model.state_dict().items())
    assert llm.generate([TOKENS[:8]], params)[0].token_ids == before


def test_unknown_unit_and_short_input_raise(tiny_checkpoint):
    net, _ = load_model(tiny_checkpoint("llama").path)
    with pytest.raises(ValueError, match="no such units"):
        profile_sensitivity(net, TOKENS, units=["model.layers.9.mlp.up_proj"], progress=False)
    with pytest.raises(ValueError, match="at least 2"):
        profile_sensitivity(net, TOKENS[:1], progress=False)


def test_heatmap_png(tiny_checkpoint, tmp_path):
    from zcode.quant.report import draw_heatmap

    net, _ = load_model(tiny_checkpoint("llama").path)
    units = ["model.layers.0.mlp.up_proj", "model.layers.1.self_attn.q_proj", "lm_head"]
    report = profile_sensitivity(net, TOKENS[:8], formats=FORMATS, units=units, progress=False)
    draw_heatmap(report, tmp_path / "heat.png")
    assert (tmp_path / "heat.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--formats", "int3"], "--formats: unknown int3"),
        (["--tokens", "1"], "--tokens must be at least 2"),
        (["--out", "/nonexistent-dir/report.json"], "does not exist"),
    ],
)
def test_cli_profile_rejects_bad_input(tmp_path, capsys, flags, message):
    from zcode import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["profile", "--out", str(tmp_path / "r.json"), *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
