# ruff: noqa: E501
"""Messages reach templates as strings with dict tool arguments, so GLM-5.1's tool turn works."""

import copy
import json

import pytest

from zcode.chat.messages import normalize_messages
from zcode.chat.template import TemplateError, render_chat
from zcode.chat.tool_parser import GlmToolParser
from zcode.errors import ValidationError


def text_parts(*texts: str) -> list[dict]:
    return [{"type": "text", "text": t} for t in texts]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CONVERSATION = [
    {"role": "developer", "content": text_parts("Be ", "brief.")},
    {"role": "user", "content": text_parts("Weather in Paris?")},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": text_parts("22°C, ", "sunny")},
]

# Written for these tests in the shape of GLM-5.1's template: 4.7-style compact turns, tool calls
# rendered from `arguments.items()`, and the faulty branch for list tool content, which looks
# items up by `.name` among the tools (OpenAI text parts have none, so the result is lost).
GLM51_LIKE = """[gMASK]<sop>
{%- if tools %}<|system|>Tools:<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'system' or m.role == 'user' %}<|{{ m.role }}|>{{ m.content }}
{%- elif m.role == 'assistant' %}<|assistant|></think>{{ m.content or '' }}
{%- for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}
{%- for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key><arg_value>
{{- v if v is string else v | tojson }}</arg_value>{% endfor %}</tool_call>
{%- endfor %}
{%- elif m.role == 'tool' %}<|observation|>
{%- if m.content is string %}<tool_response>{{ m.content }}</tool_response>
{%- else %}<tool_response><tools>
{% for tr in m.content %}{% for t in tools if t.function.name == tr.name %}{{ t | tojson }}
{% endfor %}{% endfor %}</tools></tool_response>
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|><think>{% endif %}"""


def test_content_parts_become_strings_and_arguments_dicts():
    original = copy.deepcopy(CONVERSATION)
    messages = normalize_messages(CONVERSATION)
    assert CONVERSATION == original  # a copy; the request is untouched
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert [m.get("content") for m in messages] == [
        "Be brief.",
        "Weather in Paris?",
        None,  # null content is dropped, as transformers drops it
        "22°C, sunny",
    ]
    assert "content" not in messages[2]
    assert messages[2]["tool_calls"][0] == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
    }
    assert messages[3]["tool_call_id"] == "call_1"


def test_glm51_like_template_sees_the_tool_result():
    prompt = render_chat(GLM51_LIKE, normalize_messages(CONVERSATION), tools=TOOLS)
    assert prompt == (
        "[gMASK]<sop><|system|>Tools:<tools>get_weather;</tools>"
        "<|system|>Be brief.<|user|>Weather in Paris?"
        "<|assistant|></think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris"
        "</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
        "<|observation|><tool_response>22°C, sunny</tool_response>"
        "<|assistant|><think>"
    )
    # The rendered call is one our parser reads back as the call the client sent.
    call = prompt[prompt.index("<tool_call>") : prompt.index("</tool_call>") + 12]
    assert GlmToolParser(TOOLS).parse(call)[1][0].arguments == '{"city": "Paris", "days": 2}'


def test_without_normalizing_the_template_loses_the_result_or_fails():
    """What vllm#39614 looks like: the bug this module exists to prevent."""
    raw = copy.deepcopy(CONVERSATION)
    raw[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "days": 2}
    prompt = render_chat(GLM51_LIKE, raw, tools=TOOLS)
    assert "<|observation|><tool_response><tools>\n</tools></tool_response>" in prompt
    assert "sunny" not in prompt
    with pytest.raises(TemplateError):  # a JSON-string `arguments` has no .items()
        render_chat(GLM51_LIKE, CONVERSATION, tools=TOOLS)


@pytest.mark.parametrize("arguments", [None, "", "{}", {}])
def test_empty_arguments_become_an_empty_dict(arguments):
    call = {"id": "c", "type": "function", "function": {"name": "now", "arguments": arguments}}
    messages = normalize_messages([{"role": "assistant", "tool_calls": [call]}])
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == {}


def test_null_tool_calls_are_dropped():
    messages = normalize_messages([{"role": "assistant", "content": "hi", "tool_calls": None}])
    assert messages == [{"role": "assistant", "content": "hi"}]


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        ([{"role": "user", "content": "a"}, "b"], r"messages\[1\] must be an object"),
        ([{"content": "no role"}], r"messages\[0\]\.role must be one of"),
        ([{"role": "function", "content": "x"}], r"got 'function'"),
        ([{"role": "user"}], r"messages\[0\]\.content is required"),
        ([{"role": "tool", "content": None}], r"messages\[0\]\.content is required"),
        ([{"role": "user", "content": 5}], "string or a list of content parts"),
        (
            [
                {"role": "user", "content": "a"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "see"},
                        {"type": "image_url", "image_url": {"url": "http://x"}},
                    ],
                },
            ],
            r"messages\[1\]\.content\[1\]: content part type 'image_url' is not supported",
        ),
        ([{"role": "tool", "content": ["plain"]}], r"content\[0\]: content part type None"),
        ([{"role": "user", "content": [{"type": "text"}]}], r"content\[0\]\.text must be"),
        ([{"role": "user", "content": "a", "tool_calls": []}], "only allowed on assistant"),
        ([{"role": "assistant", "tool_calls": {}}], r"tool_calls must be a list"),
        ([{"role": "assistant", "tool_calls": [{"id": "c"}]}], r"tool_calls\[0\] must have"),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
            r"tool_calls\[0\]\.function\.arguments is not valid JSON",
        ),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}],
                }
            ],
            "must be a JSON object",
        ),
    ],
)
def test_malformed_messages_are_validation_errors(messages, match):
    with pytest.raises(ValidationError, match=match):
        normalize_messages(messages)


# Written for these tests in the shapes of GLM-4.5's and GLM-4.7's templates: a `visible_text`
# macro that joins content parts, reasoning read from `reasoning_content` (else split off the
# content at </think>), tools listed with `tojson`, tool calls from `arguments.items()`.
GLM_MACROS = """{%- macro visible_text(content) -%}
{%- if content is string -%}{{- content }}
{%- elif content is iterable and content is not mapping -%}
{%- for item in content -%}
{%- if item is mapping and item.type == 'text' -%}{{- item.text }}
{%- elif item is string -%}{{- item }}{%- endif -%}
{%- endfor -%}
{%- else -%}{{- content }}{%- endif -%}
{%- endmacro -%}"""
GLM45_SHAPE = (
    GLM_MACROS
    + """[gMASK]<sop>
{%- if tools -%}<|system|>
# Tools
<tools>
{% for tool in tools %}{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}</tools>
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' %}<|user|>
{{ visible_text(m.content) }}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- set content = visible_text(m.content) %}
{%- if m.reasoning_content is string %}{% set reasoning = m.reasoning_content %}
{%- elif '</think>' in content %}{% set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
{%- set content = content.split('</think>')[-1] %}
{%- else %}{% set reasoning = '' %}{%- endif %}
{{ '\\n<think>' + reasoning.strip() + '</think>' }}
{%- if content.strip() %}{{ '\\n' + content.strip() }}{% endif %}
{%- if m.tool_calls -%}
{% for tc in m.tool_calls %}
{%- if tc.function %}{% set tc = tc.function %}{% endif %}
{{ '\\n<tool_call>' + tc.name }}
{% for k, v in tc.arguments.items() %}<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>
{% endfor %}</tool_call>{% endfor %}
{%- endif -%}
{%- elif m.role == 'tool' -%}
{%- if m.content is string -%}<|observation|>
<tool_response>
{{ m.content }}
</tool_response>
{%- else -%}<|observation|>{% for tr in m.content %}<tool_response>
{{ tr.output if tr.output is defined else tr }}
</tool_response>{% endfor %}{%- endif -%}
{%- elif m.role == 'system' -%}<|system|>
{{ visible_text(m.content) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{{- '\\n<think></think>' if (enable_thinking is defined and not enable_thinking) else '' -}}{%- endif -%}"""
)
GLM47_SHAPE = (
    GLM_MACROS
    + """[gMASK]<sop>
{%- if tools -%}<|system|>Tools:<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' or m.role == 'system' %}<|{{ m.role }}|>{{ visible_text(m.content) }}
{%- elif m.role == 'assistant' %}<|assistant|><think>{{ m.reasoning_content or '' }}</think>{{ visible_text(m.content) }}
{%- for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}
{%- for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key><arg_value>
{{- v if v is string else v | tojson }}</arg_value>{% endfor %}</tool_call>{% endfor %}
{%- elif m.role == 'tool' %}<|observation|><tool_response>{{ visible_text(m.content) }}</tool_response>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|><think>{% endif %}"""
)

WEATHER_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
}
# Every message shape the openai client produces, as it sends them (`message.model_dump()` of a
# response included: null content, refusal, audio, ...).
CLIENT_CONVERSATIONS = {
    "null_content_tool_calls": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "audio": None,
            "function_call": None,
            "tool_calls": [WEATHER_CALL],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22C"},
    ],
    "tool_result_parts": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": text_parts("22", "C")},
    ],
    "reasoning": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning": "Two and two."},
        {"role": "user", "content": "3+3?"},
    ],
    "reasoning_content": [
        {"role": "user", "content": "2+2?"},
        {
            "role": "assistant",
            "content": "4",
            "reasoning_content": "Two and two.",
            "reasoning": None,
        },
        {"role": "user", "content": "3+3?"},
    ],
    "multi_part": [
        {"role": "system", "content": text_parts("Be ", "brief.")},
        {"role": "user", "content": text_parts("Bonjour, ", "ça va ? 🤖")},
        {"role": "assistant", "content": text_parts("Oui.")},
        {"role": "user", "content": "Et toi ?", "name": None},
    ],
}


def hf_arguments(messages: list[dict]) -> list[dict]:
    """The conversation as transformers takes it: tool-call arguments as dicts (its convention).

    A tool result's text parts are joined first: GLM templates read a list there as structured
    results, not text (vllm#39614), which is the one place we render differently on purpose.
    """
    messages = copy.deepcopy(messages)
    for m in messages:
        if m["role"] == "tool" and isinstance(m["content"], list):
            m["content"] = "".join(part["text"] for part in m["content"])
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return messages


@pytest.fixture(scope="module")
def hf_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "<|endoftext|>": 1}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


@pytest.mark.parametrize("template", [GLM45_SHAPE, GLM47_SHAPE], ids=["glm45", "glm47"])
@pytest.mark.parametrize("name", list(CLIENT_CONVERSATIONS))
@pytest.mark.parametrize("enable_thinking", [None, False])
def test_rendered_as_transformers_renders(hf_tokenizer, template, name, enable_thinking):
    messages = CLIENT_CONVERSATIONS[name]
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    expected = hf_tokenizer.apply_chat_template(
        hf_arguments(messages), tools=TOOLS, chat_template=template, tokenize=False,
        add_generation_prompt=True, **kwargs,
    )  # fmt: skip
    special = {k: v for k, v in hf_tokenizer.special_tokens_map.items() if isinstance(v, str)}
    text = render_chat(
        template, normalize_messages(messages), tools=TOOLS, special_tokens=special,
        enable_thinking=enable_thinking,
    )  # fmt: skip
    assert text == expected
    assert "None" not in text


def test_incoming_reasoning_reaches_the_template_under_every_name():
    [message] = normalize_messages([{"role": "assistant", "content": "4", "reasoning": "r"}])
    assert message["reasoning_content"] == message["thinking"] == message["reasoning"] == "r"
