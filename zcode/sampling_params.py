import math
from dataclasses import dataclass, field

from zcode.errors import ValidationError

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint: `json` (a JSON schema, dict or string), `json_object` (any JSON
    object), `regex`, `choice` (one of these strings) or `grammar` (a Lark grammar)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [
            self.json is not None,
            self.json_object,
            self.regex is not None,
            bool(self.choice),
            self.grammar is not None,
        ]
        if sum(given) != 1:
            raise ValidationError(
                "structured output needs exactly one of json, json_object, regex, choice, grammar"
            )


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop; vLLM's names and meanings.

    temperature 0 is greedy. top_k <= 0 and top_p = 1 and min_p = 0 disable those filters.
    logit_bias ({token id: bias}) is added to the logits; then repetition_penalty (over prompt and
    output) divides positive and multiplies negative logits of seen tokens; then, over output
    tokens only, frequency_penalty * count and presence_penalty * (count > 0) are subtracted.
    logprobs=N returns the sampled token's log-probability plus the N most likely;
    prompt_logprobs=N does the same for every prompt token after the first.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # Speculative decoding: drafted tokens verified per step for this request (None: the
    # engine's num_draft_tokens; 0: none). Needs an engine built with `speculative`.
    num_draft_tokens: int | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias
        bias = bias.items() if isinstance(bias, dict) else bias or ()
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        finite = [self.temperature, self.top_p, self.min_p, self.repetition_penalty]
        finite += [self.presence_penalty, self.frequency_penalty]
        checks = [
            (all(map(math.isfinite, finite)), "sampling parameters must be finite numbers"),
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                self.repetition_penalty > 0,
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            ),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (
                -2 <= self.presence_penalty <= 2 and -2 <= self.frequency_penalty <= 2,
                "presence_penalty and frequency_penalty must be in [-2, 2]",
            ),
            (
                all(t >= 0 and abs(b) <= MAX_LOGIT_BIAS for t, b in self.logit_bias),
                f"logit_bias needs token ids >= 0 and biases in [-{MAX_LOGIT_BIAS:g}, "
                f"{MAX_LOGIT_BIAS:g}]",
            ),
        ]
        checks.append(
            (
                self.num_draft_tokens is None or self.num_draft_tokens >= 0,
                f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}",
            )
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            checks.append(
                (
                    value is None or 0 <= value <= MAX_LOGPROBS,
                    f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}",
                )
            )
        for ok, message in checks:
            if not ok:
                raise ValidationError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
