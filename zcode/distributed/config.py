"""ParallelConfig: how many processes share one model, and how they split it."""

from dataclasses import dataclass

from zcode.errors import ValidationError


@dataclass(frozen=True)
class ParallelConfig:
    """tensor_parallel_size: processes that split every layer by heads and FFN columns (one
    torchrun process each). expert_parallel: MoE layers give each of those processes a range of
    whole routed experts instead of a slice of every expert (vLLM's --enable-expert-parallel).
    pipeline_parallel_size: processes that each run a contiguous range of the decoder layers and
    hold only their KV cache (zcode.distributed.pipeline); not yet combined with the tensor split.
    collective_timeout_s: how long a collective inside a forward pass waits for the other ranks
    before the step fails (a dead or hung rank)."""

    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    pipeline_parallel_size: int = 1
    collective_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValidationError(f"{name} must be a positive integer, got {value!r}")
        if self.collective_timeout_s <= 0:
            raise ValidationError(
                f"collective_timeout_s must be positive, got {self.collective_timeout_s}"
            )
        if self.expert_parallel and self.tensor_parallel_size == 1:
            raise ValidationError(
                "expert_parallel splits the experts over the tensor-parallel processes: "
                "set tensor_parallel_size to 2 or more"
            )
        if self.pipeline_parallel_size > 1 and self.tensor_parallel_size > 1:
            raise NotImplementedError(
                "pipeline parallelism of tensor-parallel stages (pipeline_parallel_size and "
                "tensor_parallel_size both above 1): not built yet (issue 19); use one of them"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1
