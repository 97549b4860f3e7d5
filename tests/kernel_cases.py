"""The registry's variants paired with the cases of their op that they take, for the tests that
check every variant against its reference (CPU here, Triton under the interpreter)."""

import pytest
import torch

from zcode.kernels.registry import OPS, outputs_match


def _inputs(make):
    return make(torch.Generator().manual_seed(0))


def variant_cases(backend: str) -> list:
    """pytest params (op name, variant, case name, make) of every `backend` variant and every case
    of its op the variant supports; a pair it does not take is not a test (not a skip)."""
    params = []
    for op in OPS.values():
        for variant in op.variants:
            if variant.backend != backend:
                continue
            for case_name, make in op.cases():
                if variant.supports(*_inputs(make)):
                    param_id = f"{op.name}-{variant.name}-{case_name}"
                    params.append(pytest.param(op.name, variant, case_name, make, id=param_id))
    return params


def check_variant(op_name, variant, case_name, make) -> None:
    op = OPS[op_name]
    args = _inputs(make)  # fresh: a variant may work in place
    expected = op.reference(*args)
    actual = variant.fn(*args)
    assert outputs_match(actual, expected, *op.tolerance(*args)), f"{variant.key} on {case_name}"
