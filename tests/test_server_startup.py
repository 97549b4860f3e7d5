"""`zcode serve` start-up: the port is taken before the model loads, the C++ kernels are built
before the server reports ready, and Ctrl-C while starting exits without a traceback."""

import socket
import subprocess
import sys

from remote_server import ENV, RemoteServer


def serve(port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "zcode.cli", "serve", "--port", str(port)]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV, text=True
    )


def test_port_in_use_is_a_clear_error_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc = serve(taken.getsockname()[1])
        output, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, output
    assert "cannot listen on 127.0.0.1" in output and "in use" in output, output
    assert "Traceback" not in output and "serving" not in output and "C++ kernels" not in output


def test_kernels_are_built_before_the_server_reports_ready():
    with RemoteServer("--max-model-len", "256", "--kv-cache-mib", "16") as server:
        output = server.output()
    assert "C++ kernels: gemv" in output, output
    assert output.index("C++ kernels: gemv") < output.index("serving"), output


def test_a_chat_template_given_at_start_up_replaces_the_checkpoints():
    from zcode.server.launch import build_state

    engine_args = {"max_model_len": 64, "kv_cache_bytes": 8 << 20}
    state = build_state(None, None, engine_args, chat_template="<{{ messages[0].content }}>")
    assert state.llm.apply_chat_template([{"role": "user", "content": "hi"}]) == "<hi>"
