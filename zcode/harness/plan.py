"""ExecutionPlan: what runs for a step, as data. Layers receive their slice and obey it.

The plan cache keys compiled graphs by `signature()`; two plans that run the same work have the
same signature whatever their `name` and drafting (speculative decoding changes how many
positions a step scores, never what any of them computes).
"""

import functools
import hashlib
import json
from dataclasses import asdict, dataclass, field, replace


@dataclass(frozen=True)
class ExecutionPlan:
    name: str = "dense"
    # (module name, weight format) pairs, sorted; modules not named keep the loaded weights.
    precision: tuple[tuple[str, str], ...] = ()
    # Fraction of FFN neurons (or neuron blocks) each token computes; 1.0 is dense.
    ffn_density: float = 1.0
    # Decoder layers this plan does not run (and for which it keeps no KV cache).
    skip_layers: tuple[int, ...] = ()
    # (layer, KV head) pairs this plan does not attend with (and keeps no KV for), sorted.
    skip_kv_heads: tuple[tuple[int, int], ...] = ()
    # Extra knobs a planner sets (heads kept per layer, experts per token, ...), as sorted pairs.
    extras: tuple[tuple[str, str], ...] = field(default=())
    # Speculative decoding: drafted tokens each step verifies at most. None: the engine's own
    # (its num_draft_tokens, cut per step by its draft policy); 0: none. Lossless, so in no
    # signature.
    num_draft_tokens: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.ffn_density <= 1.0:
            raise ValueError(f"ffn_density must be in (0, 1], got {self.ffn_density}")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")

    def signature(self) -> str:
        """A short stable hash of everything that changes the computation (not the name, not
        the drafting)."""
        return _digest(self, "name", "num_draft_tokens")

    def kv_signature(self) -> str:
        """A hash of what changes the KV of the layers and heads a request keeps: everything but
        the name, the drafting and the skips (requests that skip are salted by what they
        skip)."""
        return _digest(self, "name", "num_draft_tokens", "skip_layers", "skip_kv_heads")

    def without_skips(self) -> "ExecutionPlan":
        """The part of the plan that is model state (skips are per request)."""
        return replace(self, skip_layers=(), skip_kv_heads=())


@functools.lru_cache(maxsize=256)  # plans are frozen; the engine asks every step
def _digest(plan: ExecutionPlan, *left_out: str) -> str:
    fields = {k: v for k, v in asdict(plan).items() if k not in left_out}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
