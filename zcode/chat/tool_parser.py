"""Parses GLM tool calls out of generated text, whole or streamed, into OpenAI tool calls.

Both GLM formats are one grammar, since whitespace between the parts is ignored:

    GLM-4.5/4.6:  <tool_call>name\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>
    GLM-4.7/5:    <tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>

The name is the text before the first `<` of the call, stripped; a call may have no arguments
(`<tool_call>name</tool_call>`, the case that crashed vLLM's glm47 parser, vllm#32436). A value is
kept as raw text when the tool's schema types that argument as a string; otherwise it is JSON if
it parses and raw text if not. Calls to tools not in the request are dropped, text and all.

Content is the text outside calls, less the whitespace that touches a call (the newlines GLM-4.5
puts between calls are not an answer). A call cut off by the end of generation is kept when its
name is complete (a `<` followed it), with the argument pairs that were complete.

One state machine serves both paths: `parse` feeds the whole text, so streamed and non-streamed
results agree by construction. Streaming emits a call's id and name once the name is complete,
then its arguments JSON an argument at a time, each fragment once its `</arg_value>` arrives:
`{"city": "Paris"`, then `, "days": 2`, then `}` at `</tool_call>`. The fragments concatenate to
the call's `arguments`; a key given twice keeps its first value (a fragment cannot be taken back).
"""

import json
import re
import uuid
from dataclasses import dataclass, field

from zcode.chat.reasoning_parser import partial_suffix_len
from zcode.errors import ValidationError

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
VALUE_START = "<arg_value>"
VALUE_END = "</arg_value>"
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object


@dataclass
class ToolCallDelta:
    index: int  # position among the calls of this output, as in OpenAI's delta.tool_calls
    id: str | None  # set on a call's first delta only, with the name
    name: str | None
    arguments: str  # the next fragment of the arguments JSON


@dataclass
class ToolStreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class GlmToolParser:
    """One parser per output (choice). `tools` are the request's OpenAI tool specs.

    `tools=None` means the request declared none: calls are not checked against names and
    every value is decoded as JSON when it can be. `tools=[]` drops every call.
    """

    def __init__(self, tools: list[dict] | None):
        self._string_args = None if tools is None else _string_args_by_tool(tools)
        self._buf = ""
        self._in_call = False
        self._after_call = False  # whitespace right after `</tool_call>` is dropped
        self._scan_from = 0  # inside a call, where `_find_call_end` resumes its scan
        self._in_value = False  # the scan stopped inside an `<arg_value>`
        self._name: str | None = None  # the current call's name, once complete
        self._call_id: str | None = None  # set when the current call is kept
        self._arguments = ""  # the current call's arguments JSON emitted so far, less the `}`
        self._keys: set[str] = set()  # the current call's argument keys emitted so far
        self._pair_from = 0  # where in `_buf` the next argument pair may start
        self._value_end_from = 0  # where in `_buf` to look for a `</arg_value>` not yet seen
        self._calls: list[ToolCall] = []

    @property
    def calls(self) -> list[ToolCall]:
        """The calls completed so far (after `finish`, all of them)."""
        return list(self._calls)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output."""
        parser = GlmToolParser(None)
        parser._string_args = self._string_args
        first, last = parser.feed(text), parser.finish()
        return first.content + last.content, parser.calls

    def feed(self, delta: str) -> ToolStreamDelta:
        """Content and call fragments that are safe to emit after `delta`."""
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> ToolStreamDelta:
        """Flushes held content and a call cut off by the end of generation."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> ToolStreamDelta:
        out = ToolStreamDelta()
        while self._buf:
            if self._in_call:
                if not self._drain_call(out, final):
                    break
                continue
            if self._after_call:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._after_call = False
            i = self._buf.find(CALL_START)
            if i >= 0:
                out.content += self._buf[:i].rstrip()
                self._buf = self._buf[i + len(CALL_START) :]
                self._in_call, self._in_value, self._scan_from = True, False, 0
                continue
            n = len(self._buf)
            if not final:  # hold a possible start of `<tool_call>` and the whitespace before it
                n -= partial_suffix_len(self._buf, CALL_START)
                n = len(self._buf[:n].rstrip())
            out.content += self._buf[:n]
            self._buf = self._buf[n:]
            break
        return out

    def _drain_call(self, out: ToolStreamDelta, final: bool) -> bool:
        """Advances inside a call; True when the call ended and `_buf` holds what follows it."""
        if self._name is None:
            lt = self._buf.find("<")
            if lt >= 0:
                self._name = self._buf[:lt].strip()
                if self._wants(self._name):
                    self._call_id = new_call_id()
                    out.tool_calls.append(
                        ToolCallDelta(len(self._calls), self._call_id, self._name, "")
                    )
        end = self._find_call_end()
        if self._call_id is not None:
            self._emit_pairs(out, len(self._buf) if end < 0 else end)
        if end < 0 and not final:
            return False
        rest = "" if end < 0 else self._buf[end + len(CALL_END) :]
        if self._call_id is not None:
            closing = "}" if self._arguments else "{}"
            out.tool_calls.append(ToolCallDelta(len(self._calls), None, None, closing))
            arguments = self._arguments + closing
            self._calls.append(ToolCall(self._call_id, self._name, arguments))
        self._buf = rest
        self._in_call, self._after_call = False, True
        self._name = self._call_id = None
        self._arguments, self._keys, self._pair_from, self._value_end_from = "", set(), 0, 0
        return True

    def _emit_pairs(self, out: ToolStreamDelta, body_end: int) -> None:
        """Emits the argument pairs completed in `_buf[:body_end]` since the last call."""
        string_args = (self._string_args or {}).get(self._name, frozenset())
        while True:
            # Only a new `</arg_value>` can complete a pair: look for one before matching.
            value_end = self._buf.find(VALUE_END, self._value_end_from, body_end)
            if value_end < 0:
                self._value_end_from = max(self._pair_from, body_end - len(VALUE_END) + 1)
                return
            match = _ARG.search(self._buf, self._pair_from, body_end)
            if match is None:
                self._value_end_from = value_end + 1
                continue
            self._pair_from = self._value_end_from = match.end()
            key, value = match.group(1).strip(), match.group(2)
            if key in self._keys:
                continue
            self._keys.add(key)
            value = value if key in string_args else _decode(value)
            fragment = (
                ("{" if not self._arguments else ", ")
                + json.dumps(key, ensure_ascii=False)
                + ": "
                + json.dumps(value, ensure_ascii=False)
            )
            self._arguments += fragment
            out.tool_calls.append(ToolCallDelta(len(self._calls), None, None, fragment))

    def _find_call_end(self) -> int:
        """Offset in `_buf` of the `</tool_call>` closing the current call, or -1 for not yet.

        A `</tool_call>` inside an `<arg_value>` is part of the value (code that mentions the
        tag). The scan resumes where the last one stopped, so a long value streams in linear time.
        """
        buf, pos = self._buf, self._scan_from
        while True:
            if self._in_value:
                value_end = buf.find(VALUE_END, pos)
                if value_end < 0:
                    self._scan_from = max(pos, len(buf) - len(VALUE_END) + 1)
                    return -1
                pos, self._in_value = value_end + len(VALUE_END), False
            end = buf.find(CALL_END, pos)
            value = buf.find(VALUE_START, pos)
            if end >= 0 and (value < 0 or end < value):
                return end
            if value < 0:  # either tag may be cut off at the end of buf
                self._scan_from = max(pos, len(buf) - max(len(CALL_END), len(VALUE_START)) + 1)
                return -1
            pos, self._in_value = value + len(VALUE_START), True

    def _wants(self, name: str) -> bool:
        if self._string_args is None:
            return bool(name)
        return name in self._string_args


def _decode(value: str):
    def reject(constant: str):
        raise ValueError(constant)  # NaN and Infinity would make the arguments invalid JSON

    try:
        return json.loads(value, parse_constant=reject)
    except ValueError:
        return value


def _string_args_by_tool(tools: list[dict]) -> dict[str, frozenset[str]]:
    """For each declared tool, the arguments its schema types as strings (kept as raw text)."""
    if not isinstance(tools, list):
        raise ValidationError("tools must be a list")
    string_args = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise ValidationError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}"
            )
        parameters = function.get("parameters") or {}
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        if not isinstance(properties, dict):
            properties = {}  # a schema we do not understand: every value is decoded as JSON
        string_args[name] = frozenset(k for k, v in properties.items() if _is_string_schema(v))
    return string_args


def _is_string_schema(schema) -> bool:
    """True for `"type": "string"`, also when the alternatives are only string or null."""
    if not isinstance(schema, dict):
        return False
    alternatives = [schema]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            alternatives += [a for a in schema[key] if isinstance(a, dict)]
    types = set()
    for alternative in alternatives:
        declared = alternative.get("type")
        for t in declared if isinstance(declared, list) else [declared]:
            if isinstance(t, str):
                types.add(t)
    return types - {"null"} == {"string"}
