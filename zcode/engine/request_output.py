from dataclasses import dataclass

from zcode.harness.report import PlanReport


@dataclass
class RequestOutput:
    """A request's output so far; `delta_*` is what is new since the previous output."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    delta_text: str = ""
    delta_token_ids: list[int] | None = None
    logprobs: list[dict[int, float]] | None = None  # per output token
    prompt_logprobs: list[dict[int, float] | None] | None = None  # per prompt token
    ttft_s: float | None = None
    # the plan that ran, predicted vs measured (with planning hints or speculative decoding)
    plan: PlanReport | None = None
    # expert offload: this request's share of expert hit rate and disk bytes per token
    expert_cache: dict | None = None
