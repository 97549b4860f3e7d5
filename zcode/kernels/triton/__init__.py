"""Triton kernels, registered for backend `cuda`: MoE routing and expert dispatch, the DSA
indexer score + top-k and sparse attention, and the fused sparse FFN.

Triton is imported only when one of them first runs, so importing the registry stays cheap
and a test can set TRITON_INTERPRET=1 (run the kernels on CPU tensors) before that happens.
Their logic is tested on CPU under the interpreter (tests/test_kernels_triton.py);
bench/bench_triton_gpu.py checks them on a GPU against the CPU reference and times them at
GLM-sized shapes against the same reference run by PyTorch on the GPU.
"""

import importlib
import importlib.util
from collections.abc import Callable

from zcode.kernels.registry import register

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _lazy(module: str, name: str) -> Callable:
    def run(*args):
        return getattr(importlib.import_module(f"zcode.kernels.triton.{module}"), name)(*args)

    run.__name__ = f"triton_{module}_{name}"
    return run


def _supports(module: str, name: str | None = None) -> Callable[..., bool]:
    def supports(*args) -> bool:
        if not HAS_TRITON:
            return False
        if name is None:
            return True
        return getattr(importlib.import_module(f"zcode.kernels.triton.{module}"), name)(*args)

    return supports


# fmt: off
register("moe_routing", "triton", "cuda", _supports("moe", "routing_supported"))(
    _lazy("moe", "routing"))
register("moe_experts", "triton", "cuda", _supports("moe"))(_lazy("moe", "experts"))
register("dsa_indexer", "triton", "cuda", _supports("dsa"))(_lazy("dsa", "indexer"))
register("dsa_sparse_attention", "triton", "cuda", _supports("dsa"))(
    _lazy("dsa", "sparse_attention"))
register("sparse_ffn", "triton", "cuda", _supports("sparse_ffn"))(
    _lazy("sparse_ffn", "sparse_ffn"))
# fmt: on
