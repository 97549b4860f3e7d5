"""`zcode serve`: load the model, serve HTTP with uvicorn, and shut down gracefully.

SIGTERM does not close the listening socket at once (uvicorn's default, which turns new requests
into connection errors): it starts a drain. New generations get 503, in-flight ones may finish
for up to `shutdown_timeout_s`, what is still running then is aborted (its clients see
finish_reason "abort"), and the process exits 0. A second SIGTERM, or Ctrl-C, stops at once.

Start-up takes the port first (a port in use is a clear error before minutes of model loading),
then loads the model, then builds the C++ kernels (a first build takes tens of seconds, which
the first request would otherwise wait for), and only then serves: `/health` answers 200 once
the server can answer requests without delay.

Under torchrun with `--tensor-parallel-size N` (zcode.distributed), rank 0 is the server above;
the other ranks serve no HTTP and follow rank 0's forward passes. Rank 0 reports healthy once
every rank has loaded its shard and built its kernels; a SIGTERM drains on rank 0, which then
stops the others, and all exit 0. A rank that dies or hangs makes rank 0's next collective
raise `RankFailure` (within `--collective-timeout-s` for a hang): every request fails with it
(HTTP 500 naming the failure) and `zcode serve` exits 1; a rank that loses rank 0 exits 1 too.
"""

import asyncio
import logging
import signal
import socket
import threading
import time
from pathlib import Path

import uvicorn

from zcode.distributed.config import ParallelConfig
from zcode.distributed.group import launch_rank, launch_world_size
from zcode.errors import ValidationError
from zcode.llm import LLM
from zcode.loader.checkpoint import DEFAULT_MODEL_FILE, resolve_model_path
from zcode.server.app import build_app
from zcode.server.async_engine import AsyncEngine
from zcode.server.metrics import Metrics
from zcode.server.serving import ServerState

logger = logging.getLogger("zcode.server")

ABORT_GRACE_S = 2.0  # after aborting, how long aborted responses get to reach their clients


def default_model_name(model: str | None) -> str:
    if model is None:
        return DEFAULT_MODEL_FILE.split(".")[0]
    return model


def build_state(
    model: str | None,
    served_model_name: str | None,
    engine_args: dict,
    chat_template: str | None = None,
) -> ServerState:
    """Loads the model and wires the engine thread, metrics and server state together.

    chat_template: the Jinja source that replaces the checkpoint's own template.
    """
    llm = LLM(model, **engine_args)
    if chat_template is not None:
        if llm.tokenizer is None:
            raise ValidationError("a chat template needs a tokenizer; this model has none")
        llm.tokenizer.chat_template = chat_template
    name = served_model_name or default_model_name(model)
    engine = AsyncEngine(llm.engine, Metrics(name))
    if llm.engine.executor is not None:  # an artifact, or a MoE (experts per token)
        from zcode.harness.request_plans import RequestPlans

        engine.plans = RequestPlans.for_llm(llm)
    root = str(Path(resolve_model_path(model)).resolve())
    return ServerState(llm, engine, name, root, int(time.time()))


def run_server(
    model: str | None,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_request_bytes: int = 1 << 20,
    shutdown_timeout_s: float = 30.0,
    engine_args: dict | None = None,
    protect_metrics: bool = False,
    chat_template: str | None = None,
) -> None:
    """protect_metrics: /metrics and /version need the API key too; chat_template: Jinja source
    used instead of the checkpoint's template."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine_args = engine_args or {}
    _check_launch(engine_args)
    if launch_rank() > 0:
        follow_rank_0(model, engine_args)
        return
    sock = listening_socket(host, port)
    try:
        state = build_state(model, served_model_name, engine_args, chat_template)
        build_kernels()
    except BaseException:
        sock.close()
        raise
    app = build_app(state, api_key, max_request_bytes, protect_metrics)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="info", access_log=False, timeout_graceful_shutdown=5
    )
    logger.info(
        "serving %s (max_model_len %d) on http://%s:%d",
        state.model_name,
        state.max_model_len,
        host,
        sock.getsockname()[1],
    )
    server = _GracefulServer(config, state, shutdown_timeout_s)
    # The engine steps on the main thread (see AsyncEngine.claim_caller_thread); uvicorn serves
    # from a second thread, which does not install signal handlers, so we forward them.
    state.engine.claim_caller_thread()
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="zcode-http")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.handle_exit)
    http.start()
    state.engine.run()  # returns when the app's shutdown stops the engine, or if it dies
    server.should_exit = True
    http.join()
    if state.engine.error is not None:  # e.g. RankFailure: exit non-zero, saying why
        raise state.engine.error


def _check_launch(engine_args: dict) -> None:
    """Under torchrun, the launch's processes must be the ones the model is split over (else
    every process would load the whole model and try to take the port)."""
    parallel = engine_args.get("parallel", ParallelConfig())
    if launch_world_size() > 1 and not parallel.is_distributed:
        raise ValidationError(
            f"this torchrun launch has {launch_world_size()} processes: serve one model over "
            f"them with --tensor-parallel-size {launch_world_size()}, or start zcode serve "
            "without torchrun"
        )


def follow_rank_0(model: str | None, engine_args: dict) -> None:
    """A rank other than 0 of a tensor-parallel server: no HTTP; it loads its shard and runs
    rank 0's forward passes until rank 0 stops, then exits 0 (inside `LLM`), or raises
    RankFailure if rank 0 dies.

    SIGTERM (torchrun forwards it to every rank) is ignored: rank 0 drains its requests, which
    needs this rank's collectives, and then tells it to stop.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    build_kernels()  # before the handshake in LLM(), so that rank 0 is ready only once we are
    LLM(model, **engine_args)


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) and listening; a ValidationError if it cannot be had."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise ValidationError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        hint = " (is another server running there?)" if "in use" in str(e.strerror) else ""
        raise ValidationError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None
    sock.set_inheritable(True)
    return sock


def build_kernels() -> None:
    """Builds (or loads the cached build of) the C++ kernels now rather than on first use."""
    from zcode.kernels.cpp_build import build_all, describe

    logger.info("C++ kernels: %s", describe(build_all()))


class _GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout_s: float):
        super().__init__(config)
        self.state = state
        self.shutdown_timeout_s = shutdown_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and not self.state.draining and self._loop is not None:
            self.state.draining = True
            self._loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        state = self.state
        logger.info(
            "SIGTERM: refusing new requests, waiting up to %.1f s for %d in flight",
            self.shutdown_timeout_s,
            state.num_inflight,
        )
        await _wait_idle(state, self.shutdown_timeout_s)
        if state.num_inflight:
            logger.warning("aborting %d requests still in flight", state.num_inflight)
            state.engine.abort_all()
            await _wait_idle(state, ABORT_GRACE_S)
        self.should_exit = True


async def _wait_idle(state: ServerState, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while state.num_inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
