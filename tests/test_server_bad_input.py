"""Bad input never gets a 500 or leaves a traceback in the log.

Generated cases: lone UTF-16 surrogates in every string a request can carry, every field of the
request bodies given every wrong type, huge and deeply nested bodies, broken JSON and headers.
The real engine (SmolLM2-135M, a 128-token context) serves them under uvicorn in this process, so
every log record, uvicorn's included, is captured. A case passes when its status is not 5xx; the
module ends by checking that no record carried a traceback or reached ERROR over all cases.
"""

import http.client
import json
import logging

import pytest
from remote_server import InThreadServer

from zcode.server.app import build_app
from zcode.server.async_engine import AsyncEngine
from zcode.server.metrics import Metrics
from zcode.server.protocol import ChatCompletionRequest, CompletionRequest
from zcode.server.serving import ServerState

API_KEY = "k"
MODEL = "m"
AUTH = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
USER = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL, "messages": USER, "max_tokens": 1}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
SURROGATES = ["\ud800", "\udfff", "a\udc00b", "\udc00\ud800"]
WRONG_VALUES = [None, "x", -1, 1.5, True, [], {}, [1, "a"], {"a": [1]}, 10**40, "\ud800"]


def _with(body: dict, path: tuple, value) -> dict:
    """A deep copy of body with the value at path (keys and indexes) replaced."""
    body = json.loads(json.dumps(body))
    node = body
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return body


def _nested(depth: int, leaf="x") -> list:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def _surrogate_cases() -> list[tuple[str, str, object]]:
    chat = {**CHAT, "tools": [TOOL]}
    assistant_call = {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "c", "type": "function",
                        "function": {"name": "f", "arguments": '{"a": "b"}'}}],
    }  # fmt: skip
    conversation = [
        {"role": "system", "content": "s"}, {"role": "user", "content": "u"}, assistant_call,
        {"role": "tool", "tool_call_id": "c", "content": "r"},
        {"role": "assistant", "content": "a", "reasoning": "r"},
        {"role": "user", "content": [{"type": "text", "text": "t"}]},
    ]  # fmt: skip
    long_chat = {**chat, "messages": conversation}
    places = [
        ("/v1/completions", COMPLETION, ("prompt",)),
        ("/v1/completions", {**COMPLETION, "prompt": ["a", "b"]}, ("prompt", 1)),
        ("/v1/completions", COMPLETION, ("model",)),
        ("/v1/completions", {**COMPLETION, "stop": ["a"]}, ("stop", 0)),
        ("/v1/completions", COMPLETION, ("user",)),
        ("/v1/completions", {**COMPLETION, "guided_choice": ["a"]}, ("guided_choice", 0)),
        ("/v1/completions", COMPLETION, ("guided_regex",)),
        ("/v1/chat/completions", long_chat, ("messages", 0, "content")),
        ("/v1/chat/completions", long_chat, ("messages", 1, "content")),
        ("/v1/chat/completions", long_chat, ("messages", 2, "tool_calls", 0, "function", "name")),
        ("/v1/chat/completions", long_chat,
         ("messages", 2, "tool_calls", 0, "function", "arguments")),
        ("/v1/chat/completions", long_chat, ("messages", 3, "content")),
        ("/v1/chat/completions", long_chat, ("messages", 4, "reasoning")),
        ("/v1/chat/completions", long_chat, ("messages", 5, "content", 0, "text")),
        ("/v1/chat/completions", long_chat, ("messages", 1, "role")),
        ("/v1/chat/completions", long_chat, ("messages", 1, "name")),
        ("/v1/chat/completions", chat, ("model",)),
        ("/v1/chat/completions", chat, ("tools", 0, "function", "name")),
        ("/v1/chat/completions", chat, ("tools", 0, "function", "description")),
        ("/v1/chat/completions", {**chat, "tool_choice": {"type": "function",
                                                          "function": {"name": "f"}}},
         ("tool_choice", "function", "name")),
        ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"a": "b"}},
         ("chat_template_kwargs", "a")),
        ("/v1/chat/completions", {**CHAT, "response_format": {
            "type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": ["a"]}}}},
         ("response_format", "json_schema", "schema", "enum", 0)),
        ("/tokenize", {"prompt": "a"}, ("prompt",)),
        ("/tokenize", {"messages": USER}, ("messages", 0, "content")),
        ("/detokenize", {"tokens": [1], "model": MODEL}, ("model",)),
    ]  # fmt: skip
    cases = []
    for path, body, where in places:
        for s in SURROGATES:
            name = f"surrogate {ascii(s)} in {path} {'.'.join(map(str, where))}"
            cases.append((name, path, _with(body, where, s)))
    cases.append(("surrogate as a body key", "/v1/completions", {**COMPLETION, "\ud800": 1}))
    return cases


def _wrong_type_cases() -> list[tuple[str, str, object]]:
    cases = []
    for path, model, base in [
        ("/v1/completions", CompletionRequest, COMPLETION),
        ("/v1/chat/completions", ChatCompletionRequest, CHAT),
    ]:
        for field in model.model_fields:
            for value in WRONG_VALUES:
                if field in ("max_tokens", "max_completion_tokens") and value is None:
                    continue  # valid, and a generation to the end of the context
                name = f"{path} {field}={ascii(value)[:20]}"
                cases.append((name, path, {**base, field: value}))
    for i, value in enumerate(WRONG_VALUES + [{"role": "user"}, {"content": "x"}]):
        cases.append((f"chat message #{i} {ascii(value)[:20]}", "/v1/chat/completions",
                      {**CHAT, "messages": [value]}))  # fmt: skip
    return cases


def _shape_cases() -> list[tuple[str, str, object]]:
    deep_schema = {"type": "string"}
    for _ in range(400):
        deep_schema = {"type": "object", "properties": {"a": deep_schema}, "required": ["a"]}
    deep_dict: dict = {}
    for _ in range(400):
        deep_dict = {"a": deep_dict}
    return [
        ("nested 100000 deep", "/v1/chat/completions",
         '{"max_tokens": 1, "messages": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        ("nested content 400 deep", "/v1/chat/completions",
         {**CHAT, "messages": [{"role": "user", "content": _nested(400)}]}),
        ("nested schema 400 deep", "/v1/chat/completions", {**CHAT, "response_format": {
            "type": "json_schema", "json_schema": {"name": "n", "schema": deep_schema}}}),
        ("nested template kwargs", "/v1/chat/completions",
         {**CHAT, "chat_template_kwargs": deep_dict}),
        ("nested tool parameters", "/v1/chat/completions",
         {**CHAT, "tools": [{"type": "function", "function": {
             "name": "f", "parameters": {"type": "object", "properties": {"a": deep_schema}}}}],
          "tool_choice": "required"}),
        ("nested guided_json", "/v1/completions", {**COMPLETION, "guided_json": deep_schema}),
        ("self-referencing schema", "/v1/completions",
         {**COMPLETION, "guided_json": {"$ref": "#"}}),
        ("bad regex", "/v1/completions", {**COMPLETION, "guided_regex": "(["}),
        ("bad lark", "/v1/completions", {**COMPLETION, "structured_outputs": {"grammar": "x:"}}),
        ("huge prompt", "/v1/completions", {**COMPLETION, "prompt": "word " * 150_000}),
        ("body over the limit", "/v1/completions", {**COMPLETION, "prompt": "a" * (2 << 20)}),
        ("many messages", "/v1/chat/completions", {**CHAT, "messages": USER * 20_000}),
        ("many stop strings", "/v1/completions", {**COMPLETION, "stop": ["a"] * 10_000}),
        ("many logit_bias entries", "/v1/completions",
         {**COMPLETION, "logit_bias": {str(i): 1 for i in range(40_000)}}),
        ("huge token id list", "/v1/completions", {**COMPLETION, "prompt": [1] * 100_000}),
        ("huge skip_layers", "/v1/completions", {**COMPLETION, "skip_layers": [0] * 2000}),
        ("Infinity", "/v1/completions", '{"prompt": "a", "temperature": Infinity}'),
        ("NaN", "/v1/completions", '{"prompt": "a", "top_p": NaN}'),
        ("-Infinity penalty", "/v1/completions", '{"prompt": "a", "presence_penalty": -Infinity}'),
        ("NaN logit_bias", "/v1/completions", '{"prompt": "a", "logit_bias": {"1": NaN}}'),
        ("invalid UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}'),
        ("empty body", "/v1/completions", b""),
        ("null body", "/v1/completions", "null"),
        ("list body", "/v1/chat/completions", "[]"),
        ("number body", "/v1/chat/completions", "1"),
        ("truncated JSON", "/v1/chat/completions", '{"messages": [{"role": "user", "con'),
        ("huge integer", "/v1/completions", '{"prompt": "a", "seed": ' + "9" * 5000 + "}"),
        ("template that tries an escape", "/v1/chat/completions",
         {**CHAT, "chat_template_kwargs": {"x": "{{ ''.__class__ }}"}}),
        ("tokenize both inputs", "/tokenize", {"prompt": "a", "messages": USER}),
        ("detokenize huge id", "/detokenize", {"tokens": [10**30]}),
        ("detokenize negative id", "/detokenize", {"tokens": [-1]}),
        ("echo with max_tokens 0 and logprobs", "/v1/completions",
         {**COMPLETION, "echo": True, "max_tokens": 0, "logprobs": 20, "prompt_logprobs": 20}),
        ("stream with n", "/v1/chat/completions",
         {**CHAT, "stream": True, "n": 3, "logprobs": True, "top_logprobs": 20}),
    ]  # fmt: skip


CASES = _surrogate_cases() + _wrong_type_cases() + _shape_cases()
HEADER_CASES = {
    "no key": {"Content-Type": "application/json"},
    "lowercase scheme": {"Content-Type": "application/json", "Authorization": "bearer k"},
    "no scheme": {"Content-Type": "application/json", "Authorization": "k"},
    "scheme only": {"Content-Type": "application/json", "Authorization": "Bearer"},
    "non-ASCII key": {"Content-Type": "application/json", "Authorization": "Bearer kä".encode()},
    "wrong content type": {"Content-Type": "text/plain", "Authorization": "Bearer k"},
    "no content type": {"Authorization": "Bearer k"},
}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.bad: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or record.levelno >= logging.ERROR:
            self.bad.append(record)


@pytest.fixture(scope="module")
def server():
    from zcode.llm import LLM

    records = _Records()
    loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.error", "uvicorn.access")]
    for logger in loggers:
        logger.addHandler(records)
    llm = LLM(None, max_model_len=128, kv_cache_bytes=16 << 20)
    state = ServerState(llm, AsyncEngine(llm.engine, Metrics(MODEL)), MODEL, MODEL, 0)
    served = InThreadServer(build_app(state, API_KEY, protect_metrics=True))
    yield served, records
    served.stop()
    for logger in loggers:
        logger.removeHandler(records)


def post(served, path: str, body, headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=120)
    try:
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        conn.request("POST", path, body=body, headers=AUTH if headers is None else headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_there_are_enough_cases():
    assert len(CASES) + len(HEADER_CASES) >= 150


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_no_500(server, case):
    served, _ = server
    _, path, body = case
    status, text = post(served, path, body)
    assert status < 500, text[:300]
    if status >= 400:
        error = json.loads(text)["error"]
        assert error["code"] == status and isinstance(error["message"], str)


@pytest.mark.parametrize("name", list(HEADER_CASES))
def test_headers(server, name):
    served, _ = server
    status, _ = post(served, "/v1/completions", json.dumps(COMPLETION), HEADER_CASES[name])
    expected = {"lowercase scheme": 200, "wrong content type": 400, "no content type": 400}
    assert status == expected.get(name, 401)


def test_metrics_need_the_key_when_protected(server):
    served, _ = server
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    for headers, status in [({}, 401), (AUTH, 200)]:
        conn.request("GET", "/metrics", headers=headers)
        response = conn.getresponse()
        response.read()
        assert response.status == status
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200


def test_zz_no_traceback_was_logged(server):
    """Defined last, so it runs last: the log of every case above."""
    _, records = server
    assert [f"{r.name}: {r.getMessage()[:200]}" for r in records.bad] == []
