"""Engine configuration: one frozen object, built once and passed down."""

from dataclasses import dataclass

import torch

# "auto": the weights as the checkpoint stores them (a GGUF file's quantized blocks, memory-mapped;
# safetensors in their stored dtype), activations in the model's norm dtype (fp32 for GGUF).
DTYPES = {
    "auto": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


SPECULATIVE_METHODS = ("ngram", "skip_layers", "mtp")


@dataclass(frozen=True)
class EngineConfig:
    dtype: str = "auto"
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    kv_cache_bytes: int = 1 << 30
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
    # Speculative decoding (vLLM's method names where they exist): "ngram" (prompt lookup),
    # "skip_layers" (the model without `draft_skip_layers` drafts; default: every other inner
    # layer) or "mtp" (not built yet); each step verifies up to `num_draft_tokens` drafted tokens
    # per request. Outputs are those of plain decoding; SamplingParams.num_draft_tokens
    # overrides the count per request (0: this request does not speculate).
    speculative: str | None = None
    num_draft_tokens: int = 3
    draft_skip_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_draft_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.speculative is not None and self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative must be one of {SPECULATIVE_METHODS}, got {self.speculative!r}"
            )
        if self.draft_skip_layers is not None:
            object.__setattr__(self, "draft_skip_layers", tuple(self.draft_skip_layers))

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The dtype weights are converted to at load; None keeps them as stored."""
        return DTYPES[self.dtype]
