"""Checks OpenAI chat messages and puts them in the shape transformers' `apply_chat_template`
gives templates, so a prompt renders here exactly as it renders there.

What transformers does, and we do too:
- keys whose value is null are dropped, so `content: null` next to `tool_calls` (what the openai
  client sends back) is absent for the template, not the text `None`;
- a message's reasoning, under any of `reasoning_content`, `thinking` or `reasoning` (vLLM's
  current name), is offered under all three.

What we add, as vLLM does for its templates:
- content parts become one string: GLM-5.1's template renders a tool message whose content is
  `[{"type": "text", ...}]` as an empty `<tools>` block (vllm#39614). Text parts are joined
  without a separator, as GLM's own `visible_text` macro joins a list, so GLM templates render
  the same text either way;
- tool-call arguments become dicts: GLM templates iterate `arguments.items()` while OpenAI
  clients send a JSON string;
- `developer` (OpenAI's newer name for system) becomes `system`, a role GLM templates know.
"""

import json

from zcode.errors import ValidationError

ROLES = ("system", "user", "assistant", "tool")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' order


def normalize_messages(messages: list[dict]) -> list[dict]:
    """A checked copy of `messages` as transformers would hand them to the template."""
    if not isinstance(messages, list) or not messages:
        raise ValidationError("messages must be a non-empty list")
    return [_normalize(i, message) for i, message in enumerate(messages)]


def _normalize(i: int, message: dict) -> dict:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise ValidationError(f"{where} must be an object")
    message = {k: v for k, v in message.items() if v is not None}
    role = message.get("role")
    if role == "developer":
        role = message["role"] = "system"
    if role not in ROLES:
        raise ValidationError(
            f"{where}.role must be one of {', '.join(ROLES + ('developer',))}, got {role!r}"
        )
    if "content" in message:
        message["content"] = _flatten(where, message["content"])
    elif role != "assistant":
        raise ValidationError(f"{where}.content is required for a {role} message")
    if "tool_calls" in message:
        if role != "assistant":
            raise ValidationError(f"{where}.tool_calls is only allowed on assistant messages")
        message["tool_calls"] = _tool_calls(where, message["tool_calls"])
    reasoning = next((message[k] for k in REASONING_FIELDS if k in message), None)
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise ValidationError(f"{where}: reasoning must be a string")
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _flatten(where: str, content) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValidationError(f"{where}.content must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        part_type = part.get("type") if isinstance(part, dict) else None
        if part_type != "text":
            raise ValidationError(
                f"{where}.content[{j}]: content part type {part_type!r} is not supported "
                "(only 'text')"
            )
        if not isinstance(part.get("text"), str):
            raise ValidationError(f"{where}.content[{j}].text must be a string")
        texts.append(part["text"])
    return "".join(texts)


def _tool_calls(where: str, tool_calls) -> list[dict]:
    if not isinstance(tool_calls, list):
        raise ValidationError(f"{where}.tool_calls must be a list")
    normalized = []
    for j, call in enumerate(tool_calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValidationError(f"{at} must have a function with a name")
        function = dict(function, arguments=_arguments(at, function.get("arguments")))
        normalized.append(dict(call, function=function))
    return normalized


def _arguments(at: str, arguments) -> dict:
    if arguments is None or arguments == "":  # clients send either for a call without arguments
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValidationError(f"{at}.function.arguments is not valid JSON: {e}") from None
    if not isinstance(arguments, dict):
        raise ValidationError(f"{at}.function.arguments must be a JSON object")
    return arguments
