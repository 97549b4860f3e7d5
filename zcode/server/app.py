"""The FastAPI application: routes, the request gate, and the one place errors become HTTP.

Every error leaves as `{"error": {"message", "type", "param", "code"}}`: user mistakes
(pydantic validation, `ApiError`, the engine's `ValidationError`) are 400 (404 for an unknown
model), and only our own failures are 500. The gate in front of the routes checks the API key
(`Authorization: Bearer KEY`, the scheme in any case, as HTTP allows), caps the request body,
refuses a body holding a lone UTF-16 surrogate (JSON can escape one, `"\\ud800"`, but it is not
Unicode and nothing downstream can encode it), refuses new generations while the server drains
(503), and counts the generations in flight so that shutdown knows when they are done.

`/health` is always open; `/metrics` and `/version` are open too unless `protect_metrics` (as in
vLLM, where scrapers read them without the key).
"""

import asyncio
import hmac
import json
import logging
from contextlib import asynccontextmanager, suppress
from importlib import metadata

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from zcode.chat.messages import normalize_messages
from zcode.errors import ValidationError
from zcode.server.async_engine import EngineError
from zcode.server.chat import Chat
from zcode.server.completions import Completions
from zcode.server.metrics import CONTENT_TYPE
from zcode.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from zcode.server.serving import ServerState, error_body

logger = logging.getLogger(__name__)

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
ALWAYS_OPEN_PATHS = ("/health",)
SCRAPER_PATHS = ("/metrics", "/version")


def build_app(
    state: ServerState,
    api_key: str | None = None,
    max_request_bytes: int = 1 << 20,
    protect_metrics: bool = False,
) -> FastAPI:
    """protect_metrics: /metrics and /version need the API key too (when there is one)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not state.engine.is_alive:
            state.engine.start()
        yield
        state.engine.stop()

    app = FastAPI(title="ZCode", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.zcode = state
    completions, chat = Completions(state), Chat(state)
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.is_alive:
            return _error("the engine is not running", "ServiceUnavailableError", 503)
        if state.draining:
            return _error("the server is shutting down", "ServiceUnavailableError", 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": metadata.version("zcode")}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(state)]}

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        return await _generate(request, completions.create(body))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        return await _generate(request, chat.create(body))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        state.check_model(body.model)
        state.require_tokenizer()
        tokens = await asyncio.to_thread(_tokenize, state, body)  # templates render off the loop
        result = {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens}
        if body.return_token_strs:
            result["token_strs"] = state.tokenizer.convert_ids_to_tokens(tokens)
        return result

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        state.check_model(body.model)
        state.require_tokenizer()
        bad = [t for t in body.tokens if t >= state.vocab_size]
        if bad:
            raise ApiError(f"token id {bad[0]} is out of vocabulary", param="tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        state.require_tokenizer()
        tok = state.tokenizer
        return {
            "tokenizer_class": type(tok).__name__,
            "eos_token": tok.eos_token,
            "bos_token": tok.bos_token,
            "pad_token": tok.pad_token,
            "unk_token": tok.unk_token,
            "chat_template": getattr(tok, "chat_template", None),
            "model_max_length": state.max_model_len,
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        registry = state.engine.metrics
        return Response(registry.render() if registry else b"", media_type=CONTENT_TYPE)

    open_paths = ALWAYS_OPEN_PATHS + (() if protect_metrics else SCRAPER_PATHS)
    return _Gate(app, state, api_key, max_request_bytes, open_paths)


def _tokenize(state: ServerState, body: TokenizeRequest) -> list[int]:
    if body.messages is None:
        return state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    text = state.llm.apply_chat_template(
        normalize_messages(body.messages), add_generation_prompt=body.add_generation_prompt
    )
    return state.tokenizer.encode(text, add_special_tokens=False)


def _model_card(state: ServerState) -> dict:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "zcode",
        "root": state.model_root,
        "parent": None,
        "max_model_len": state.max_model_len,
    }


async def _generate(request: Request, work):
    """Runs a generation handler, cancelling it (and so aborting its requests) on disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with suppress(asyncio.CancelledError, Exception):
            await task
        return Response(status_code=499)  # the client is gone; nobody reads this
    result = task.result()
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream")


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _error(message: str, type: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, status, param), status_code=status)


def _describe(errors: list[dict]) -> tuple[str, str | None]:
    """One message for pydantic's errors, naming the field; (message, param)."""
    if not errors:
        return "invalid request", None
    # A union field reports one error per member; the one that is not a type mismatch says most.
    error = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
    if error["type"] == "json_invalid":
        return f"the request body is not valid JSON: {error.get('ctx', {}).get('error', '')}", None
    if isinstance(error.get("input"), bytes):
        return "the request body must be a JSON object (Content-Type: application/json)", None
    loc = [str(p) for p in error.get("loc", ()) if p != "body" and not _is_union_tag(p)]
    message = error.get("msg", "invalid value").removeprefix("Value error, ")
    if loc:
        message = f"{'.'.join(loc)}: {message}"
    if "input" in error and not isinstance(error["input"], (dict, list)):
        message += f" (got {error['input']!r})"
    return message, loc[0] if loc else None


def _is_union_tag(part) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return _error(e.message, e.type, e.status, e.param)

    @app.exception_handler(ValidationError)
    async def validation_error(_, e: ValidationError):
        return _error(str(e), "BadRequestError", 400, getattr(e, "param", None))

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(_, e: RequestValidationError):
        message, param = _describe(e.errors())
        return _error(message, "BadRequestError", 400, param)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        type = "NotFoundError" if e.status_code == 404 else "BadRequestError"
        return _error(str(e.detail), type, e.status_code)

    @app.exception_handler(EngineError)
    async def engine_error(_, e: EngineError):
        return _error(str(e), "InternalServerError", 500)

    @app.exception_handler(Exception)
    async def internal_error(_, e: Exception):
        logger.exception("unhandled error")
        return _error("internal server error", "InternalServerError", 500)


class _Gate:
    """ASGI middleware: API key, body size, admission during drain, in-flight count."""

    def __init__(
        self,
        app,
        state: ServerState,
        api_key: str | None,
        max_request_bytes: int,
        open_paths: tuple[str, ...] = ALWAYS_OPEN_PATHS,
    ):
        self.app, self.state = app, state
        self.api_key, self.max_request_bytes = api_key, max_request_bytes
        self.open_paths = open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        headers = dict(scope["headers"])
        if self.api_key and path not in self.open_paths:
            if not _authorized(headers.get(b"authorization", b""), self.api_key):
                await _send(send, _error("invalid or missing API key", "AuthenticationError", 401))
                return
        generates = path in GENERATE_PATHS
        if generates and self.state.draining:
            await _send(send, _error("the server is shutting down", "ServiceUnavailableError", 503))
            return
        body = await self._read_body(receive, headers)
        if body is None:
            message = f"the request body is larger than {self.max_request_bytes} bytes"
            await _send(send, _error(message, "RequestTooLargeError", 413))
            return
        if _has_lone_surrogate(body):
            message = (
                "the request holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                "escape), which is not valid Unicode"
            )
            await _send(send, _error(message, "BadRequestError", 400))
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        if generates:
            self.state.num_inflight += 1
        try:
            await self.app(scope, replay, send)
        finally:
            if generates:
                self.state.num_inflight -= 1

    async def _read_body(self, receive, headers: dict) -> bytes | None:
        """The whole body, or None if it exceeds the limit."""
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_request_bytes:
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b""  # the client left; the app sees the disconnect next
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _authorized(header: bytes, api_key: str) -> bool:
    scheme, _, token = header.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), api_key.encode())


def _has_lone_surrogate(body: bytes) -> bool:
    """True if the JSON body escapes a surrogate that is not half of a pair."""
    if b"\\ud" not in body.lower():
        return False  # the common case: no surrogate escape at all, nothing parsed
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return False  # not JSON: the route's own parsing says so
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    except RecursionError:
        return False
    return False


async def _send(send, response: Response) -> None:
    start = {"type": "http.response.start", "status": response.status_code}
    await send({**start, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})
