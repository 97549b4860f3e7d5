"""The engine loop in a thread of its own, apart from the HTTP event loop.

HTTP handlers never touch `LLMEngine`: they send commands (add, abort) through a queue that only
the engine thread reads, and each request receives its outputs on an asyncio queue of its own,
filled from the engine thread with `call_soon_threadsafe`. So the engine needs no locks, and a
slow client never blocks a step. The engine thread catches everything: a request the engine
rejects fails alone, as does one the engine finishes with reason "error"; should a whole step
raise, the requests of that batch fail and the loop goes on. A `RankFailure` (another process of
a tensor-parallel launch died or hung) ends the loop: every request fails with it, and the
engine reports itself dead (`error`), which `zcode serve` turns into a non-zero exit.
"""

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

from zcode.engine.llm_engine import LLMEngine
from zcode.engine.request_output import RequestOutput
from zcode.errors import RankFailure
from zcode.sampling_params import SamplingParams
from zcode.server.metrics import Metrics

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while running a request (not the request's fault)."""


@dataclass(eq=False)
class RequestStream:
    """One request's outputs, as the HTTP side sees them."""

    request_id: str
    num_prompt_tokens: int
    loop: asyncio.AbstractEventLoop
    planned: object = None  # a harness.request_plans.Planned (planning hints), run by `plans`
    cache_salt: str | None = None  # the client's prefix-cache salt
    skip_layers: tuple[int, ...] = ()  # decoder layers the request never runs
    skip_kv_heads: tuple[tuple[int, int], ...] = ()  # (layer, KV head) pairs it never reads
    plan: object = None  # the ExecutionPlan it runs (None: the engine's default)
    arrival_time: float = field(default_factory=time.monotonic)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    admitted: asyncio.Future | None = None
    last: RequestOutput | None = None
    # Written by the engine thread only.
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        if item is _ABORTED:
            item = self._aborted()
        self.last = item
        if item.finish_reason == "error":  # the engine isolated a failure in this request
            raise EngineError("the engine failed while running this request")
        return item

    def _aborted(self) -> RequestOutput:
        if self.last is None:
            return RequestOutput(self.request_id, [], "", [], True, "abort", delta_token_ids=[])
        return replace(
            self.last, finished=True, finish_reason="abort", delta_text="", delta_token_ids=[]
        )


_ABORTED = object()  # the server aborted the request (shutdown): end the stream with "abort"


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: Metrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.error: BaseException | None = None  # set if the engine thread itself died
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, name="zcode-engine", daemon=True
        )
        self._running = False
        self.plans = None  # harness.request_plans.RequestPlans: with --sparsity, or for a MoE

    @property
    def is_alive(self) -> bool:
        return self._running and self.error is None

    def start(self) -> None:
        """Runs the engine loop in a thread of its own (a no-op after `claim_caller_thread`)."""
        if self._thread is not None:
            self._running = True
            self._thread.start()

    def claim_caller_thread(self) -> None:
        """The loop will run in the thread that calls `run()` instead of a thread of its own.

        torch ops that open OpenMP parallel regions cost ~4x more per call from a non-main thread
        (a 1536x576 GEMV: 35 -> 132 us here), so `zcode serve` steps the engine on the main
        thread and serves HTTP from another.
        """
        self._thread = None
        self._running = True

    def run(self) -> None:
        """The engine loop, in the calling thread, until `stop()`."""
        assert self._thread is None, "call claim_caller_thread() first"
        self._run()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._commands.put(("stop",))
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout_s)

    @asynccontextmanager
    async def requests(
        self,
        jobs: list[tuple[list[int], SamplingParams, str]],
        planned=None,
        cache_salt: str | None = None,
        skip_layers: tuple[int, ...] = (),
        skip_kv_heads: tuple[tuple[int, int], ...] = (),
        plan=None,
    ) -> AsyncIterator[list[RequestStream]]:
        """Admits (prompt_token_ids, params, request_id) jobs together and yields their streams.

        Requests share prefix-cache blocks only with requests of the same `cache_salt` and plan.

        Raises the first error `LLMEngine.add_request` raised (a ValidationError for bad input),
        after aborting the others; leaving the block early aborts every unfinished request.
        """
        if not self.is_alive:
            raise EngineError("the engine is not running")
        loop = asyncio.get_running_loop()
        streams = []
        for prompt_token_ids, params, request_id in jobs:
            stream = RequestStream(
                request_id,
                len(prompt_token_ids),
                loop,
                planned,
                cache_salt,
                skip_layers,
                skip_kv_heads,
                plan,
            )
            stream.admitted = loop.create_future()
            self._commands.put(("add", stream, list(prompt_token_ids), params))
            streams.append(stream)
        try:
            results = await asyncio.gather(*(s.admitted for s in streams), return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            yield streams
        finally:
            for stream in streams:
                if not stream.finished:
                    self.abort(stream.request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, False))

    def abort_all(self) -> None:
        """Aborts every request; their streams end with finish_reason "abort"."""
        self._commands.put(("abort_all",))

    # --- engine thread ---

    def _run(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished()
                if not self._handle_commands(block):
                    break
                if self.engine.has_unfinished():
                    self._step()
                self._publish_stats()
        except BaseException as e:  # a bug in this loop, or RankFailure: fail every request
            logger.exception("engine thread died")
            self.error = e
            for stream in self._streams.values():
                self._send(stream, EngineError(f"engine failed: {e}"))
            self._streams.clear()
        finally:
            self._running = False

    def _handle_commands(self, block: bool) -> bool:
        while True:
            try:
                # A bounded wait keeps the loop responsive to signals when it owns the main thread.
                command = self._commands.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return True
            block = False
            kind = command[0]
            if kind == "stop":
                return False
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort":
                self._abort(command[1], notify=command[2])
            elif kind == "abort_all":
                for request_id in list(self._streams):
                    self._abort(request_id, notify=True)

    def _add(self, stream: RequestStream, prompt_token_ids: list[int], params) -> None:
        try:
            self.engine.add_request(
                prompt_token_ids,
                params,
                stream.request_id,
                stream.cache_salt,
                skip_layers=stream.skip_layers,
                skip_kv_heads=stream.skip_kv_heads,
                plan=stream.plan,
            )
        except Exception as e:  # ValidationError for bad input; anything else fails this request
            stream.loop.call_soon_threadsafe(_resolve, stream.admitted, e)
            return
        self._streams[stream.request_id] = stream
        if stream.planned is not None:
            self.plans.admit(stream.request_id, stream.planned)
        stream.loop.call_soon_threadsafe(_resolve, stream.admitted, None)

    def _abort(self, request_id: str, notify: bool) -> None:
        self.engine.abort(request_id)
        if self.plans is not None:
            self.plans.forget(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            if notify:
                self._send(stream, _ABORTED)
            if self.metrics is not None:
                self.metrics.request_finished(stream, "abort", time.monotonic())

    def _step(self) -> None:
        try:
            start = time.perf_counter()
            outputs = self.engine.step()
            if self.plans is not None:
                self.plans.after_step(outputs, 1e3 * (time.perf_counter() - start))
        except RankFailure:  # the ranks no longer agree: no request can run, the loop ends
            raise
        except Exception as e:
            logger.exception("engine step failed; failing the requests it ran")
            scheduler = self.engine.scheduler
            # A step that failed before running anything would fail again on the same queue:
            # then the waiting requests fail too, rather than the loop retrying them forever.
            failed = [seq.request_id for seq in scheduler.running or scheduler.waiting]
            for request_id in failed:
                self.engine.abort(request_id)
                if self.plans is not None:
                    self.plans.forget(request_id)
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    self._send(stream, EngineError(f"the engine failed on this request: {e}"))
            return
        now = time.monotonic()
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if self.metrics is not None:
                self.metrics.tokens_generated(stream, out, now)
            if out.finished:
                del self._streams[out.request_id]
                if self.metrics is not None:
                    self.metrics.request_finished(stream, out.finish_reason, now, out.stop_reason)
            by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)

    def _send(self, stream: RequestStream, item) -> None:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _publish_stats(self) -> None:
        if self.metrics is None:
            return
        try:
            self.metrics.engine_stats(self.engine.stats())
        except Exception:  # metrics must never stop the engine
            logger.exception("reading engine stats failed")


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the waiting handler was cancelled meanwhile
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _deliver(items: list) -> None:
    for q, out in items:
        q.put_nowait(out)
