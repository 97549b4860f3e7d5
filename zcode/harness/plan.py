"""ExecutionPlan: what runs for a step, as data. Layers receive their slice and obey it.

The plan cache keys compiled graphs by `signature()`; two plans that run the same work have the
same signature whatever their `name`.
"""

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

    def __post_init__(self) -> None:
        if not 0.0 < self.ffn_density <= 1.0:
            raise ValueError(f"ffn_density must be in (0, 1], got {self.ffn_density}")

    def signature(self) -> str:
        """A short stable hash of everything that changes the computation (not the name)."""
        fields = asdict(self)
        fields.pop("name")
        return _digest(fields)

    def kv_signature(self) -> str:
        """A hash of what changes the KV of the layers and heads a request keeps: everything but
        the name and the skips (requests that skip are salted by what they skip)."""
        fields = asdict(self)
        for name in ("name", "skip_layers", "skip_kv_heads"):
            fields.pop(name)
        return _digest(fields)

    def without_skips(self) -> "ExecutionPlan":
        """The part of the plan that is model state (skips are per request)."""
        return replace(self, skip_layers=(), skip_kv_heads=())


def _digest(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
