"""GLM tool calls in both formats, whole and streamed over any chunking, into OpenAI tool calls."""

import json
import random
import re

import pytest

from zcode.chat.tool_parser import GlmToolParser, ToolCall
from zcode.errors import ValidationError


def tool(name: str, properties: dict | None = None) -> dict:
    parameters = {"type": "object", "properties": properties or {}}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


TOOLS = [
    tool(
        "get_weather",
        {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "units": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
    ),
    tool("write_file", {"path": {"type": "string"}, "text": {"type": "string"}}),
    tool("search", {"query": {"type": "string"}, "filters": {"type": "object"}}),
    {"type": "function", "function": {"name": "now"}},  # no parameters at all
]


def call(name: str, args: list[tuple[str, str]], fmt: str) -> str:
    """A call as GLM writes it: GLM-4.5/4.6 ("45") with newlines, GLM-4.7/5 ("47") without."""
    nl = "\n" if fmt == "45" else ""
    pairs = "".join(f"<arg_key>{k}</arg_key>{nl}<arg_value>{v}</arg_value>{nl}" for k, v in args)
    return f"<tool_call>{name}{nl}{pairs}</tool_call>"


WEATHER = [("city", "Paris"), ("days", "3")]
# (output in a format, expected content, expected [(name, arguments dict)])
CASES = [
    lambda f: ("Just text, no calls.", "Just text, no calls.", []),
    lambda f: (
        call("get_weather", WEATHER, f),
        "",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    lambda f: (
        "Let me check.\n" + call("get_weather", WEATHER, f),
        "Let me check.",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    lambda f: (call("now", [], f), "", [("now", {})]),  # zero arguments
    lambda f: (
        "Two things.\n" + call("now", [], f) + "\n" + call("get_weather", [("city", "Oslo")], f),
        "Two things.",
        [("now", {}), ("get_weather", {"city": "Oslo"})],
    ),
    lambda f: (
        call("now", [], f) + "\nThen, between them: " + call("now", [], f) + "\nDone.\n",
        "Then, between them:Done.\n",
        [("now", {}), ("now", {})],
    ),
    lambda f: (  # an undeclared tool is dropped, text and all; indices stay dense
        "A" + call("rm_rf", [("path", "/")], f) + call("now", [], f),
        "A",
        [("now", {})],
    ),
    lambda f: (
        call("write_file", [("path", "a.py"), ("text", 'x = "</tool_call>"\nif a < b: pass')], f),
        "",
        [("write_file", {"path": "a.py", "text": 'x = "</tool_call>"\nif a < b: pass'})],
    ),
    lambda f: (
        call("search", [("query", "123"), ("filters", '{"year": 2024, "tags": ["a"]}')], f),
        "",
        [("search", {"query": "123", "filters": {"year": 2024, "tags": ["a"]}})],
    ),
    lambda f: ("a < b and <tool_cal", "a < b and <tool_cal", []),  # not a call after all
    lambda f: (
        "Cut off: " + call("get_weather", WEATHER, f)[:-15],
        "Cut off:",
        [
            ("get_weather", {"city": "Paris"})  # the complete pair survives, the name was complete
        ],
    ),
    lambda f: ("Cut off: <tool_call>get_wea", "Cut off:", []),  # the name never completed
]
FORMATS = ["45", "47"]
SEEDS = range(4)


def parse(text: str, tools=TOOLS) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = GlmToolParser(tools).parse(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def stream(chunks: list[str], tools=TOOLS) -> tuple[str, list[ToolCall]]:
    """Feeds chunks and rebuilds the calls from the deltas, checking OpenAI's delta rules."""
    parser = GlmToolParser(tools)
    content, calls = "", []
    for delta in [parser.feed(chunk) for chunk in chunks] + [parser.finish()]:
        content += delta.content
        for d in delta.tool_calls:
            if d.index == len(calls):  # a new call: its first delta names it
                assert d.id is not None and d.name is not None
                calls.append(ToolCall(d.id, d.name, d.arguments))
            else:
                assert d.index == len(calls) - 1 and d.id is None and d.name is None
                calls[-1].arguments += d.arguments
    return content, calls


def random_chunks(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    chunks, i = [], 0
    while i < len(text):
        n = rng.randint(1, 8)
        chunks.append(text[i : i + n])
        i += n
    return chunks


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", CASES)
def test_parse(case, fmt):
    text, content, calls = case(fmt)
    assert parse(text) == (content, calls)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", CASES)
def test_stream_equals_parse_for_any_chunking(case, fmt):
    text = case(fmt)[0]
    content, calls = GlmToolParser(TOOLS).parse(text)
    expected = (content, [(c.name, c.arguments) for c in calls])
    for chunks in [list(text), [text]] + [random_chunks(text, seed) for seed in SEEDS]:
        streamed_content, streamed_calls = stream(chunks)
        assert (streamed_content, [(c.name, c.arguments) for c in streamed_calls]) == expected


def test_ids_are_unique_openai_style():
    text = call("now", [], "47") * 3
    _, calls = GlmToolParser(TOOLS).parse(text)
    _, streamed = stream(list(text))
    ids = [c.id for c in calls + streamed]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)
    assert len(set(ids)) == 6


def test_schema_decides_whether_a_value_is_json():
    text = call("get_weather", [("city", "123"), ("days", "123"), ("units", "null")], "47")
    assert parse(text)[1] == [("get_weather", {"city": "123", "days": 123, "units": "null"})]
    raw = GlmToolParser(TOOLS).parse(text)[1][0].arguments
    assert raw == '{"city": "123", "days": 123, "units": "null"}'


@pytest.mark.parametrize(
    ("value", "decoded"),
    [
        ("3", 3),
        ("2.5", 2.5),
        ("true", True),
        ("[1, 2]", [1, 2]),
        ("three", "three"),
        ("NaN", "NaN"),
        ("Infinity", "Infinity"),
        (" 7 ", 7),
        ("", ""),
    ],
)
def test_untyped_values_are_json_when_they_parse(value, decoded):
    text = call("search", [("extra", value)], "47")
    _, calls = GlmToolParser(TOOLS).parse(text)
    assert json.loads(calls[0].arguments) == {"extra": decoded}  # always valid JSON


def test_string_values_keep_their_whitespace_and_unicode():
    text = call("write_file", [("path", " a b "), ("text", "é\n  ✓\n")], "45")
    assert parse(text)[1] == [("write_file", {"path": " a b ", "text": "é\n  ✓\n"})]
    assert "✓" in GlmToolParser(TOOLS).parse(text)[1][0].arguments


def test_a_call_name_is_emitted_before_its_arguments_and_they_stream_one_by_one():
    parser = GlmToolParser(TOOLS)
    assert parser.feed("Sure <tool").content == "Sure"  # the space might precede a call
    first = parser.feed("_call>get_weather<arg_key>city</arg_key><arg_value>Pa")
    assert first.content == "" and [(d.index, d.name, d.arguments) for d in first.tool_calls] == [
        (0, "get_weather", "")
    ]
    pair = parser.feed("ris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_")
    assert [(d.index, d.id, d.arguments) for d in pair.tool_calls] == [
        (0, None, '{"city": "Paris"'),  # each argument as soon as its value is complete
        (0, None, ', "days": 2'),
    ]
    last = parser.feed("call>")
    assert [(d.index, d.id, d.arguments) for d in last.tool_calls] == [(0, None, "}")]
    assert parser.feed("\n").content == ""
    assert parser.finish().content == ""


def test_text_that_only_looks_like_a_tag_is_released():
    parser = GlmToolParser(TOOLS)
    assert parser.feed("x <tool").content == "x"
    assert parser.feed("box>").content == " <toolbox>"
    assert parser.feed("\n\n").content == ""
    assert parser.finish().content == "\n\n"


def test_tools_none_accepts_any_name_and_empty_tools_none():
    text = "hi " + call("anything", [("n", "5")], "47")
    assert parse(text, tools=None) == ("hi", [("anything", {"n": 5})])
    assert parse(text, tools=[]) == ("hi", [])


def test_parse_does_not_disturb_a_stream():
    parser = GlmToolParser(TOOLS)
    parser.feed("<tool_call>no")
    parser.parse(call("get_weather", WEATHER, "47"))
    parser.feed("w</tool_call>")
    assert [c.name for c in parser.calls] == ["now"]


@pytest.mark.parametrize(
    "tools", ["get_weather", [{"type": "function"}], [{"function": {"name": ""}}], [None]]
)
def test_malformed_tools_are_validation_errors(tools):
    with pytest.raises(ValidationError, match="tools"):
        GlmToolParser(tools)


def test_odd_schemas_are_understood_or_ignored():
    tools = [
        tool("a", {"s": {"type": ["string", "null"]}, "n": {"type": ["integer", "string"]}}),
        tool("b", {"s": {"oneOf": [{"type": "string"}]}, "x": {"anyOf": "junk", "type": {}}}),
        {"type": "function", "function": {"name": "c", "parameters": ["not", "a", "schema"]}},
    ]
    args = [("s", "1"), ("n", "1"), ("x", "1")]
    text = "".join(call(name, args, "47") for name in "abc")
    assert parse(text, tools) == (
        "",
        [
            ("a", {"s": "1", "n": 1, "x": 1}),
            ("b", {"s": "1", "n": 1, "x": 1}),
            ("c", {"s": 1, "n": 1, "x": 1}),
        ],
    )


def test_a_key_given_twice_keeps_its_first_value():
    text = call("search", [("q", "a"), ("q", "b")], "47")
    assert parse(text)[1] == [("search", {"q": "a"})]
