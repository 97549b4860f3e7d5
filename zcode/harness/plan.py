"""ExecutionPlan: what runs for a step, as data. Layers receive their slice and obey it.

The plan cache keys compiled graphs by `signature()`; two plans that run the same work have the
same signature whatever their `name`.
"""

import hashlib
import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class ExecutionPlan:
    name: str = "dense"
    # (module name, weight format) pairs, sorted; modules not named keep the loaded weights.
    precision: tuple[tuple[str, str], ...] = ()
    # Fraction of FFN neurons (or neuron blocks) each token computes; 1.0 is dense.
    ffn_density: float = 1.0
    # Decoder layers this plan does not run (and for which it keeps no KV cache).
    skip_layers: tuple[int, ...] = ()
    # Extra knobs a planner sets (heads kept per layer, experts per token, ...), as sorted pairs.
    extras: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        if not 0.0 < self.ffn_density <= 1.0:
            raise ValueError(f"ffn_density must be in (0, 1], got {self.ffn_density}")

    def signature(self) -> str:
        """A short stable hash of everything that changes the computation (not the name)."""
        fields = asdict(self)
        fields.pop("name")
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @property
    def is_dense(self) -> bool:
        return not self.precision and self.ffn_density == 1.0 and not self.skip_layers
