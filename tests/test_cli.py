"""The `zcode` command line, end to end in subprocesses, plus its argument handling in-process.

Loading the default model is most of a command's cost, so generate, chat and ppl share one
subprocess whose `load_llm` is cached; argument errors and the chat loop's bookkeeping are checked
in-process (they fail or finish before any model is loaded). Subprocesses run torch with one
thread: on a loaded 2-core machine a second thread mostly spins.
"""

import argparse
import io
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from zcode import cli

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
SECTION = "=== next command ==="

OPTIONS = {
    "generate": [
        "PROMPT", "--model", "--max-tokens", "--temperature", "--top-k", "--top-p", "--min-p",
        "--repetition-penalty", "--seed", "--stop", "--chat", "--thinking", "--no-thinking",
        "--dtype", "--stream", "--tensor-parallel-size", "--collective-timeout-s",
        "--expert-parallel", "--pipeline-parallel-size",
        "--max-latency-ms", "--max-quality-loss", "--quality", "--max-kv-bytes",
        "--experts-per-token",
    ],
    "chat": [
        "--model", "--system", "--max-tokens", "--temperature", "--top-k", "--top-p", "--min-p",
        "--repetition-penalty", "--seed", "--stop", "--thinking", "--no-thinking", "--dtype",
    ],
    "info": ["MODEL", "--json"],
    "ppl": ["MODEL", "FILE", "--window", "--stride", "--max-tokens", "--dtype"],
    "hw": ["--refresh", "--json", "--fit-cost", "--compiled"],
    "plan": [
        "MODEL", "--sparsity", "--budget", "--max-latency-ms", "--max-quality-loss",
        "--quality", "--max-kv-bytes", "--experts-per-token", "--per-request-depth",
        "--batch-size", "--context-len",
    ],
}  # fmt: skip


def run_zcode(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zcode.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )


@pytest.mark.parametrize("command", sorted(OPTIONS))
def test_help_explains_every_option(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    for option in OPTIONS[command]:
        assert option in help_text
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for action in commands.choices[command]._actions:
        assert action.help, f"{command} {action.option_strings or action.dest} has no help"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "hi", "--top-p", "2"], "top_p must be in (0, 1]"),
        (["generate", "hi", "--max-tokens", "many"], "invalid int value: 'many'"),
        (["generate", "hi", "--dtype", "int3"], "invalid choice: 'int3'"),
        (["generate", "hi", "--thinking"], "add --chat"),
        (["generate", "hi", "--experts-per-token", "0"], "experts_per_token must be an int >= 1"),
        (["generate", "hi", "--tensor-parallel-size", "0"], "must be a positive integer"),
        (["generate", "hi", "--expert-parallel"], "set tensor_parallel_size to 2 or more"),
        (["generate", "hi", "--pipeline-parallel-size", "-1"], "must be a positive integer"),
        (
            ["generate", "hi", "--pipeline-parallel-size", "2", "--tensor-parallel-size", "2"],
            "not supported yet: pipeline parallelism of tensor-parallel stages",
        ),
        (["chat", "--temperature", "-1"], "temperature must be >= 0"),
        (["ppl", "missing.txt"], "missing.txt: No such file or directory"),
        (["ppl", "f.txt", "--window", "64", "--stride", "65"], "--stride must be between 1"),
        (["serve", "--chat-template", "missing.jinja"], "--chat-template missing.jinja"),
        (["hw", "--compiled"], "pass it with --fit-cost"),
    ],
)
def test_user_mistakes_fail_before_loading(argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "f.txt").write_text("some text")
    monkeypatch.setattr(
        cli.options, "load_llm", lambda *a: pytest.fail("loaded a model for a bad command")
    )
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("zcode: error: ") and message in err and err.count("\n") == 1


def test_parallel_options_make_the_parallel_config():
    args = cli.build_parser().parse_args(
        ["generate", "hi", "--tensor-parallel-size", "2", "--expert-parallel"]
    )
    parallel = cli.options.parallel_args(args)["parallel"]
    assert (parallel.tensor_parallel_size, parallel.expert_parallel) == (2, True)
    args = cli.build_parser().parse_args(["generate", "hi", "--pipeline-parallel-size", "2"])
    assert cli.options.parallel_args(args)["parallel"].pipeline_parallel_size == 2
    assert cli.options.parallel_args(cli.build_parser().parse_args(["generate", "hi"])) == {}


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"zcode {version('zcode')}"


def test_serve_passes_the_template_file_and_metrics_protection_on(monkeypatch, tmp_path):
    import zcode.server

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    calls = []
    monkeypatch.setattr(zcode.server, "run_server", lambda *a, **k: calls.append(k))
    cli.main(["serve", "--chat-template", str(template), "--protect-metrics", "--api-key", "k"])
    [kwargs] = calls
    assert kwargs["chat_template"] == template.read_text()
    assert kwargs["protect_metrics"] is True and kwargs["api_key"] == "k"
    cli.main(["serve"])
    assert calls[1]["chat_template"] is None and calls[1]["protect_metrics"] is False
    assert "compile" not in calls[1]["engine_args"]
    cli.main(["serve", "--compile"])
    assert calls[2]["engine_args"]["compile"] is True


class FakeLLM:
    """Streams "reply N" in two pieces and records the conversation of every turn."""

    tokenizer = SimpleNamespace(chat_template="{{ messages }}")

    def __init__(self) -> None:
        self.conversations: list[list[dict]] = []

    def stream(self, messages, params, enable_thinking=None):
        self.conversations.append([dict(m) for m in messages])
        for piece in ("reply", f" {len(self.conversations)}"):
            yield SimpleNamespace(delta_text=piece)


def test_chat_keeps_history_and_obeys_commands(capsys, monkeypatch):
    llm = FakeLLM()
    monkeypatch.setattr(cli.options, "load_llm", lambda *a: llm)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n\nagain\n/reset\nfresh\n/exit\nlost\n"))
    cli.main(["chat", "--system", "Be brief."])
    system = {"role": "system", "content": "Be brief."}
    assert llm.conversations == [
        [system, {"role": "user", "content": "hello"}],
        [
            system,
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "reply 1"},
            {"role": "user", "content": "again"},
        ],
        [system, {"role": "user", "content": "fresh"}],
    ]
    assert capsys.readouterr().out == "reply 1\nreply 2\nreply 3\n"


class InterruptedLLM(FakeLLM):
    """Ctrl-C comes while the first reply's second piece is computed (that piece still arrives:
    the step in flight ends); records whether each stream was closed (LLM.stream aborts its
    request when closed)."""

    def __init__(self) -> None:
        super().__init__()
        self.closed: list[bool] = []

    def stream(self, messages, params, enable_thinking=None):
        self.conversations.append([dict(m) for m in messages])
        self.closed.append(False)
        try:
            for piece in ("reply", f" {len(self.conversations)}", " more"):
                yield SimpleNamespace(delta_text=piece)
                if len(self.conversations) == 1:
                    os.kill(os.getpid(), signal.SIGINT)
        finally:
            self.closed[-1] = True


def test_chat_ctrl_c_stops_the_reply_and_keeps_the_conversation(capsys, monkeypatch):
    # what SIGINT did before (a background job of a non-interactive shell starts with it ignored)
    handler_before = signal.getsignal(signal.SIGINT)
    llm = InterruptedLLM()
    monkeypatch.setattr(cli.options, "load_llm", lambda *a: llm)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nagain\n"))
    cli.main(["chat"])
    assert llm.conversations[1] == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "reply 1"},
        {"role": "user", "content": "again"},
    ]
    assert llm.closed == [True, True]
    assert capsys.readouterr().out == "reply 1\nreply 2 more\n"
    assert signal.getsignal(signal.SIGINT) is handler_before


def test_generate_chat_and_ppl_on_the_default_model(tmp_path):
    source = Path(textwrap.__file__).read_text()[:4000]  # comfortably more than 300 tokens
    text_file = tmp_path / "textwrap.txt"
    text_file.write_text(source)
    commands = [
        ["generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0"],
        ["generate", "What is 2+2?", "--chat", "--stream", "--max-tokens", "8", "--seed", "0"],
        ["ppl", str(text_file), "--max-tokens", "300", "--window", "256", "--stride", "128"],
        # each reply ends at its first newline, so the output has exactly one line per reply
        ["chat", "--max-tokens", "12", "--temperature", "0", "--stop", "\n"],
    ]
    driver = (
        "import functools, sys\n"
        "import zcode.cli as cli\n"
        "cli.options.load_llm = functools.cache(cli.options.load_llm)\n"
        f"for argv in {commands!r}:\n"
        f"    print({SECTION!r}, flush=True)\n"
        "    cli.main(argv)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", driver],
        input="Hi, who are you?\nWhat is 2+2?\n/exit\nthis line must not be answered\n",
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    generated, streamed, ppl, chat = result.stdout.split(SECTION + "\n")[1:]
    assert "Paris" in generated
    assert streamed.strip()
    values = dict(line.split(None, 1) for line in ppl.splitlines())
    assert 1 < float(values["perplexity"]) < 100
    assert values["tokens"] == "299 scored of 300"
    assert math.isfinite(float(values["seconds"]))
    replies = chat.split("\n")
    assert len(replies) == 3 and replies[2] == "", chat  # two replies, each ended by a newline
    assert all(reply.strip() for reply in replies[:2])


def test_info_on_the_default_model():
    result = run_zcode("info")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # SmolLM2-135M: 30 layers of width 576, 9 query / 3 KV heads of 64, FFN 1536, tied 49152 vocab
    hidden, ffn, kv_width, vocab, layers = 576, 1536, 3 * 64, 49152, 30
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_width + 3 * hidden * ffn + 2 * hidden
    num_params = vocab * hidden + layers * per_layer + hidden
    assert f"{num_params / 1e6:.1f}M" in out  # 134.5M
    kv_fp32 = layers * 2 * kv_width * 4
    assert f"{kv_fp32 / 1024:.1f} KiB (float32)" in out
    for word in ("llama", "8192 tokens", "float32", "bfloat16", "int8", "int4"):
        assert word in out


def test_info_reports_the_stored_types_and_bytes_per_token():
    from gguf import GGUFReader

    from zcode.info import model_info
    from zcode.loader.checkpoint import resolve_model_path

    # The oracle: the gguf package's own reading of the file's tensor table.
    tensors = GGUFReader(str(resolve_model_path(None))).tensors
    by_type: dict[str, dict[str, int]] = {}
    for t in tensors:
        row = by_type.setdefault(t.tensor_type.name, {"tensors": 0, "bytes": 0})
        row["tensors"] += 1
        row["bytes"] += int(t.n_bytes)
    info = model_info(None)
    assert info.stored_types == by_type
    assert set(by_type) == {"Q4_1", "Q8_0", "F32"}  # the shipped file: Q4_1 linears
    # Tied embedding: the output projection reads all of token_embd, every tensor is read once.
    assert info.stored_bytes_per_token == sum(int(t.n_bytes) for t in tensors)
    assert info.memory[0].precision == "stored"


def glm5_expected(c) -> dict[str, int]:
    """GLM-5's parameter counts and KV bytes per token, module by module from its config."""
    h, heads, rope = c.hidden_size, c.num_attention_heads, c.qk_rope_head_dim
    q_a = h * c.q_lora_rank + c.q_lora_rank  # q_a_proj, q_a_layernorm
    q_b = c.q_lora_rank * heads * (c.qk_nope_head_dim + rope)
    kv_a = h * (c.kv_lora_rank + rope) + c.kv_lora_rank  # kv_a_proj_with_mqa, kv_a_layernorm
    kv_b = c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
    o = heads * c.v_head_dim * h
    index_q = c.q_lora_rank * c.index_n_heads * c.index_head_dim
    index_k = h * c.index_head_dim + 2 * c.index_head_dim  # wk, k_norm (a LayerNorm with bias)
    index_weights = h * c.index_n_heads
    attention = q_a + q_b + kv_a + kv_b + o + index_q + index_k + index_weights
    expert = 3 * h * c.moe_intermediate_size  # gate, up, down
    moe = c.n_routed_experts * h + (c.n_routed_experts + c.n_shared_experts) * expert
    num_dense = c.first_k_dense_replace
    num_sparse = c.num_hidden_layers - num_dense
    embedding_and_head = 2 * c.vocab_size * h  # untied
    norms = c.num_hidden_layers * 2 * h + h
    total = (
        embedding_and_head
        + norms
        + c.num_hidden_layers * attention
        + num_dense * 3 * h * c.intermediate_size
        + num_sparse * moe
    )
    unvisited = num_sparse * (c.n_routed_experts - c.num_experts_per_tok) * expert
    kv_width = c.kv_lora_rank + rope + c.index_head_dim  # latent, its rotated key, indexer key
    return {
        "total": total,
        "active": total - unvisited,
        "kv_bf16": c.num_hidden_layers * kv_width * 2,
    }


# slow: builds GLM-5's full layer list on the meta device (~27 s on 2 cores)
@pytest.mark.slow
def test_info_on_a_config_only_glm5_directory(tmp_path):
    from transformers import GlmMoeDsaConfig

    # GLM-5's published dimensions (glm-architecture.md section 1.4), spelled out rather than
    # left to transformers' defaults.
    config = GlmMoeDsaConfig(
        vocab_size=154880, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
        num_hidden_layers=78, first_k_dense_replace=3, num_attention_heads=64,
        num_key_value_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
        qk_rope_head_dim=64, v_head_dim=256, index_head_dim=128, index_n_heads=32,
        index_topk=2048, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
        routed_scaling_factor=2.5, n_group=1, topk_group=1, max_position_embeddings=202752,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, num_nextn_predict_layers=1,
        eos_token_id=[154820, 154827, 154829], pad_token_id=154820,
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]

    result = run_zcode("info", str(tmp_path / "config.json"), "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    expected = glm5_expected(config)
    assert 740e9 < expected["total"] < 760e9  # GLM-5 is published as ~744B-754B
    assert info["model_type"] == "glm_moe_dsa"
    assert info["num_params"] == expected["total"]
    assert info["num_active_params"] == expected["active"]  # ~42B incl. embedding and head
    assert info["num_experts"] == 256 and info["num_experts_per_tok"] == 8
    assert info["num_mtp_layers"] == 1
    assert info["kv_bytes_per_token"] == {
        "float32": 2 * expected["kv_bf16"],
        "bfloat16": expected["kv_bf16"],
    }
    memory = {row["precision"]: row for row in info["memory"]}
    assert memory["bfloat16"]["weight_bytes"] == 2 * expected["total"]
    assert memory["bfloat16"]["kv_bytes"] == expected["kv_bf16"] * 202752
    # int4 with a fp16 scale per 32 weights is 4.5 bits for the matrices, which are nearly all
    assert 0.55 < memory["int4"]["weight_bytes"] / expected["total"] < 0.57
    assert 1.05 < memory["int8"]["weight_bytes"] / expected["total"] < 1.07


def test_missing_model_is_one_line_and_status_2(tmp_path):
    result = run_zcode("generate", "hi", "--model", str(tmp_path / "no-such-model"))
    assert result.returncode == 2
    assert result.stderr.startswith("zcode: error: ") and "no-such-model" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_hw_reports_measured_machine_facts_as_json(tmp_path):
    # A hang guard only: the probe times its own kernels, which took over 120 s at load average 8.
    env_cache = {"ZCODE_CACHE_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "zcode.cli", "hw", "--json"],
        capture_output=True, text=True, env={**ENV, **env_cache}, timeout=540,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout)
    assert facts["read_bandwidth_gbps"] > 0 and facts["fp32_gflops"] > 0
    assert list(tmp_path.glob("hardware-*.json")), "the probe result is cached"


def test_ctrl_c_during_start_up_exits_130_without_a_traceback():
    """Interrupted while it imports torch and loads the model: status 130, nothing on stderr
    but what a user should read (the top-level imports are light, so main's handler is set)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "zcode.cli", "generate", "hi"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
        # as at a terminal: a test run started in the background inherits SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    # Interrupt once torch's library is mapped: main is running (a fixed sleep could land in the
    # interpreter's own start-up on a busy machine, before any handler can exist).
    deadline = time.monotonic() + 120  # a hang guard
    maps = Path(f"/proc/{proc.pid}/maps")
    while "libtorch" not in maps.read_text() and proc.poll() is None:
        assert time.monotonic() < deadline, "zcode generate never started loading torch"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
