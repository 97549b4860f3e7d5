"""Checks OpenAI chat messages and puts them in the shape GLM chat templates render correctly.

Templates get plain strings, never lists of content parts: GLM-5.1's template renders a tool
message whose content is `[{"type": "text", ...}]` as an empty `<tools>` block, so the tool result
silently vanishes from the prompt (vllm#39614). Text parts are joined without a separator, as
GLM's own `visible_text` macro joins them. Tool-call arguments become dicts, because GLM
templates iterate `arguments.items()` while OpenAI clients send a JSON string.
"""

import json

from zcode.errors import ValidationError

ROLES = ("system", "user", "assistant", "tool")


def normalize_messages(messages: list[dict]) -> list[dict]:
    """A checked copy of `messages` with string contents and dict tool-call arguments.

    `developer` (OpenAI's newer name for system) becomes `system`, a role GLM templates know.
    """
    if not isinstance(messages, list) or not messages:
        raise ValidationError("messages must be a non-empty list")
    return [_normalize(i, message) for i, message in enumerate(messages)]


def _normalize(i: int, message: dict) -> dict:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise ValidationError(f"{where} must be an object")
    message = dict(message)
    role = message.get("role")
    if role == "developer":
        role = message["role"] = "system"
    if role not in ROLES:
        raise ValidationError(
            f"{where}.role must be one of {', '.join(ROLES + ('developer',))}, got {role!r}"
        )
    content = message.get("content")
    if content is None:
        if role != "assistant":
            raise ValidationError(f"{where}.content is required for a {role} message")
    else:
        message["content"] = _flatten(where, content)
    if message.get("tool_calls") is None:
        message.pop("tool_calls", None)  # an explicit null is as good as absent
    else:
        if role != "assistant":
            raise ValidationError(f"{where}.tool_calls is only allowed on assistant messages")
        message["tool_calls"] = _tool_calls(where, message["tool_calls"])
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
        except json.JSONDecodeError as e:
            raise ValidationError(f"{at}.function.arguments is not valid JSON: {e}") from e
    if not isinstance(arguments, dict):
        raise ValidationError(f"{at}.function.arguments must be a JSON object")
    return arguments
