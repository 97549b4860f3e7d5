"""The Triton kernels (registered for backend `cuda`) against their ops' references, on CPU
tensors under TRITON_INTERPRET=1, over every case the op defines.

Parametrized over the registry: a Triton variant registered later is tested here too. The
interpreter runs each program in Python, so these run in their own target (`make test-triton`).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

from zcode import kernels  # noqa: E402, F401  (registers every op)
from zcode.kernels.registry import OPS, outputs_match  # noqa: E402

pytestmark = pytest.mark.triton

TRITON_VARIANTS = [
    pytest.param(op.name, variant, case_name, make, id=f"{op.name}-{variant.name}-{case_name}")
    for op in OPS.values()
    for variant in op.variants
    if variant.backend == "cuda"
    for case_name, make in op.cases()
]


def test_the_issue_kernels_are_registered_for_cuda():
    ops = {p.values[0] for p in TRITON_VARIANTS}
    assert {
        "moe_routing",
        "moe_experts",
        "dsa_indexer",
        "dsa_sparse_attention",
        "sparse_ffn",
    } <= ops


@pytest.mark.parametrize(("op_name", "variant", "case_name", "make"), TRITON_VARIANTS)
def test_triton_variant_matches_reference(op_name, variant, case_name, make):
    op = OPS[op_name]
    args = make(torch.Generator().manual_seed(0))
    if not variant.supports(*args):
        pytest.skip(f"{variant.key} does not take {case_name}")
    expected = op.reference(*args)
    actual = variant.fn(*args)
    assert outputs_match(actual, expected, *op.tolerance(*args)), f"{variant.key} on {case_name}"
