"""A request's state as the engine sees it: tokens, progress, blocks and output so far."""

import enum
import itertools
import time

from zcode.engine.detokenizer import IncrementalDetokenizer
from zcode.harness.plan import ExecutionPlan
from zcode.sampling_params import SamplingParams
from zcode.spec.acceptance import RunYields

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer | None,
        request_id: str | None = None,
        cache_salt: str = "",
        skip_layers: frozenset[int] = frozenset(),
        skip_kv_heads: frozenset[tuple[int, int]] = frozenset(),
        plan: ExecutionPlan | None = None,
    ) -> None:
        self.seq_id = next(_ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.params = params
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.block_table: list[int] = []
        self.cache_salt = cache_salt  # prefix-cache blocks are shared under equal salts only
        self.request_salt: str | None = None  # the caller's part of it (LLMEngine.revise)
        self.skip_layers = skip_layers  # decoder layers it never runs, and keeps no KV for
        self.skip_kv_heads = skip_kv_heads  # (layer, KV head) pairs it never reads or keeps
        # The model state its forwards run under (precision, FFN level; no skips): None is the
        # engine's default plan. The engine runs each step's rows grouped by it.
        self.plan = plan
        self.block_hashes: list[bytes] = []  # chained content hash of each full block of tokens
        self.num_hashed_blocks = 0  # leading blocks of block_table already offered to the cache
        self.num_cached_tokens = 0  # tokens reused from the prefix cache at the latest admission
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # "stop", "length" or "abort"
        self.stop_reason: int | str | None = None
        self.detokenizer = detokenizer
        self.emitted_text_len = 0  # how much of the output text has been streamed
        self.output_logprobs: list[dict[int, float]] = []
        self.prompt_logprobs: list[dict[int, float] | None] = [None]
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.grammar = None  # a GrammarMatcher when the request constrains its output
        # Speculative decoding: the most tokens a drafter may propose per step (0: off), the
        # tokens proposed for the running step (scored with it, never in token_ids or the prefix
        # cache until accepted), and running totals for acceptance reports.
        self.num_lookahead_tokens = 0
        self.spec_token_ids: list[int] = []
        self.num_spec_steps = 0  # steps that verified at least one drafted token
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.draft_yields = RunYields()  # what its runs of k drafts kept, by k

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.num_output_tokens == 0

    @property
    def is_decoding(self) -> bool:
        """Every token but the last sampled one is cached: the next step computes one token."""
        return self.num_output_tokens > 0 and self.num_tokens - self.num_computed_tokens == 1

    @property
    def output_text(self) -> str:
        return self.detokenizer.output_text if self.detokenizer else ""
