"""Messages reach templates as strings with dict tool arguments, so GLM-5.1's tool turn works."""

import copy

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
    assert [m["content"] for m in messages] == [
        "Be brief.",
        "Weather in Paris?",
        None,
        "22°C, sunny",
    ]
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
