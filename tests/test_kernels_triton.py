"""The Triton kernels (registered for backend `cuda`) against their ops' references, on CPU
tensors under TRITON_INTERPRET=1, over every case the op defines.

Parametrized over the registry: a Triton variant registered later is tested here too. The
interpreter runs each program in Python, so these run in their own target (`make test-triton`).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module imports triton

import pytest  # noqa: E402
from kernel_cases import check_variant, variant_cases  # noqa: E402

from zcode import kernels  # noqa: E402, F401  (registers every op)

pytestmark = pytest.mark.triton

TRITON_VARIANTS = variant_cases("cuda")


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
    check_variant(op_name, variant, case_name, make)
