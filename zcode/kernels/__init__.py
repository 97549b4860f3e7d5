"""Kernel registry: a reference and autotuned fast variants per op and backend.

    from zcode import kernels
    out = kernels.call("silu_gate", gate, up)         # autotuned choice for these arguments
    fn = kernels.get("linear", packed, x)             # the callable, to call many times

Ops: linear (per weight format), attention (paged GQA), mla, dsa_indexer, dsa_sparse_attention,
rmsnorm_residual, silu_gate, rotary, moe_routing, moe_experts, sparse_ffn, sample_probs. Each
module below defines its ops and registers its CPU variants; zcode.kernels.triton registers the
Triton kernels for backend `cuda` (importing Triton only when one runs).
"""

from zcode.kernels import (  # noqa: F401  (each module registers its ops on import)
    activation,
    attention,
    dsa,
    linear,
    moe,
    norm,
    rotary,
    sampling,
    sparse_ffn,
    triton,
)
from zcode.kernels.registry import OPS, call, get, register, variants

__all__ = ["OPS", "call", "get", "register", "variants"]
