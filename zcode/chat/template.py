"""Renders a model's chat template in a sandboxed Jinja environment.

Chat templates ship inside checkpoints, so they are untrusted code: the immutable sandbox refuses
attribute access to internals (`__class__`, `__globals__`, ...) and mutation of passed objects.
Any such access fails the render; plain jinja would print it as an empty string and go on.
The globals offered are the ones HF templates expect.
"""

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from zcode.errors import ValidationError


class TemplateError(ValidationError):
    """The template raised (often on purpose, via raise_exception) or failed to render."""


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _StrictSandbox(ImmutableSandboxedEnvironment):
    def unsafe_undefined(self, obj, attribute):
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} is unsafe"
        )


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = _StrictSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template does not parse: {e}") from e


def render_chat(
    template: str,
    messages: list[dict],
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
    tools: list[dict] | None = None,
    special_tokens: dict[str, str] | None = None,
    **kwargs,
) -> str:
    """The prompt text for `messages`; `enable_thinking` is passed through when given."""
    _check_messages(messages)
    variables = dict(special_tokens or {}, **kwargs)
    if enable_thinking is not None:
        variables["enable_thinking"] = enable_thinking
    try:
        return _compile(template).render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables
        )
    except TemplateError:
        raise
    except SecurityError as e:
        raise TemplateError(f"chat template tried an unsafe operation: {e}") from e
    except Exception as e:  # a template is code: any error it raises is the request's problem
        raise TemplateError(f"chat template failed to render: {e}") from e


def _check_messages(messages: list[dict]) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValidationError("messages must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValidationError(f"messages[{i}] must be an object with a 'role'")
