"""Every registered CPU variant against its op's reference on random inputs, odd shapes included.

Parametrized over the registry itself: a variant registered tomorrow is tested here without a
new line. Plus the registry's plumbing: autotune picks a correct variant, skips a wrong one,
caches its choice on disk, and QuantizedLinear runs through it.
"""

import json

import pytest
import torch
from kernel_cases import check_variant, variant_cases

from zcode import kernels
from zcode.kernels import autotune
from zcode.kernels.registry import OPS, Variant, outputs_match, register

CPU_VARIANTS = variant_cases("cpu")


def test_every_op_of_the_issue_is_registered():
    expected = {
        "linear", "attention", "mla", "dsa_indexer", "dsa_sparse_attention", "rmsnorm_residual",
        "silu_gate", "rotary", "moe_routing", "moe_experts", "sparse_ffn", "sample_probs",
    }  # fmt: skip
    assert expected <= OPS.keys()
    assert all(op.cases() for op in OPS.values())


@pytest.mark.parametrize(("op_name", "variant", "case_name", "make"), CPU_VARIANTS)
def test_variant_matches_reference(op_name, variant, case_name, make):
    check_variant(op_name, variant, case_name, make)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ZCODE_CACHE_DIR", str(tmp_path))
    autotune.reset()
    yield tmp_path
    autotune.reset()


def test_autotune_caches_a_correct_choice(cache_dir):
    gate, up = torch.randn(3, 50), torch.randn(3, 50)
    fn = kernels.get("silu_gate", gate, up)
    assert torch.allclose(fn(gate, up), torch.nn.functional.silu(gate) * up)
    (path,) = cache_dir.glob("kernels-*.json")
    choices = json.loads(path.read_text())
    assert list(choices) == ["silu_gate|small|float32|cpu"]
    assert choices["silu_gate|small|float32|cpu"] in ("any:reference", "cpu:inplace")


def test_autotune_skips_a_wrong_variant(cache_dir, monkeypatch):
    """A variant that is fast but wrong must never be chosen."""
    op = OPS["silu_gate"]
    monkeypatch.setattr(op, "variants", list(op.variants))
    register("silu_gate", "wrong")(lambda gate, up: up)
    gate, up = torch.randn(2, 30), torch.randn(2, 30)
    chosen, timings = autotune.tune("silu_gate", (gate, up), op.variants)
    assert "cpu:wrong" not in timings and chosen.name != "wrong"


def test_autotune_times_a_tall_gguf_weight_on_its_first_rows(cache_dir, monkeypatch):
    """The reference dequantizes the whole weight: a vocabulary matrix is timed on a slice, and
    the choice is kept under the whole weight's shape class."""
    from gguf import GGMLQuantizationType

    from zcode.kernels import linear
    from zcode.quant.gguf import GgufWeight

    monkeypatch.setattr(linear, "TUNING_MAX_ROWS", 32)
    op = OPS["linear"]
    seen_rows = []
    reference = op.reference
    monkeypatch.setattr(
        op, "reference", lambda p, x: seen_rows.append(p.out_features) or reference(p, x)
    )
    packed = GgufWeight.random(GGMLQuantizationType.Q4_0, 96, 64, torch.Generator().manual_seed(0))
    x = torch.randn(1, 64)
    fn = kernels.get("linear", packed, x)
    assert seen_rows and set(seen_rows) == {32}
    assert torch.allclose(fn(packed, x), reference(packed, x), rtol=1e-5, atol=1e-4)
    (path,) = cache_dir.glob("kernels-*.json")
    assert list(json.loads(path.read_text())) == [f"linear|{op.shape_class(packed, x)}|cpu"]


def test_autotune_reads_its_cache(cache_dir, monkeypatch):
    """A choice on disk is used without timing anything."""
    autotune.cache_path().write_text(json.dumps({"silu_gate|small|float32|cpu": "cpu:inplace"}))
    monkeypatch.setattr(autotune, "tune", lambda *a: pytest.fail("timed despite the cache"))
    gate, up = torch.randn(2, 30), torch.randn(2, 30)
    assert kernels.get("silu_gate", gate, up) is OPS["silu_gate"].variants[0].fn


def test_autotune_cache_is_keyed_by_the_kernel_sources(cache_dir):
    """Choices made for other kernel code (a variant since fixed) are not read."""
    name = autotune.cache_path().name
    assert autotune.fingerprint() in name and autotune.code_version() in name
    assert len(autotune.code_version()) == 12


def test_unsupported_arguments_fall_back_to_the_reference(cache_dir):
    x = torch.randn(2, 8)
    from zcode.quant import quantize_weight

    packed = quantize_weight(torch.randn(4, 8), "w8a8")
    variant: Variant = autotune.choose("linear", (packed, x))
    assert variant.name not in ("packed", "dequantized")  # those two are weight-only int only
    assert variant.supports(packed, x)


def test_outputs_match_can_fail():
    a = torch.ones(3)
    assert not outputs_match(a + 1e-2, a, 1e-4, 1e-5)
    assert not outputs_match(torch.tensor([1, 2]), torch.tensor([1, 3]), 0, 0)
    assert not outputs_match((a, a), (a,), 0, 0)


def test_quantized_linear_runs_the_registry_choice(cache_dir):
    from zcode.quant import QuantizedLinear

    linear = torch.nn.Linear(40, 24)
    q = QuantizedLinear.from_linear(linear, "int4-g32")
    x = torch.randn(5, 40)
    out = q(x)
    choices = json.loads(next(cache_dir.glob("kernels-*.json")).read_text())
    assert any(key.startswith("linear|Int4Weight32|N24xK40|rows<=8|float32") for key in choices)
    expected = q.packed.linear_reference(x) + linear.bias
    assert torch.allclose(out, expected, atol=5e-2)
