"""Quantized artifacts: quantize -> save -> load gives bit-identical logits (nothing is quantized
again on load), the loader names the file and tensor of a damaged artifact, and `zcode quantize`
and `zcode ppl --plan` work end to end (on the real SmolLM2 in the slow tests).
"""

import json
import subprocess
import sys

import pytest
import torch
from paged_runner import PagedRunner
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from zcode import cli
from zcode.errors import CheckpointError
from zcode.layers.linear import Linear
from zcode.loader import load_model
from zcode.quant import QuantizedLinear, apply_precision, quantizable_modules
from zcode.quant.activations import HessianCollector
from zcode.quant.artifact import METADATA_KEY, PLAN_FILE, WEIGHTS_FILE, save_artifact
from zcode.quant.hadamard import RotatedLinear

PROMPT = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()
MIXED_PLAN = {
    "model.layers.0.self_attn.q_proj": "int8",
    "model.layers.0.self_attn.k_proj": "w8a8",
    "model.layers.0.mlp.down_proj": "int4-g64",
    "model.layers.1.self_attn.o_proj": "bf16",
    "model.layers.1.mlp.up_proj": "w4a8",
    "model.layers.1.mlp.gate_proj": "fp32",  # unchanged
    "lm_head": "int4-g32",
}


def _logits(net: nn.Module) -> torch.Tensor:
    return PagedRunner(net).step({"a": PROMPT})["a"]  # [T, V]


def _hessians(net: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    collector = HessianCollector(net, names)
    PagedRunner(net).step({"a": PROMPT, "b": PROMPT[::-1]})
    collector.remove()
    return collector.hessians


@pytest.mark.parametrize(
    "method, hadamard", [("rtn", False), ("gptq", False), ("rtn", True), ("gptq", True)]
)
def test_round_trip_is_bit_identical(tiny_checkpoint, tmp_path, method, hadamard):
    net, _ = load_model(tiny_checkpoint("llama").path)
    names = [n for n, f in MIXED_PLAN.items() if f != "fp32"]
    hessians = _hessians(net, names) if method == "gptq" else None
    apply_precision(net, MIXED_PLAN, method=method, hessians=hessians, hadamard=hadamard)
    want = _logits(net)
    save_artifact(net, None, tmp_path, method, hadamard)

    loaded, _ = load_model(tmp_path)
    wrapper = RotatedLinear if hadamard else QuantizedLinear
    for name, fmt in MIXED_PLAN.items():
        module = loaded.get_submodule(name)
        assert (type(module) is Linear) if fmt == "fp32" else isinstance(module, wrapper)
        if fmt != "fp32":
            assert module.format == fmt
    assert torch.equal(_logits(loaded), want)
    info = json.loads((tmp_path / PLAN_FILE).read_text())
    assert info == {
        "method": method,
        "hadamard": hadamard,
        "plan": {n: f for n, f in MIXED_PLAN.items() if f != "fp32"},
    }


def test_tied_lm_head_quantized_keeps_the_float_embedding(tiny_checkpoint, tmp_path):
    net, _ = load_model(tiny_checkpoint("llama").path)
    net.lm_head.weight = net.model.embed_tokens.weight
    net.config.tie_word_embeddings = True
    embedding = net.model.embed_tokens.weight.detach().clone()
    apply_precision(net, {"lm_head": "int4-g32"})
    want = _logits(net)
    save_artifact(net, None, tmp_path, "rtn", False)
    loaded, _ = load_model(tmp_path)
    assert isinstance(loaded.lm_head, QuantizedLinear)
    assert torch.equal(loaded.model.embed_tokens.weight, embedding)
    assert torch.equal(_logits(loaded), want)


def test_engine_generates_from_an_artifact(tiny_checkpoint, tmp_path):
    from zcode.llm import LLM
    from zcode.sampling_params import SamplingParams

    cli.main(["quantize", str(tiny_checkpoint("llama").path), "--format", "w4a8", "--out",
              str(tmp_path / "q")])  # fmt: skip
    llm = LLM(tmp_path / "q", kv_cache_bytes=1 << 20)
    assert sum(isinstance(m, QuantizedLinear) for m in llm.model.modules()) == 2 * 7 + 1
    [out] = llm.generate([PROMPT[:9]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out.token_ids) == 6


def _artifact(tiny_checkpoint, path, plan=None):
    net, _ = load_model(tiny_checkpoint("llama").path)
    apply_precision(net, plan or {"model.layers.0.mlp.down_proj": "int4-g32", "lm_head": "int8"})
    save_artifact(net, None, path, "rtn", False)
    return path / WEIGHTS_FILE


def _rewrite(file, change) -> None:
    """Rewrites a safetensors file after change(tensors, metadata) edits them in place."""
    with safe_open(str(file), framework="pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
        metadata = handle.metadata()
    change(tensors, metadata)
    save_file(tensors, str(file), metadata=metadata)


def test_truncated_artifact_names_the_file(tiny_checkpoint, tmp_path):
    file = _artifact(tiny_checkpoint, tmp_path)
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=str(file)):
        load_model(tmp_path)


def test_format_mismatch_names_the_tensor(tiny_checkpoint, tmp_path):
    file = _artifact(tiny_checkpoint, tmp_path)

    def regroup(tensors, metadata):
        info = json.loads(metadata[METADATA_KEY])
        info["plan"]["model.layers.0.mlp.down_proj"] = "int4-g64"
        metadata[METADATA_KEY] = json.dumps(info)

    _rewrite(file, regroup)
    name = "model.layers.0.mlp.down_proj.packed.scales_and_zeros"
    with pytest.raises(CheckpointError, match=rf"{file}: tensor '{name}' is .* needs"):
        load_model(tmp_path)


def test_missing_packed_tensor_is_named(tiny_checkpoint, tmp_path):
    file = _artifact(tiny_checkpoint, tmp_path)
    _rewrite(file, lambda tensors, metadata: tensors.pop("lm_head.packed.scales"))
    with pytest.raises(CheckpointError, match="lacks tensor 'lm_head.packed.scales'"):
        load_model(tmp_path)


def test_plan_naming_a_missing_module_is_refused(tiny_checkpoint, tmp_path):
    file = _artifact(tiny_checkpoint, tmp_path)

    def rename(tensors, metadata):
        info = json.loads(metadata[METADATA_KEY])
        info["plan"]["model.layers.9.mlp.up_proj"] = "int8"
        metadata[METADATA_KEY] = json.dumps(info)

    _rewrite(file, rename)
    with pytest.raises(CheckpointError, match="model.layers.9.mlp.up_proj.*not a linear"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--format", "int3"], "unknown format 'int3'"),
        (["--budget", "4.5bits"], "pass --profile PROFILE.json"),
        (["--budget", "four", "--profile", "PROFILE"], "four"),
        (["--format", "int8", "--profile", "PROFILE"], "add --budget"),
        (["--format", "int8", "--method", "gptq"], "has no tokenizer"),
        (["--plan", "PLAN"], "no such module"),
        (["--plan", "MISSING"], "No such file"),
    ],
)
def test_quantize_user_mistakes(tiny_checkpoint, tmp_path, capsys, extra, message):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"model.layers.5.mlp.up_proj": "int8"}))
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(_profile(tiny_checkpoint)))
    paths = {"PLAN": str(plan), "MISSING": str(tmp_path / "nope"), "PROFILE": str(profile)}
    extra = [paths.get(a, a) for a in extra]
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["quantize", str(tiny_checkpoint("llama").path), "--out", str(out), *extra])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the fixture's progress bars
    assert err.startswith("zcode: error:") and message in err
    assert not (out / WEIGHTS_FILE).exists()


def _profile(tiny_checkpoint) -> dict:
    """A sensitivity profile of the tiny llama in the planner's schema: int8 costs little KL,
    int4-g32 ten times more, and lm_head is the most sensitive module."""
    net, _ = load_model(tiny_checkpoint("llama").path)
    modules = {}
    for name in quantizable_modules(net):
        n = net.get_submodule(name).weight.numel()
        scale = 10.0 if name == "lm_head" else 1.0
        formats = {
            "int8": {"kl": 1e-4 * scale, "bytes": n + 2 * n // 64},
            "int4-g32": {"kl": 1e-3 * scale, "bytes": n // 2 + n // 8},
        }
        modules[name] = {"members": [name], "num_weights": n, "formats": formats}
    return {"modules": modules}


def test_quantize_by_budget_follows_the_planner(tiny_checkpoint, tmp_path):
    profile_path = tmp_path / "profile.json"
    profile = _profile(tiny_checkpoint)
    profile_path.write_text(json.dumps(profile))
    out = tmp_path / "out"
    cli.main(["quantize", str(tiny_checkpoint("llama").path), "--budget", "6bits", "--profile",
              str(profile_path), "--out", str(out)])  # fmt: skip
    from zcode.quant.planner import plan_for_budget

    want = {n: f for n, f in plan_for_budget(profile, "6bits").items() if f != "fp32"}
    assert json.loads((out / PLAN_FILE).read_text())["plan"] == want
    assert {"int8", "int4-g32"} <= set(want.values())  # the budget forces a real mix
    loaded, _ = load_model(out)
    assert {loaded.get_submodule(n).format for n in want} == set(want.values())


def test_quantize_refuses_a_non_empty_out_dir(tiny_checkpoint, tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit):
        cli.main(["quantize", str(tiny_checkpoint("llama").path), "--format", "int8", "--out",
                  str(tmp_path)])  # fmt: skip
    assert "not an empty directory" in capsys.readouterr().err


def _run_zcode(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zcode.cli", *args], capture_output=True, text=True, timeout=1800
    )


def _ppl(output: str) -> str:
    return next(line for line in output.splitlines() if line.startswith("perplexity"))


@pytest.mark.slow
@pytest.mark.timeout(1800)  # four model loads in subprocesses: 600 s ran out on a busy machine
def test_smollm2_artifact_and_plan_give_the_same_perplexity(tmp_path):
    """`zcode quantize --format int4-g32` then `zcode ppl DIR`, against `zcode ppl --plan` of the
    same uniform plan on the original model: the same RTN weights, the same perplexity to the
    last digit. The artifact also loads in `zcode info`."""
    from zcode.calibration import corpus_text

    text = tmp_path / "heldout.txt"
    text.write_text(corpus_text("heldout")[:3000])
    out = tmp_path / "smollm2-int4"
    result = _run_zcode("quantize", "--format", "int4-g32", "--out", str(out))
    assert result.returncode == 0, result.stderr
    info = json.loads((out / PLAN_FILE).read_text())
    assert len(info["plan"]) == 30 * 7 + 1 and set(info["plan"].values()) == {"int4-g32"}
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(info["plan"]))

    from_artifact = _run_zcode("ppl", str(out), str(text), "--max-tokens", "300")
    from_plan = _run_zcode("ppl", str(text), "--plan", str(plan), "--max-tokens", "300")
    assert from_artifact.returncode == 0, from_artifact.stderr
    assert from_plan.returncode == 0, from_plan.stderr
    print(_ppl(from_artifact.stdout), "|", _ppl(from_plan.stdout))
    assert _ppl(from_artifact.stdout) == _ppl(from_plan.stdout)
    assert _run_zcode("info", str(out)).returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_gptq_hadamard_round_trip_is_bit_identical(tmp_path):
    from zcode.calibration import corpus_tokens
    from zcode.llm import LLM
    from zcode.quant.activations import collect_hessians

    llm = LLM(None, dtype="float32", kv_cache_bytes=64 << 20, enable_prefix_caching=False)
    names = quantizable_modules(llm.model)
    tokens = corpus_tokens(llm.tokenizer, "calibration", 256)
    # GPTQ for the first and last layers and lm_head; the rest falls back to RTN (a full GPTQ
    # pass takes minutes on a shared machine and adds nothing to a round-trip check).
    calibrated = [n for n in names if n.startswith(("model.layers.0.", "model.layers.29.", "lm"))]
    hessians = collect_hessians(llm, tokens, calibrated)
    plan = {name: "int4-g64" if i % 2 else "w8a8" for i, name in enumerate(names)}
    apply_precision(llm.model, plan, method="gptq", hessians=hessians, hadamard=True)
    want = _logits(llm.model)
    save_artifact(llm.model, llm.tokenizer, tmp_path, "gptq", True)
    loaded, tokenizer = load_model(tmp_path)
    assert tokenizer.encode("def f(x):") == llm.tokenizer.encode("def f(x):")
    assert torch.equal(_logits(loaded), want)
