"""Renders a model's chat template in a sandboxed Jinja environment.

Chat templates ship inside checkpoints, so they are untrusted code: the immutable sandbox refuses
attribute access to internals (`__class__`, `__globals__`, ...) and mutation of passed objects.
Any such access fails the render; plain jinja would print it as an empty string and go on.
The globals offered are the ones HF templates expect.

The sandbox bounds what a template may touch, not how much work it does, so a render also has a
budget: `time_limit_s` of wall time, checked at every loop step over `range`, call, attribute or
item lookup and `*` / `**`, and `max_chars` of output, checked as the text is produced and before
a `*` builds a long string or list. Past either, the render fails with a TemplateError (a 400 in
the server, which also renders off its event loop).
"""

import json
import threading
import time
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

from zcode.errors import ValidationError

RENDER_TIME_LIMIT_S = 5.0
MAX_RENDER_CHARS = 8 << 20
MAX_POWER_EXPONENT = 4096


class TemplateError(ValidationError):
    """The template raised (often on purpose, via raise_exception) or failed to render."""


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _Budget(threading.local):
    """The running render's limits; one per thread, so concurrent renders do not mix."""

    deadline: float | None = None
    time_limit_s: float = RENDER_TIME_LIMIT_S
    max_chars: int = MAX_RENDER_CHARS

    def check(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise TemplateError(f"chat template took longer than {self.time_limit_s:g} s to render")

    def check_size(self, num_chars: int) -> None:
        if num_chars > self.max_chars:
            raise TemplateError(f"chat template output is longer than {self.max_chars} characters")


_budget = _Budget()


class _BoundedRange:
    """`range` whose every step checks the render's time budget."""

    def __init__(self, *args: int) -> None:
        self._range = safe_range(*args)

    def __iter__(self):
        for i in self._range:
            _budget.check()
            yield i

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, index):
        return self._range[index]


class _StrictSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj, attribute):
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} is unsafe"
        )

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        _budget.check()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj, attribute):
        _budget.check()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _budget.check()
        return super().getitem(obj, argument)

    def call_binop(self, context, operator, left, right):
        _budget.check()
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                    _budget.check_size(len(seq) * times)
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_POWER_EXPONENT:
            if isinstance(left, int) and left not in (-1, 0, 1):
                raise TemplateError(f"chat template raised a number to the power {right}")
        return super().call_binop(context, operator, left, right)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = _StrictSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["range"] = _BoundedRange
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
    time_limit_s: float | None = None,
    max_chars: int | None = None,
    **kwargs,
) -> str:
    """The prompt text for `messages`; `enable_thinking` is passed through when given.

    time_limit_s, max_chars: the render's budget (defaults RENDER_TIME_LIMIT_S, MAX_RENDER_CHARS).
    """
    _check_messages(messages)
    variables = dict(special_tokens or {}, **kwargs)
    if enable_thinking is not None:
        variables["enable_thinking"] = enable_thinking
    compiled = _compile(template)
    if _budget.deadline is not None:
        raise RuntimeError("render_chat does not nest")
    _budget.time_limit_s = RENDER_TIME_LIMIT_S if time_limit_s is None else time_limit_s
    _budget.max_chars = MAX_RENDER_CHARS if max_chars is None else max_chars
    _budget.deadline = time.monotonic() + _budget.time_limit_s
    try:
        pieces, num_chars = [], 0
        for piece in compiled.generate(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables
        ):
            num_chars += len(piece)
            _budget.check_size(num_chars)
            _budget.check()
            pieces.append(piece)
        return "".join(pieces)
    except TemplateError:
        raise
    except SecurityError as e:
        raise TemplateError(f"chat template tried an unsafe operation: {e}") from e
    except Exception as e:  # a template is code: any error it raises is the request's problem
        raise TemplateError(f"chat template failed to render: {e}") from e
    finally:
        _budget.deadline = None


def _check_messages(messages: list[dict]) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValidationError("messages must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValidationError(f"messages[{i}] must be an object with a 'role'")
