"""Engine configuration: one frozen object, built once and passed down."""

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from zcode.distributed.config import ParallelConfig

if TYPE_CHECKING:  # torch stays out of the CLI's start-up, which reads this module
    import torch

# "auto": the weights as the checkpoint stores them (a GGUF file's quantized blocks, memory-mapped;
# safetensors in their stored dtype), activations in the model's norm dtype (fp32 for GGUF).
DTYPES = ("auto", "float32", "bfloat16", "float16")
# The KV cache's dtype (vLLM's kv_cache_dtype): "auto" is the dtype the model computes in; an fp32
# model's cache may be bf16 or fp16 (llama.cpp keeps fp16 by default): half the bytes held
# and read per token of context.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")


SPECULATIVE_METHODS = ("ngram", "skip_layers", "quantized", "mtp")
DRAFT_POLICIES = ("adaptive", "fixed")


@dataclass(frozen=True)
class EngineConfig:
    dtype: str = "auto"
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    kv_cache_bytes: int = 1 << 30
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True  # reuse the KV of full blocks shared by earlier requests
    # Compile decode steps (torch.compile, inductor) per plan and batch-size bucket; the first
    # step of each bucket pays the compile time.
    compile: bool = False
    # KV pages per layer and KV head, so a request may skip decoder layers and KV heads for its
    # whole lifetime and keep no KV for them (add_request(skip_layers=, skip_kv_heads=)); a
    # compiled decode step runs one plan, so a batch mixing plans steps eagerly.
    per_request_depth: bool = False
    # The planner multiplies its latency predictions by measured over predicted ms of the latest
    # planned requests (zcode.harness.report.LatencyFeedback), so latency targets hold at the
    # host's speed of the moment, not the cost fit's. ZCODE_LATENCY_FEEDBACK=0 turns the
    # default off (the tests' conftest does: a plan must not depend on timing there).
    latency_feedback: bool = field(
        default_factory=lambda: os.environ.get("ZCODE_LATENCY_FEEDBACK", "1") != "0"
    )
    # Expert offload (zcode/engine/expert_cache.py): the RAM budget of the routed experts, which
    # stay memory-mapped (dtype auto), in GB (10^9 bytes) or as a fraction of their bytes.
    expert_cache_gb: float | None = None
    expert_cache_fraction: float | None = None
    # "lru": the most recently routed stay; "lfu": the most routed (decayed). bench_offload.py
    # measures both: LRU's hit rate was higher on the tiny random glm4_moe (0.81 vs 0.74 at 50%).
    expert_cache_policy: str = "lru"
    # Read the next MoE layer's experts ahead, as its router scores this layer's input.
    expert_cache_prefetch: bool = True
    # Processes that share the model (torchrun ranks) and how they split it.
    parallel: ParallelConfig = ParallelConfig()
    # Speculative decoding (vLLM's method names where they exist): "ngram" (prompt lookup),
    # "skip_layers" (the model without `draft_skip_layers` drafts; default: every other inner
    # layer), "quantized" (the model with its linears in `draft_format` drafts, default int8)
    # or "mtp" (the checkpoint's MTP layer; its KV and the target's hidden states take
    # cache memory beside kv_cache_bytes); each step verifies up to `num_draft_tokens` drafted
    # tokens per request. Outputs are those of plain decoding; SamplingParams.num_draft_tokens
    # overrides the count per request (0: this request does not speculate).
    speculative: str | None = None
    num_draft_tokens: int = 3
    draft_skip_layers: tuple[int, ...] | None = None
    draft_format: str | None = None
    # "adaptive": each step, each request drafts as many of its num_draft_tokens as pay by its
    # measured acceptance and this machine's cost model (none where speculation does not pay,
    # e.g. large batches; zcode.spec.policy), fixed where no cost model is fitted here or the
    # request set num_draft_tokens; "fixed": always num_draft_tokens.
    draft_policy: str = "adaptive"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if not isinstance(self.parallel, ParallelConfig):
            raise ValueError(f"parallel must be a ParallelConfig, got {type(self.parallel)}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_draft_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.expert_cache_gb is not None and self.expert_cache_fraction is not None:
            raise ValueError("give expert_cache_gb or expert_cache_fraction, not both")
        if self.expert_cache_gb is not None and not 0 <= self.expert_cache_gb < float("inf"):
            raise ValueError(f"expert_cache_gb must be a size >= 0, got {self.expert_cache_gb}")
        if self.expert_cache_fraction is not None and not 0 <= self.expert_cache_fraction <= 1:
            raise ValueError(
                f"expert_cache_fraction must be in [0, 1], got {self.expert_cache_fraction}"
            )
        if self.speculative is not None and self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative must be one of {SPECULATIVE_METHODS}, got {self.speculative!r}"
            )
        if self.draft_policy not in DRAFT_POLICIES:
            raise ValueError(
                f"draft_policy must be one of {DRAFT_POLICIES}, got {self.draft_policy!r}"
            )
        if self.draft_skip_layers is not None:
            object.__setattr__(self, "draft_skip_layers", tuple(self.draft_skip_layers))

    @property
    def torch_dtype(self) -> "torch.dtype | None":
        """The dtype weights are converted to at load; None keeps them as stored."""
        import torch

        return None if self.dtype == "auto" else getattr(torch, self.dtype)
