"""A real `zcode serve` subprocess on a free loopback port, as vLLM's RemoteOpenAIServer.

Tests talk to it with the official `openai` client, and with plain `http.client` where they need
what the client hides (raw bodies, status codes, headers, dropping a connection mid-stream).
"""

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import openai
import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # a second torch thread mostly spins on 2 cores
TP2_STARTUP_TIMEOUT_S = 480  # a hang guard: two ranks loading on a busy 2-core machine
# The layouts a suite's server fixture runs in (`params=LAYOUTS`, then `launch(request.param,
# ...)`): one process, and a tensor-parallel server over two torchrun ranks, slow (.ci/run).
LAYOUTS = ["one", pytest.param("tp2", marks=pytest.mark.slow)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*options: str) -> tuple[str, ...]:
    """torchrun with two ranks on a free rendezvous port."""
    launcher = Path(sys.executable).parent / "torchrun"
    return (str(launcher), "--nproc-per-node", "2", "--master-port", str(free_port()), *options)


def launch(layout: str, *args: str, **kwargs) -> "RemoteServer":
    """`zcode serve *args` in one of LAYOUTS."""
    if layout == "one":
        return RemoteServer(*args, **kwargs)
    assert layout == "tp2", layout
    kwargs.setdefault("startup_timeout_s", TP2_STARTUP_TIMEOUT_S)
    return RemoteServer(*args, "--tensor-parallel-size", "2", launcher=torchrun(), **kwargs)


class InThreadServer:
    """A uvicorn server for an ASGI app on a daemon thread of this process, on a free port."""

    def __init__(self, app, startup_timeout_s: float = 30) -> None:
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + startup_timeout_s
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class RemoteServer:
    """`launcher`: what runs `-m zcode.cli serve ...`: this Python, or torchrun and its options.
    The server gets a session of its own, so that `stop` also ends the processes it started
    (torchrun's ranks)."""

    def __init__(
        self,
        *args: str,
        api_key: str | None = None,
        startup_timeout_s: float = 180,
        launcher: tuple[str, ...] = (sys.executable,),
    ):
        self.port = free_port()
        self.api_key = api_key
        self.launcher = launcher
        self.log = tempfile.NamedTemporaryFile("w+", prefix="zcode-serve-", suffix=".log")
        command = [*launcher, "-m", "zcode.cli", "serve", *args, "--port", str(self.port)]
        if api_key:
            command += ["--api-key", api_key]
        self.proc = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True
        )
        self._wait_healthy(startup_timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"zcode serve exited {self.proc.returncode}:\n{self.output()}")
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"zcode serve not healthy after {timeout_s} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=self.api_key or "unused",
            max_retries=0,
            timeout=120,
            **kwargs,
        )

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=self.api_key or "unused",
            max_retries=0,
            timeout=300,
            **kwargs,
        )

    def connection(self, timeout_s: float = 120) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)

    def headers(self, auth: bool = True) -> dict:
        headers = {"Content-Type": "application/json"}
        if auth and self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def request(
        self,
        method: str,
        path: str,
        body: dict | str | bytes | None = None,
        headers: dict | None = None,
    ) -> tuple[int, dict | str]:
        """(status, JSON body or text) of one plain HTTP request."""
        conn = self.connection()
        try:
            if isinstance(body, dict):
                body = json.dumps(body)
            conn.request(
                method, path, body=body, headers=self.headers() if headers is None else headers
            )
            response = conn.getresponse()
            text = response.read().decode()
        finally:
            conn.close()
        try:
            return response.status, json.loads(text)
        except json.JSONDecodeError:
            return response.status, text

    def metrics(self) -> dict[str, float]:
        """Every sample on /metrics, keyed by name plus labels other than model_name."""
        status, text = self.request("GET", "/metrics")
        assert status == 200, text
        samples = {}
        for name, labels, value in re.findall(r"^([\w:]+)(?:\{(.*)\})? (\S+)$", text, re.M):
            labels = ",".join(
                part for part in labels.split(",") if part and not part.startswith("model_name=")
            )
            samples[f"{name}{{{labels}}}" if labels else name] = float(value)
        return samples

    def wait_idle(self, timeout_s: float = 30) -> dict[str, float]:
        """Polls /metrics until no request runs or waits; returns the last samples."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            idle = m["zcode:num_requests_running"] == 0 and m["zcode:num_requests_waiting"] == 0
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def terminate(self, timeout_s: float = 60) -> int:
        """SIGTERM, then the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def rank_pids(self) -> dict[int, int]:
        """{rank: pid} of the processes a torchrun launcher started (its children, RANK in
        their environment); {0: the server} without torchrun."""
        if self.launcher == (sys.executable,):
            return {0: self.proc.pid}
        pids = {}
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            for pid in (task / "children").read_text().split():
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                rank = next(v for v in env if v.startswith(b"RANK="))
                pids[int(rank[len(b"RANK=") :])] = int(pid)
        assert pids and sorted(pids) == list(range(len(pids))), pids
        return pids

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the server and all it started have exited
            pass
        self.proc.wait(30)
        self.log.close()

    def __enter__(self) -> "RemoteServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
