"""The Triton kernels (registered for backend `cuda`) against their ops' references, on CPU
tensors under TRITON_INTERPRET=1, over every case the op defines.

Parametrized over the registry: a Triton variant registered later is tested here too. The
interpreter runs each program in Python, so these run in their own target (`make test-triton`).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module imports triton

import pytest  # noqa: E402
import torch  # noqa: E402
from kernel_cases import check_variant, variant_cases  # noqa: E402

from zcode import kernels  # noqa: E402, F401  (registers every op)
from zcode.kernels.registry import OPS, outputs_match  # noqa: E402

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


# --- MoE decode GEMVs and the grouped GEMM, forced, on odd shapes -------------------------------

# (tokens, hidden, inter, experts, top_k, experts hit): hit < experts leaves experts unrouted
EXPERT_SHAPES = [
    (1, 72, 40, 16, 8, 16),
    (1, 33, 17, 5, 1, 5),
    (3, 72, 40, 24, 8, 12),
    (7, 130, 50, 12, 1, 3),
    (16, 40, 24, 32, 8, 20),
]


def _experts_args(tokens, hidden, inter, num_experts, top_k, num_hit):
    g = torch.Generator().manual_seed(tokens * 1000 + hidden)
    x = torch.randn(tokens, hidden, generator=g)
    hit = torch.randperm(num_experts, generator=g)[:num_hit]
    scores = torch.rand(tokens, num_hit, generator=g)
    weights, slots = scores.topk(top_k, dim=-1)
    w_gate, w_up = (
        torch.randn(num_experts, inter, hidden, generator=g) * hidden**-0.5 for _ in "gu"
    )
    w_down = torch.randn(num_experts, hidden, inter, generator=g) * inter**-0.5
    return x, weights, hit[slots], w_gate, w_up, w_down


def _decode_tiles():
    """Default tiles, and odd ones: several output blocks, splits of the reduced dim that end
    mid-tile or are empty."""
    from zcode.kernels.triton import moe

    return {
        "default": moe.DECODE_TILES,
        "odd": moe.DecodeTiles(moe.GemvTiles(16, 32, 3), moe.GemvTiles(16, 16, 2, num_warps=2)),
    }


@pytest.mark.parametrize("tiles", ["default", "odd"])
@pytest.mark.parametrize(
    "shape", EXPERT_SHAPES, ids=lambda s: "T{}-D{}-I{}-E{}-k{}-hit{}".format(*s)
)
def test_moe_decode_gemvs_match_reference(shape, tiles):
    from zcode.kernels.triton import moe

    args = _experts_args(*shape)
    expected = OPS["moe_experts"].reference(*args)
    actual = moe.experts_decode(*args, tiles=_decode_tiles()[tiles])
    assert outputs_match(actual, expected, *OPS["moe_experts"].tolerance(*args))


@pytest.mark.parametrize("shape", EXPERT_SHAPES[2:], ids=lambda s: f"T{s[0]}-k{s[4]}")
def test_moe_grouped_gemm_matches_reference(shape):
    from zcode.kernels.triton import moe

    args = _experts_args(*shape)
    expected = OPS["moe_experts"].reference(*args)
    assert outputs_match(moe.experts_grouped(*args), expected, *OPS["moe_experts"].tolerance(*args))


def test_moe_experts_takes_the_decode_path_for_few_rows_only(monkeypatch):
    from zcode.kernels.triton import moe

    taken = []
    monkeypatch.setattr(moe, "experts_decode", lambda *a: taken.append("decode"))
    monkeypatch.setattr(moe, "experts_grouped", lambda *a: taken.append("grouped"))
    for tokens in (moe.DECODE_MAX_ROWS // 8, moe.DECODE_MAX_ROWS // 8 + 1):
        moe.experts(*_experts_args(tokens, 8, 8, 16, 8, 16))
    assert taken == ["decode", "grouped"]


def test_moe_decode_bf16_matches_reference():
    from zcode.kernels.triton import moe

    x, weights, ids, *w = _experts_args(2, 72, 40, 16, 8, 16)
    args = (x.bfloat16(), weights, ids, *(t.bfloat16() for t in w))
    expected = OPS["moe_experts"].reference(
        *(a.float() if a.is_floating_point() else a for a in args)
    )
    actual = moe.experts_decode(*args)
    assert actual.dtype == torch.bfloat16
    assert torch.allclose(actual.float(), expected, rtol=2e-2, atol=2e-2)


# --- sparse FFN with down's transpose ------------------------------------------------------------


# (tokens, hidden, inter, kept): the last splits both reductions unevenly over several tiles each
@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "kept"),
    [(1, 33, 97, 40), (7, 33, 97, 40), (16, 33, 97, 40), (3, 1100, 1200, 1100)],
)
def test_sparse_ffn_reads_rows_of_down_transposed(tokens, hidden, inter, kept):
    from zcode.kernels.triton.sparse_ffn import sparse_ffn

    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g)
    w_gate, w_up, w_down_t = (torch.randn(inter, hidden, generator=g) for _ in "gud")
    w_gate, w_up, w_down_t = w_gate * hidden**-0.5, w_up * hidden**-0.5, w_down_t * kept**-0.5
    ids = torch.randperm(inter, generator=g)[:kept]  # unsorted: any order of neurons
    dense_mask = torch.zeros(inter, 1)
    dense_mask[ids] = 1.0  # the oracle: the dense FFN with the other neurons' down rows zeroed
    h = torch.nn.functional.silu(x @ w_gate.T) * (x @ w_up.T)
    expected = h @ (w_down_t * dense_mask)
    assert torch.allclose(
        sparse_ffn(x, w_gate, w_up, w_down_t, ids), expected, rtol=1e-4, atol=1e-5
    )
