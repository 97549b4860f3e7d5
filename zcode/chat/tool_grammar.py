"""The Lark grammar (llguidance's dialect) that makes a forced GLM tool call valid by construction.

`tool_choice: "required"` or a named tool begins the call in the prompt (`<tool_call>`, plus the
name when named); this grammar constrains the rest, so every call the model can write is one the
request's tools declare, with the arguments their schemas require, each typed as the schema says:

    get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>

Arguments come in the schema's `properties` order, required ones always, optional ones maybe, and
no others. A string-typed value is raw text (what GLM writes and `tool_parser` keeps as text); any
other value is JSON checked against its schema by llguidance's `%json`. Both GLM layouts parse:
a newline may precede each tag.
"""

import json

from zcode.chat.tool_parser import CALL_END, VALUE_END, _is_string_schema
from zcode.engine.structured_output import JSON_WHITESPACE
from zcode.errors import ValidationError

# Raw string text up to the first `</arg_value>` (one lexeme, so the lexer cannot run past it).
_NOT_PAST_END = r"~/(.|\n)*<\/arg_value>(.|\n)+/"


def tool_call_grammar(tools: list[dict], name: str | None, parallel: bool) -> str:
    """The grammar for what follows `<tool_call>` (and `name`, when the call is named)."""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    rules: list[str] = []
    if name is not None:
        rules.append(f"start: {_args_rule(0, by_name[name], rules)} {_lit(chr(10))}? "
                     f"{_lit(CALL_END)}")  # fmt: skip
        return "\n".join(rules)
    calls = []
    for i, function in enumerate(by_name.values()):
        args = _args_rule(i, function, rules)
        rules.append(f"call_{i}: {_lit(function['name'])} {args} {_lit(chr(10))}? {_lit(CALL_END)}")
        calls.append(f"call_{i}")
    rules.append(f"any_call: {' | '.join(calls)}")
    more = f' ({_lit(chr(10))}? "<tool_call>" any_call)*' if parallel else ""
    rules.insert(0, f"start: any_call{more}")
    return "\n".join(rules)


def _args_rule(i: int, function: dict, rules: list[str]) -> str:
    parameters = function.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise ValidationError(f"tool {function['name']!r}: parameters must be a JSON schema object")
    properties = parameters.get("properties") or {}
    required = parameters.get("required") or []
    if not isinstance(properties, dict) or not isinstance(required, list):
        raise ValidationError(f"tool {function['name']!r}: properties / required are malformed")
    missing = [k for k in required if k not in properties]
    if missing:
        raise ValidationError(
            f"tool {function['name']!r} requires {missing} without declaring its schema"
        )
    defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    pairs = []
    for j, (key, schema) in enumerate(properties.items()):
        pair = f"pair_{i}_{j}"
        key_tag = f"{_lit(chr(10))}? {_lit(f'<arg_key>{key}</arg_key>')} {_lit(chr(10))}? "
        rules.append(f"{pair}: {key_tag}{_lit('<arg_value>')} {_value(pair, schema, defs, rules)}")
        pairs.append(pair if key in required else f"{pair}?")
    rules.append(f"args_{i}: {' '.join(pairs)}" if pairs else f'args_{i}: ""')
    return f"args_{i}"


def _value(pair: str, schema, defs: dict, rules: list[str]) -> str:
    """The value and its closing `</arg_value>`."""
    if not isinstance(schema, dict):
        schema = {}
    if _is_string_schema(schema):
        choices = schema.get("enum") if "const" not in schema else [schema["const"]]
        if isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices):
            return f"({' | '.join(map(_lit, choices))}) {_lit(VALUE_END)}"
        body = r"(.|\n)*"
        low, high = schema.get("minLength"), schema.get("maxLength")
        if isinstance(low, int) or isinstance(high, int):
            body = rf"(.|\n){{{low or 0},{high if isinstance(high, int) else ''}}}"
        if isinstance(schema.get("pattern"), str):
            body = schema["pattern"].removeprefix("^").removesuffix("$").replace("/", r"\/")
        terminal = pair.upper()
        rules.append(f"{terminal}: /({body})<\\/arg_value>/ & {_NOT_PAST_END}")
        return terminal
    whitespace = {"x-guidance": {"whitespace_pattern": JSON_WHITESPACE}}
    rules.append(f"{pair}_json: %json {json.dumps({**whitespace, **defs, **schema})}")
    return f"{pair}_json {_lit(VALUE_END)}"


def _lit(text: str) -> str:
    return json.dumps(text)
