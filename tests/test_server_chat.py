"""GLM tool calls and reasoning through the real HTTP stack, with a scripted model.

No small model here writes GLM tool calls on request, so a parrot stands in for `LLMEngine`: it
answers every chat with the last user message, three characters per step, so tags are split
across stream chunks. Everything else is real: the FastAPI app and the async engine thread under
uvicorn (in a thread of this process), the chat parsers, and the official `openai` client.
"""

import json
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import openai
import pytest
from remote_server import InThreadServer

from zcode.engine.request_output import RequestOutput
from zcode.llm import LLM
from zcode.server.app import build_app
from zcode.server.async_engine import AsyncEngine
from zcode.server.metrics import Metrics
from zcode.server.serving import ServerState

# GLM-4.7 in miniature: compact tool calls, a generation prompt that opens <think> (thinking on)
# or closes it (enable_thinking=false).
GLM47_LIKE = """[gMASK]<sop>
{%- if tools %}<|system|>Tools:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' or m.role == 'user' %}<|{{ m.role }}|>{{ m.content }}
{%- elif m.role == 'assistant' %}<|assistant|></think>{{ m.content or '' }}
{%- for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}
{%- for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key><arg_value>
{{- v if v is string else v | tojson }}</arg_value>{% endfor %}</tool_call>{% endfor %}
{%- elif m.role == 'tool' %}<|observation|><tool_response>{{ m.content }}</tool_response>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{%- if enable_thinking is defined and not enable_thinking %}</think>{% else %}<think>{% endif %}
{%- endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
USER_HI = [{"role": "user", "content": "hi"}]
CHUNK_CHARS = 3


class CharTokenizer:
    """One token per character, so token counts are character counts."""

    chat_template = GLM47_LIKE
    eos_token, bos_token, pad_token, unk_token = "<|endoftext|>", None, None, None
    special_tokens_map = {"eos_token": "<|endoftext|>"}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(map(chr, ids))

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]


@dataclass
class _Request:
    prompt_ids: list[int]
    answer: str
    max_tokens: int
    num_chars: int = 0
    token_ids: list[int] = field(default_factory=list)


class ParrotEngine:
    """Answers with the last user message.

    An answer containing FAIL makes the whole step raise; one containing ERROR finishes that
    request with reason "error" on its second token.
    """

    max_model_len = 4096
    vocab_size = 0x110000

    def __init__(self) -> None:
        self.requests: dict[str, _Request] = {}
        self.last_params = None  # the SamplingParams of the last request added

    @property
    def scheduler(self):
        running = [SimpleNamespace(request_id=r) for r in self.requests]
        return SimpleNamespace(running=running, waiting=[])

    def add_request(self, prompt_ids, params, request_id, cache_salt=None, **skips):
        prompt = "".join(map(chr, prompt_ids))
        answer = prompt.rsplit("<|user|>", 1)[1].split("<|", 1)[0]
        self.requests[request_id] = _Request(prompt_ids, answer, params.max_tokens)
        self.last_params = params

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def stats(self) -> dict:
        return {"num_running": len(self.requests), "num_waiting": 0, "kv_usage": 0.0}

    def step(self) -> list[RequestOutput]:
        if any("FAIL" in r.answer for r in self.requests.values()):
            raise RuntimeError("scripted failure")
        outputs = []
        for request_id, r in list(self.requests.items()):
            delta = r.answer[r.num_chars : r.num_chars + CHUNK_CHARS]
            r.num_chars += len(delta)
            r.token_ids.append(len(r.token_ids))
            done = r.num_chars >= len(r.answer)
            finished = done or len(r.token_ids) >= r.max_tokens
            reason = ("stop" if done else "length") if finished else None
            if "ERROR" in r.answer and len(r.token_ids) == 2:  # as LLMEngine isolates a failure
                finished, reason = True, "error"
            stop_reason = None
            if "LOOP" in r.answer and len(r.token_ids) == 2:  # as the anomaly guard ends one
                finished, reason, stop_reason = True, "anomaly", "repetition"
            if finished:
                del self.requests[request_id]
            outputs.append(
                RequestOutput(
                    request_id, r.prompt_ids, r.answer[: r.num_chars], list(r.token_ids),
                    finished, reason, stop_reason, delta_text=delta,
                    delta_token_ids=r.token_ids[-1:],
                )
            )  # fmt: skip
        time.sleep(0.001)
        return outputs


class ParrotLLM:
    apply_chat_template = LLM.apply_chat_template

    def __init__(self) -> None:
        self.tokenizer = CharTokenizer()
        self.engine = ParrotEngine()


@pytest.fixture(scope="module")
def server():
    llm = ParrotLLM()
    state = ServerState(llm, AsyncEngine(llm.engine, Metrics("parrot")), "parrot", "parrot", 0)
    served = InThreadServer(build_app(state))
    yield SimpleNamespace(url=served.url, state=state)
    served.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def chat(client, answer: str, stream: bool = False, **kwargs):
    messages = [{"role": "user", "content": answer}]
    return client.chat.completions.create(
        model="parrot", messages=messages, stream=stream, **kwargs
    )


def streamed(client, answer: str, **kwargs) -> tuple[dict, str, list]:
    """Rebuilds the message from a stream: (message fields, finish reason, chunks)."""
    chunks = list(chat(client, answer, stream=True, **kwargs))
    message = {"content": "", "reasoning_content": "", "reasoning": ""}
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in chunks:
        for c in chunk.choices:
            delta = c.delta
            message["content"] += delta.content or ""
            message["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
            message["reasoning"] += (delta.model_extra or {}).get("reasoning") or ""
            for d in delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            reasons.append(c.finish_reason)
    assert reasons[-1] is not None and not any(reasons[:-1])
    message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, reasons[-1], chunks


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_reasoning_split_when_the_template_opens_think(client):
    answer = "Two and two.</think>\n\nThe answer is 4."
    out = chat(client, answer)
    message = out.choices[0].message
    assert message.reasoning_content == message.reasoning == "Two and two."  # vLLM: both
    assert message.content == "The answer is 4."
    assert out.usage.completion_tokens == -(-len(answer) // CHUNK_CHARS)
    fields, reason, _ = streamed(client, answer)
    assert fields["reasoning_content"] == fields["reasoning"] == "Two and two."
    assert fields["content"] == "The answer is 4."
    assert reason == out.choices[0].finish_reason == "stop"


def test_no_reasoning_with_thinking_off(client):
    out = chat(client, "Plain answer.", extra_body=NO_THINKING)
    message = out.choices[0].message
    assert message.content == "Plain answer."
    assert not (message.model_extra or {}).get("reasoning_content")


@pytest.mark.parametrize(
    "answer",
    [
        # GLM-4.7/5: compact
        "Let me check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>",
        # GLM-4.5/4.6: newlines between the parts
        "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
        "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>\n",
    ],
    ids=["glm47", "glm45"],
)
def test_tool_call_both_formats_streamed_and_not(client, answer):
    kwargs = dict(tools=TOOLS, tool_choice="auto", extra_body=NO_THINKING)
    out = chat(client, answer, **kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris", "days": 2})]
    assert choice.message.tool_calls[0].id.startswith("call_")
    fields, reason, _ = streamed(client, answer, **kwargs)
    assert reason == "tool_calls" and fields["content"] == "Let me check."
    [call] = fields["tool_calls"]
    assert call["id"].startswith("call_") and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris", "days": 2}


def test_zero_argument_call_and_unknown_tool_dropped(client):
    answer = (
        "<tool_call>get_time</tool_call><tool_call>rm_rf<arg_key>path</arg_key>"
        "<arg_value>/</arg_value></tool_call>"
    )
    kwargs = dict(tools=TOOLS, extra_body=NO_THINKING)
    message = chat(client, answer, **kwargs).choices[0].message
    assert calls_of(message) == [("get_time", {})] and message.content is None
    fields, _, _ = streamed(client, answer, **kwargs)
    assert [(c["name"], json.loads(c["arguments"])) for c in fields["tool_calls"]] == [
        ("get_time", {})
    ]


def test_reasoning_then_tool_call(client):
    answer = "Need the weather.</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>"  # noqa: E501
    out = chat(client, answer, tools=TOOLS)
    message = out.choices[0].message
    assert message.reasoning_content == "Need the weather."
    assert calls_of(message) == [("get_weather", {"city": "Rome"})]


def test_named_tool_choice_begins_the_call(client):
    # The parrot writes only the arguments; the server began `<tool_call>get_weather` itself.
    answer = "<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>"
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = chat(client, answer, tools=TOOLS, tool_choice=choice)
    assert calls_of(out.choices[0].message) == [("get_weather", {"city": "Oslo"})]
    assert out.choices[0].finish_reason == "tool_calls"
    fields, reason, _ = streamed(client, answer, tools=TOOLS, tool_choice=choice)
    assert [c["name"] for c in fields["tool_calls"]] == ["get_weather"] and reason == "tool_calls"


def test_required_tool_choice(client):
    out = chat(client, "get_time</tool_call>", tools=TOOLS, tool_choice="required")
    assert calls_of(out.choices[0].message) == [("get_time", {})]


def test_tool_choice_none_leaves_text_alone(client):
    answer = "<tool_call>get_time</tool_call>"
    out = chat(client, answer, tools=TOOLS, tool_choice="none", extra_body=NO_THINKING)
    assert out.choices[0].message.content == answer and not out.choices[0].message.tool_calls


def test_tool_result_as_content_parts_is_rendered(server):
    import http.client

    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "22C"}]},
    ]
    conn = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]))
    body = json.dumps({"messages": messages})
    conn.request("POST", "/tokenize", body, {"Content-Type": "application/json"})
    tokens = json.loads(conn.getresponse().read())["tokens"]
    prompt = "".join(map(chr, tokens))
    assert "<tool_response>22C</tool_response>" in prompt
    assert "<arg_key>city</arg_key><arg_value>Paris</arg_value>" in prompt


def test_failing_step_fails_its_request_only(client):
    with pytest.raises(openai.InternalServerError):
        chat(client, "FAIL now")
    after = chat(client, "still here", extra_body=NO_THINKING)
    assert after.choices[0].message.content == "still here"


def test_n_choices_each_parsed(client):
    answer = "ok</think>done"
    out = chat(client, answer, n=2)
    assert [c.message.content for c in out.choices] == ["done", "done"]
    assert [c.message.reasoning_content for c in out.choices] == ["ok", "ok"]


def test_request_the_engine_fails_gets_500_or_an_in_band_error(server, client):
    import http.client

    with pytest.raises(openai.InternalServerError):
        chat(client, "ERROR soon", extra_body=NO_THINKING)
    conn = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]))
    body = {"model": "parrot", "messages": [{"role": "user", "content": "ERROR soon"}]}
    conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})  # fmt: skip
    events = [e for e in conn.getresponse().read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == 500 and error["type"] == "InternalServerError"
    assert chat(client, "fine", extra_body=NO_THINKING).choices[0].message.content == "fine"


def test_forced_tool_choice_is_constrained_by_a_tool_call_grammar(server, client):
    chat(client, "get_time</tool_call>", tools=TOOLS, tool_choice="required")
    grammar = server.state.llm.engine.last_params.structured_outputs.grammar
    assert '"get_weather"' in grammar and '"get_time"' in grammar
    named = {"type": "function", "function": {"name": "get_weather"}}
    chat(client, "x", tools=TOOLS, tool_choice=named)
    grammar = server.state.llm.engine.last_params.structured_outputs.grammar
    assert '"get_time"' not in grammar and "<arg_key>city</arg_key>" in grammar
    chat(client, "x", tools=TOOLS, tool_choice="auto")
    assert server.state.llm.engine.last_params.structured_outputs is None
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        chat(client, "x", tools=TOOLS, tool_choice="required",
             response_format={"type": "json_object"})  # fmt: skip


def test_a_call_cut_off_by_max_tokens_finishes_with_length(client):
    answer = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>da"
    kwargs = dict(tools=TOOLS, extra_body=NO_THINKING, max_tokens=len(answer) // CHUNK_CHARS - 1)
    out = chat(client, answer + "ys</arg_key><arg_value>2</arg_value></tool_call>", **kwargs)
    assert out.choices[0].finish_reason == "length"
    _, reason, _ = streamed(client, answer + "ys</arg_key>", **kwargs)
    assert reason == "length"


def test_streamed_tool_call_arguments_concatenate_to_the_non_streamed_ones(client):
    answer = (
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Lyon</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
        "<tool_call>get_time</tool_call>"
    )
    kwargs = dict(tools=TOOLS, extra_body=NO_THINKING)
    whole = chat(client, answer, **kwargs).choices[0].message.tool_calls
    fields, _, _ = streamed(client, answer, **kwargs)
    assert [(c["name"], c["arguments"]) for c in fields["tool_calls"]] == [
        (c.function.name, c.function.arguments) for c in whole
    ]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"structured_outputs": {"regex": "a+"}}, None),
        ({"guided_json": {"type": "object"}}, None),
        ({"guided_regex": "[0-9]+"}, None),
        ({"guided_choice": ["yes", "no"]}, None),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ],
)
def test_vllm_constraints_reach_the_engine_or_are_refused(server, client, extra, param):
    if param is not None:
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, "x", extra_body=extra)
        assert info.value.body["param"] == param
        return
    chat(client, "x", extra_body=extra)
    constraint = server.state.llm.engine.last_params.structured_outputs
    assert constraint is not None
    [(name, value)] = extra.items()
    kind = next(iter(value)) if name == "structured_outputs" else name.removeprefix("guided_")
    expected = value[kind] if name == "structured_outputs" else value
    got = getattr(constraint, kind)
    assert (list(got) if kind == "choice" else got) == expected


def test_penalties_and_logit_bias_reach_the_engine(server, client):
    chat(client, "x", presence_penalty=0.5, frequency_penalty=-0.25, logit_bias={"65": 5})
    params = server.state.llm.engine.last_params
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.25)
    assert params.logit_bias == ((65, 5.0),)
    for bias in ({"x": 1}, {"65": 101}, {str(0x110000): 1}):
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, "x", logit_bias=bias)
        assert info.value.body["param"] == "logit_bias"


def test_incoming_reasoning_field_is_rendered(server):
    import http.client

    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": None, "reasoning": "Two and two.", "tool_calls": None},
    ]
    template = "{% for m in messages %}[{{ m.reasoning_content }}|{{ m.content }}]{% endfor %}"
    llm = server.state.llm
    original, llm.tokenizer.chat_template = llm.tokenizer.chat_template, template
    try:
        conn = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]))
        body = json.dumps({"messages": messages, "add_generation_prompt": False})
        conn.request("POST", "/tokenize", body, {"Content-Type": "application/json"})
        prompt = "".join(map(chr, json.loads(conn.getresponse().read())["tokens"]))
    finally:
        llm.tokenizer.chat_template = original
    assert prompt == "[|2+2?][Two and two.|]"


def test_a_runaway_template_neither_blocks_health_nor_runs_unbounded(server, client, monkeypatch):
    import http.client
    import threading

    from zcode.chat import template

    monkeypatch.setattr(template, "RENDER_TIME_LIMIT_S", 10.0)
    llm = server.state.llm
    nested = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    monkeypatch.setattr(llm.tokenizer, "chat_template", nested, raising=False)
    errors = []

    def request():
        try:
            chat(client, "x")
        except openai.BadRequestError as e:
            errors.append(e)

    thread = threading.Thread(target=request)
    thread.start()
    while not server.state.num_inflight and thread.is_alive():  # the request reached the app
        time.sleep(0.01)
    time.sleep(0.2)  # and, on the loop or not, began rendering
    health = []
    for _ in range(3):
        conn = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]))
        conn.request("GET", "/health")
        health.append(conn.getresponse().status)
        conn.close()
    answered_while_rendering = thread.is_alive()
    thread.join()
    assert health == [200] * 3 and answered_while_rendering
    [error] = errors
    assert "longer than 10 s" in error.body["message"]


def test_tools_reach_the_template_as_the_client_sent_them():
    from zcode.server.protocol import ChatCompletionRequest

    tools = [{"function": {"strict": True, "parameters": {"type": "object"}, "name": "f"},
              "type": "function"}]  # fmt: skip
    request = ChatCompletionRequest.model_validate({"messages": USER_HI, "tools": tools})
    assert request.raw_tools == tools  # key order and `strict` kept: transformers renders these
    assert json.dumps(request.raw_tools) == json.dumps(tools)


def test_anomalies_are_counted_by_kind_on_metrics(server, client):
    import http.client

    out = chat(client, "LOOP LOOP LOOP", extra_body=NO_THINKING)
    assert out.choices[0].finish_reason == "anomaly"
    assert out.choices[0].model_extra["stop_reason"] == "repetition"
    conn = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]))
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    assert 'zcode:request_anomalies_total{kind="repetition",model_name="parrot"} 1.0' in text
