"""zcode calibrate and --sparsity: bad input fails before a model loads; end to end (slow)."""

import subprocess
import sys
from pathlib import Path

import pytest

from zcode import cli


@pytest.mark.parametrize(
    "argv, message",
    [
        (["ppl", "f.txt", "--sparsity", "none.pt"], "none.pt: no such sparsity artifact"),
        (["generate", "hi", "--sparsity", "none.pt"], "none.pt: no such sparsity artifact"),
        (["calibrate", "--tokens", "100"], "--tokens must be at least 512"),
        (["calibrate", "--router-tokens", "10"], "--router-tokens must be at least 256, got 10"),
        (["calibrate", "--eval-tokens", "100"], "--eval-tokens must be at least 512, got 100"),
        (["generate", "hi", "--skip-layers", "a"], "--skip-layers takes layer numbers"),
        (["generate", "hi", "--skip-kv-heads", "5"], "layer:head pairs"),
        (["generate", "hi", "--skip-kv-heads", "5:1:2"], "layer:head pairs"),
        (["generate", "hi", "--quality", "fast", "--stream"], "cannot be combined"),
        (["generate", "hi", "--budget", "4bits"], "add --sparsity ARTIFACT"),
        (["plan", "--sparsity", "p.pt", "--budget", "4bits"], "p.pt: no such sparsity artifact"),
        (["ppl", "f.txt", "--skip-kv-heads", "x:1"], "layer:head pairs"),
        (["calibrate", "--formats", "int8,int3"], "--formats: unknown int3"),
        (["calibrate", "--formats", ","], "--formats: unknown empty list"),
    ],
)
def test_user_mistakes_fail_before_loading(argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "f.txt").write_text("some text")
    monkeypatch.setattr(cli.options, "load_llm", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("zcode: error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize("stream", [False, True])
def test_generate_passes_skips_to_a_paged_engine(stream, capsys, monkeypatch):
    seen = {}

    class FakeLLM:
        def generate(self, prompt, params, thinking, **skips):
            seen["skips"] = skips
            return [type("Out", (), {"text": "ok", "plan": None})]

        def stream(self, prompt, params, thinking, **skips):
            seen["skips"] = skips
            yield type("Out", (), {"delta_text": "ok"})

    def load(*args, **engine_args):
        seen["engine_args"] = engine_args
        return FakeLLM()

    monkeypatch.setattr(cli.options, "load_llm", load)
    argv = ["generate", "hi", "--skip-layers", "3,4", "--skip-kv-heads", "5:2,6:0"]
    cli.main(argv + (["--stream"] if stream else []))
    assert capsys.readouterr().out.strip() == "ok"
    assert seen["engine_args"] == {"per_request_depth": True}
    assert seen["skips"] == {"skip_layers": [3, 4], "skip_kv_heads": [(5, 2), (6, 0)]}


def test_ppl_scores_with_the_skips_on_a_paged_engine(capsys, monkeypatch, tmp_path):
    """The per-request plan's perplexity, on the engine (tested against transformers in
    test_request_depth); here the wiring: flags -> a paged engine -> perplexity(**skips)."""
    from zcode.ppl import PerplexityResult

    seen = {}

    class FakeLLM:
        def encode(self, text):
            return [5, 6, 7]

    def load(*args, **engine_args):
        seen["engine_args"] = engine_args
        return FakeLLM()

    def score(llm, token_ids, window, stride, **skips):
        seen["skips"] = skips
        return PerplexityResult(nll_sum=2.0, num_tokens=2)

    monkeypatch.setattr(cli.options, "load_llm", load)
    monkeypatch.setattr("zcode.ppl.perplexity", score)
    (tmp_path / "t.txt").write_text("abc")
    cli.main(["ppl", str(tmp_path / "t.txt"), "--skip-layers", "14", "--skip-kv-heads", "5:2"])
    assert "perplexity  2.7183" in capsys.readouterr().out
    assert seen == {
        "engine_args": {"float_weights": False, "per_request_depth": True},
        "skips": {"skip_layers": [14], "skip_kv_heads": [(5, 2)]},
    }


@pytest.fixture(scope="module")
def tiny_glm_with_a_tokenizer(tmp_path_factory) -> Path:
    """A random Llama (two layers, hidden 64) over SmolLM2's tokenizer and vocabulary: what the
    CLI needs to read calibration text, at a tiny model's cost (zcode calibrate on SmolLM2 itself
    took 14 min on a quiet 2-core machine, most of the slow target; its quality is the bench's)."""
    from tiny_models import _random_model, _with, configs

    from zcode.loader.checkpoint import resolve_model_path
    from zcode.loader.gguf_file import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(resolve_model_path(None))
    path = tmp_path_factory.mktemp("tiny-llama-smollm2-vocab")
    fields = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": None,
        "max_position_embeddings": 2048,  # calibration windows are 512 tokens and one more
    }
    model = _random_model(_with(configs()["llama"], **fields))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow  # three CLI processes
def test_calibrate_then_ppl_with_the_artifact(tiny_glm_with_a_tokenizer, tmp_path):
    model = str(tiny_glm_with_a_tokenizer)
    artifact = tmp_path / "s.pt"
    zcode = [sys.executable, "-m", "zcode.cli"]
    cal = subprocess.run(
        [*zcode, "calibrate", model, "--out", str(artifact), "--formats", "int8,w4a8"]
        + ["--router-tokens", "1024"],
        capture_output=True,
        text=True,
        env={"ZCODE_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert cal.returncode == 0, cal.stderr
    assert artifact.is_file() and f"wrote {artifact}" in cal.stdout
    assert "units outside the FFNs x int8, w4a8 (zcode generate --budget)" in cal.stdout
    text = tmp_path / "t.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 20)
    runs = {}
    for flags in ([], ["--sparsity", str(artifact)]):
        out = subprocess.run(
            [*zcode, "ppl", model, str(text), *flags], capture_output=True, text=True, check=True
        )
        runs[bool(flags)] = float(out.stdout.split()[1])
    assert runs[True] == pytest.approx(runs[False], rel=0.05)


def test_calibrate_passes_its_token_counts(capsys, monkeypatch):
    import zcode.sparsity.calibrate

    seen = {}

    def fake_calibrate(llm, **kwargs):
        seen.update(kwargs)
        raise ValueError("stopped after the call")

    monkeypatch.setattr(cli.options, "load_llm", lambda *a, **k: type("L", (), {"tokenizer": 1}))
    monkeypatch.setattr(zcode.sparsity.calibrate, "calibrate", fake_calibrate)
    argv = ["calibrate", "--tokens", "2048", "--eval-tokens", "4096", "--router-tokens", "512"]
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert "stopped after the call" in capsys.readouterr().err
    assert (seen["num_tokens"], seen["num_eval_tokens"], seen["router_tokens"]) == (2048, 4096, 512)


def test_calibrates_eval_tokens_default_is_the_librarys():
    """The CLI spells the default out (it parses without torch): it must be calibrate()'s."""
    import inspect

    from zcode.sparsity.calibrate import calibrate

    library = inspect.signature(calibrate).parameters["num_eval_tokens"].default
    assert cli.build_parser().parse_args(["calibrate"]).eval_tokens == library


def test_formats_default_to_the_sensitivity_profiles_formats():
    """The CLI spells the default out (it parses without torch): it must be the library's."""
    from zcode.quant.sensitivity import DEFAULT_FORMATS

    for command in ("calibrate", "profile"):
        args = cli.build_parser().parse_args([command, "--out", "x"])
        assert cli.options.profile_formats(args) == list(DEFAULT_FORMATS), command
