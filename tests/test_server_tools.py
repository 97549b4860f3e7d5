"""Forced tool calls with a real model: `tool_choice` "required" or named always yields calls
whose arguments validate against the tool's schema, because a grammar constrains them.

SmolLM2-135M knows nothing of GLM tool calls, so only the grammar can make it write valid ones;
its own chat template is swapped for a GLM-4.7-shaped one. The app runs under uvicorn in this
process with the real engine thread; and (slow) as `zcode serve --chat-template` over two
tensor-parallel torchrun ranks, which must pass the same checks.
"""

import json

import openai
import pytest
from remote_server import LAYOUTS, InThreadServer, launch
from test_server_chat import GLM47_LIKE

from zcode.server.app import build_app
from zcode.server.async_engine import AsyncEngine
from zcode.server.metrics import Metrics
from zcode.server.serving import ServerState

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "unit": {"type": "string", "enum": ["C", "F"]},
                    "hourly": {"type": "boolean"},
                },
                "required": ["city", "days"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "convert",
            "parameters": {
                "type": "object",
                "properties": {
                    "amounts": {"type": "array", "items": {"type": "number"}, "maxItems": 3}
                },  # fmt: skip
                "required": ["amounts"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for 2 days?"}]


def check_arguments(name: str, arguments: str) -> None:
    """The arguments against the tool's schema (the constructs the schemas above use)."""
    schema, value = SCHEMAS[name], json.loads(arguments)
    assert isinstance(value, dict) and set(schema["required"]) <= set(value) <= set(
        schema["properties"]
    )
    types = {"string": str, "integer": int, "boolean": bool, "array": list, "number": (int, float)}
    for key, item in value.items():
        sub = schema["properties"][key]
        assert isinstance(item, types[sub["type"]]), (key, item)
        assert not isinstance(item, bool) or sub["type"] == "boolean"
        if "enum" in sub:
            assert item in sub["enum"]
        if "maxLength" in sub:
            assert len(item) <= sub["maxLength"]
        if sub["type"] == "integer":
            assert sub["minimum"] <= item <= sub["maximum"]
        if sub["type"] == "array":
            assert len(item) <= sub["maxItems"]
            assert all(isinstance(x, (int, float)) for x in item)


@pytest.fixture(scope="module", params=LAYOUTS)
def client(request, tmp_path_factory):
    if request.param != "one":  # a subprocess: the template goes in a file
        template = tmp_path_factory.mktemp("template") / "glm47.jinja"
        template.write_text(GLM47_LIKE)
        args = ("--kv-cache-mib", "64", "--chat-template", str(template), "--served-model-name")
        with launch(request.param, *args, "m") as server:
            yield server.client()
        return
    from zcode.llm import LLM

    llm = LLM(None, kv_cache_bytes=64 << 20)
    llm.tokenizer.chat_template = GLM47_LIKE
    state = ServerState(llm, AsyncEngine(llm.engine, Metrics("m")), "m", "m", 0)
    served = InThreadServer(build_app(state))
    yield openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    served.stop()


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_forced_calls_validate_against_the_schema(client, tool_choice):
    out = client.chat.completions.create(
        model="m", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, n=4,
        temperature=1.0, seed=7, max_tokens=120, parallel_tool_calls=False,
    )  # fmt: skip
    for choice in out.choices:
        assert choice.finish_reason in ("tool_calls", "length"), choice
        if choice.finish_reason == "length":
            continue  # cut off: not a call to run (checked below with room to finish)
        [call] = choice.message.tool_calls
        if isinstance(tool_choice, dict):
            assert call.function.name == "get_weather"
        check_arguments(call.function.name, call.function.arguments)
    assert sum(c.finish_reason == "tool_calls" for c in out.choices) >= 2


def test_streamed_forced_call_equals_the_non_streamed_one(client):
    kwargs = dict(model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                  temperature=0, max_tokens=120, parallel_tool_calls=False)  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, list[str]] = {}
    reasons = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, ["", ""])
                entry[0] += d.function.name or ""
                entry[1] += d.function.arguments or ""
    assert reasons[-1] == whole.finish_reason == "tool_calls"
    [call] = whole.message.tool_calls
    assert list(calls.values()) == [[call.function.name, call.function.arguments]]
    check_arguments(call.function.name, call.function.arguments)


def test_forced_call_cut_off_by_max_tokens_is_length(client):
    out = client.chat.completions.create(
        model="m", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=3,
        temperature=0,
    )  # fmt: skip
    assert out.choices[0].finish_reason == "length"
