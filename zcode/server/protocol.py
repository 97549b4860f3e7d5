"""Request bodies of the OpenAI-compatible API as pydantic models, and the API's error type.

Field names and defaults are OpenAI's, plus vLLM's sampling extras (`top_k`, `min_p`,
`repetition_penalty`, `stop_token_ids`, ...) and constraints (`structured_outputs` and the older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`). Unknown fields are ignored,
as OpenAI and vLLM do; known fields we cannot honour (`suffix`) are rejected rather than silently
dropped. Ranges are checked by pydantic, so a bad value names its field in the 400; numbers must
be finite.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictInt, model_validator

from zcode.errors import ValidationError
from zcode.harness.planner import Hints
from zcode.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    SamplingParams,
    StructuredOutputsParams,
)

MAX_N = 16
SEED_RANGE = 1 << 63

TokenId = Annotated[int, Field(ge=0)]
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class ApiError(Exception):
    """An error the HTTP layer answers with `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param = message, status, type, param


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    structural_tag: Any = None


class _GenerateRequest(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=-SEED_RANGE, lt=SEED_RANGE)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, Bias] | None = None
    # vLLM's constraints, current and older names; response_format is the OpenAI one (chat)
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    # zcode planning hints, any combination (needs --sparsity): predicted decode ms/token,
    # predicted perplexity increase %, its presets, KV cache bytes per token
    max_latency_ms: float | None = Field(None, gt=0, allow_inf_nan=False)
    max_quality_loss: float | None = Field(None, ge=0, allow_inf_nan=False)
    quality: Literal["max", "balanced", "fast"] | None = None
    max_kv_bytes: StrictInt | None = Field(None, gt=0)
    # zcode: drafted tokens verified per step for this request (a server started with
    # --speculative; at most its --num-draft-tokens; 0 turns speculation off for the request)
    num_draft_tokens: StrictInt | None = Field(None, ge=0)
    # vLLM's: prefix-cache blocks are shared only among requests with the same salt
    cache_salt: str | None = Field(None, min_length=1)
    # zcode: decoder layers, and [layer, KV head] pairs, this request never runs and keeps no KV
    # for (needs --per-request-depth)
    skip_layers: list[StrictInt] | None = Field(None, max_length=1024)
    skip_kv_heads: list[tuple[StrictInt, StrictInt]] | None = Field(None, max_length=65536)
    # zcode: a MoE model's routed experts per token (its router's first ones; the other
    # dimensions still planned)
    experts_per_token: StrictInt | None = Field(None, ge=1)

    def hints(self) -> Hints:
        """The request's planning hints; its skips fix its depth."""
        return Hints(
            max_latency_ms=self.max_latency_ms,
            max_quality_loss=self.max_quality_loss,
            quality=self.quality,
            max_kv_bytes=self.max_kv_bytes,
            skip_layers=tuple(self.skip_layers or ()),
            skip_kv_heads=tuple(tuple(p) for p in self.skip_kv_heads or ()),
            experts_per_token=self.experts_per_token,
        )

    def skips(self) -> dict:
        """The layers and KV heads the request skips, as AsyncEngine.requests takes them."""
        return {
            "skip_layers": tuple(self.skip_layers or ()),
            "skip_kv_heads": tuple(self.skip_kv_heads or ()),
        }

    def check(self) -> None:
        """Checks across fields, and fields we cannot honour; raises ApiError naming the field."""
        if self.stream_options is not None and not self.stream:
            raise ApiError(
                "Stream options can only be defined when stream=True.", param="stream_options"
            )
        if isinstance(self.stop, list) and len(self.stop) > 16:
            raise ApiError("at most 16 stop strings are supported", param="stop")
        for token in self.logit_bias or {}:
            if not token.isdigit():
                raise ApiError(
                    f"logit_bias keys must be token ids, got {token!r}", param="logit_bias"
                )
        self.structured_outputs_params()  # raises for more than one constraint

    def sampling_params(
        self, max_tokens: int, index: int, logprobs: int | None, prompt_logprobs: int | None
    ) -> SamplingParams:
        """The engine's parameters for choice `index`; each choice gets its own seed."""
        seed = None if self.seed is None else (self.seed + index) % SEED_RANGE
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=max(self.top_k, 0),
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=tuple((int(t), b) for t, b in (self.logit_bias or {}).items()),
            seed=seed,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured_outputs_params(),
            num_draft_tokens=self.num_draft_tokens,
        )

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The grammar the output must follow, if the request sets one; at most one may be set."""
        given = {name: value for name, value in self._constraints() if value is not None}
        if len(given) > 1:
            raise ApiError(
                f"only one kind of constraint per request; got {', '.join(sorted(given))}",
                param=sorted(given)[0],
            )
        if not given:
            return None
        [params] = given.values()
        return params

    def _constraints(self) -> list[tuple[str, StructuredOutputsParams | None]]:
        constraints = [
            ("guided_json", _params("guided_json", json=self.guided_json)),
            ("guided_regex", _params("guided_regex", regex=self.guided_regex)),
            ("guided_choice", _params("guided_choice", choice=self.guided_choice)),
            ("guided_grammar", _params("guided_grammar", grammar=self.guided_grammar)),
        ]
        so = self.structured_outputs
        if so is not None:
            if so.structural_tag is not None:
                raise ApiError(
                    "structured_outputs.structural_tag is not supported",
                    param="structured_outputs",
                )
            fields = so.model_dump(exclude_none=True, exclude={"structural_tag"}, by_alias=True)
            if fields.get("json_object") is False:
                del fields["json_object"]  # asks for nothing
            if len(fields) != 1:
                raise ApiError(
                    "structured_outputs needs exactly one of json, json_object, regex, choice, "
                    "grammar",
                    param="structured_outputs",
                )
            constraints.append(("structured_outputs", _params("structured_outputs", **fields)))
        return constraints

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


def _params(name: str, **constraint) -> StructuredOutputsParams | None:
    [(kind, value)] = constraint.items()
    if value is None:
        return None
    try:
        return StructuredOutputsParams(**{kind: value})
    except ValidationError as e:
        raise ApiError(str(e), param=name) from None


Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(_GenerateRequest):
    prompt: Prompt
    echo: bool = False
    logprobs: NumLogprobs | None = None
    max_tokens: int | None = Field(16, ge=0)
    prompt_logprobs: NumLogprobs | None = None
    add_special_tokens: bool = True
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise ApiError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError("best_of is not supported (it must equal n)", param="best_of")
        if self.max_tokens == 0 and not self.echo:
            raise ApiError("max_tokens=0 is only allowed with echo=true", param="max_tokens")


class FunctionDefinition(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: dict[str, str]


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError(
                "When response_format type is 'json_schema', the 'json_schema' field must be "
                "provided."
            )
        return self


class ChatCompletionRequest(_GenerateRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # `tools` as the client sent them (key order, fields we do not model): what the template sees
    _raw_tools: list[dict] | None = PrivateAttr(None)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_raw_tools(cls, data, handler):
        request = handler(data)
        if isinstance(data, dict) and request.tools:
            request._raw_tools = data["tools"]
        return request

    @property
    def raw_tools(self) -> list[dict] | None:
        if self._raw_tools is not None:
            return self._raw_tools
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(
                "when using `top_logprobs`, `logprobs` must be set to true", param="top_logprobs"
            )
        if self.tools is not None and not self.tools:
            raise ApiError("`tools` must not be an empty array", param="tools")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ApiError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.get("name")
            if name not in {t.function.name for t in self.tools or []}:
                raise ApiError(
                    "The tool specified in `tool_choice` does not match any of the specified "
                    "`tools`",
                    param="tool_choice",
                )
        if self.continue_final_message and self.add_generation_prompt:
            raise ApiError(
                "continue_final_message and add_generation_prompt cannot both be true",
                param="continue_final_message",
            )

    def _constraints(self) -> list[tuple[str, StructuredOutputsParams | None]]:
        return super()._constraints() + [("response_format", self._response_format())]

    def _response_format(self) -> StructuredOutputsParams | None:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        schema = fmt.json_schema.get("schema")
        if not isinstance(schema, dict):
            raise ApiError(
                "response_format json_schema needs a 'schema' object", param="response_format"
            )
        return StructuredOutputsParams(json=schema)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` and `messages`")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]
