"""Engine configuration: one frozen object, built once and passed down."""

from dataclasses import dataclass

import torch

from zcode.distributed.config import ParallelConfig

# "auto": the weights as the checkpoint stores them (a GGUF file's quantized blocks, memory-mapped;
# safetensors in their stored dtype), activations in the model's norm dtype (fp32 for GGUF).
DTYPES = {
    "auto": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


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
    # Expert offload (zcode/engine/expert_cache.py): the RAM budget of the routed experts, which
    # stay memory-mapped (dtype auto), in GB (10^9 bytes) or as a fraction of their bytes.
    expert_cache_gb: float | None = None
    expert_cache_fraction: float | None = None
    # "lru": the most recently routed stay; "lfu": the most routed (decayed). bench_offload.py
    # measures both: LRU's hit rate was higher on the tiny random glm4_moe (0.81 vs 0.74 at 50%).
    expert_cache_policy: str = "lru"
    # Processes that share the model (torchrun ranks) and how they split it.
    parallel: ParallelConfig = ParallelConfig()

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.parallel, ParallelConfig):
            raise ValueError(f"parallel must be a ParallelConfig, got {type(self.parallel)}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
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

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The dtype weights are converted to at load; None keeps them as stored."""
        return DTYPES[self.dtype]
