"""What the completion and chat endpoints share: the model, limits, prompt checks, SSE framing.

Context-length errors use vLLM's wording (clients detect overflow by the phrase "maximum context
length") and give the exact token counts.
"""

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import lru_cache

from zcode.engine.request_output import RequestOutput
from zcode.errors import ValidationError
from zcode.llm import LLM
from zcode.server.async_engine import AsyncEngine, EngineError, RequestStream
from zcode.server.protocol import ApiError

logger = logging.getLogger(__name__)


PLAN_FIELDS = ("max_latency_ms", "max_quality_loss", "quality", "max_kv_bytes", "experts_per_token")


@dataclass
class ServerState:
    llm: LLM
    engine: AsyncEngine
    model_name: str
    model_root: str
    created: int
    draining: bool = False  # SIGTERM arrived: no new generations
    num_inflight: int = 0  # generation requests whose response is not complete

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.llm.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.llm.engine.vocab_size

    def check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise ApiError(
                f"The model `{model}` does not exist.", 404, "NotFoundError", param="model"
            )

    def plan(self, req):
        """The plan for a request's planning hints (a harness.request_plans.Planned), None
        without any: it then runs the default plan with its own skips."""
        hints = req.hints()
        if not hints.limits() and hints.experts_per_token is None:
            return None
        param = next(name for name in PLAN_FIELDS if getattr(req, name) is not None)
        if self.engine.plans is None:
            need = (
                "a MoE model"
                if param == "experts_per_token"
                else "a server started with --sparsity ARTIFACT (zcode calibrate)"
            )
            raise ApiError(f"{param} needs {need}", param=param)
        try:
            return self.engine.plans.plan(hints)
        except ValidationError as e:
            raise ApiError(str(e), param=param) from None

    def require_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise ApiError("this model has no tokenizer: send token ids", param="prompt")

    def check_prompt(self, prompt_token_ids: list[int], max_tokens: int | None) -> None:
        """Raises ApiError for an empty prompt, unknown token ids or a context overflow."""
        if not prompt_token_ids:
            raise ApiError("the prompt must not be empty", param="prompt")
        bad = [t for t in prompt_token_ids if t >= self.vocab_size]
        if bad:
            raise ApiError(
                f"token id {bad[0]} is out of vocabulary (the vocabulary has "
                f"{self.vocab_size} tokens)",
                param="prompt",
            )
        limit, num_input = self.max_model_len, len(prompt_token_ids)
        if num_input >= limit:
            raise ApiError(
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {num_input} input tokens. Please reduce the length of the input messages.",
                param="input_tokens",
            )
        if max_tokens is not None and num_input + max_tokens > limit:
            raise ApiError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                f"model's maximum context length is {limit} tokens and your request has "
                f"{num_input} input tokens ({max_tokens} > {limit} - {num_input}).",
                param="max_tokens",
            )

    def check_logit_bias(self, logit_bias: dict[str, float] | None) -> None:
        bad = [t for t in logit_bias or {} if int(t) >= self.vocab_size]
        if bad:
            raise ApiError(
                f"logit_bias token id {bad[0]} is out of vocabulary (the vocabulary has "
                f"{self.vocab_size} tokens)",
                param="logit_bias",
            )

    def token_str(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return _decode_one(self.tokenizer, token_id)


@lru_cache(maxsize=1 << 16)
def _decode_one(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def openai_object(
    kind: str, request_id: str, created: int, model: str, choices: list[dict], usage_stats=None
) -> dict:
    """The envelope every completion object and streamed chunk shares."""
    body = {
        "id": request_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage_stats is not None:
        body["usage"] = usage_stats
    return body


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


def sse(payload: dict | str) -> str:
    data = (
        payload
        if isinstance(payload, str)
        else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    )
    return f"data: {data}\n\n"


def error_body(message: str, type: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def stream_error(e: BaseException) -> str:
    """An error after the stream began is sent in-band, as vLLM does."""
    if isinstance(e, ApiError):
        return sse(error_body(e.message, e.type, e.status, e.param))
    if isinstance(e, EngineError):
        return sse(error_body(str(e), "InternalServerError", 500))
    logger.error("streaming failed", exc_info=e)
    return sse(error_body("internal server error", "InternalServerError", 500))


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yields (choice index, output) from several request streams as outputs arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                index = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                yield index, out
                if not out.finished:
                    pending[asyncio.ensure_future(anext(streams[index]))] = index
    finally:
        for task in pending:
            task.cancel()


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """Waits for every stream to finish; returns the last output of each, in order."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for index, out in merge(streams):
        finals[index] = out
    return finals  # type: ignore[return-value]
