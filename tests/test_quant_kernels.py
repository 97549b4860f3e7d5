"""Every weight format's fast kernel against its plain-PyTorch reference, round-to-nearest error
bounds, padding of shapes the kernels refuse, and QuantizedLinear's plumbing.

Tolerance. The fast paths of the bf16-activation formats (bf16, int8, int4, w4a8) round
activations, sometimes the dequantized weight, and the output to bf16 (unit roundoff 2^-9 each).
An output element's error is then a sum of K products each off by a few 2^-9, so we compare it
with the typical size of such a sum, ||x_m|| * ||w_n|| / sqrt(K):

    |fast - ref| <= TOL * ||x_m|| * ||w_n|| / sqrt(K)   elementwise, and
    ||fast - ref|| / ||ref|| <= REL_TOL                  over the whole output.

with TOL = 2^-5 and REL_TOL = 5e-3 (rounding noise measures ~2e-3 relative). A wrong nibble order,
zero point, scale or padding gives errors of order 1. W8A8 sums exactly in int32 and differs from
the float64 reference only in fp32 rescaling, so it gets TOL = REL_TOL = 1e-5.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zcode.quant import FORMATS, QuantizedLinear, quantize_weight
from zcode.quant.formats import quantize_per_token
from zcode.quant.int4 import PACKED_MAX_ROWS as INT4_MAX_ROWS
from zcode.quant.int8 import PACKED_MAX_ROWS as INT8_MAX_ROWS

BF16_TOL, BF16_REL_TOL = 2**-5, 5e-3
EXACT_TOL = 1e-5
# (K, N): a plain one, N odd, K odd (not a multiple of 16 or of any group), K not a multiple of
# 128 (SmolLM2's 576), N not a multiple of 16.
SHAPES = [(64, 48), (96, 33), (101, 24), (576, 40), (160, 1000)]
# 1, 3 and 17 rows, and one count past both packed kernels' limits (the dequantize path).
ROWS = [1, 3, 17, max(INT4_MAX_ROWS, INT8_MAX_ROWS) + 5]


def _weight(num_out: int, num_in: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(num_out, num_in, generator=generator) * num_in**-0.5
    w[0] *= 20  # an outlier row
    if num_out > 2:
        w[1] = 0.0  # an all-zero row: scales must stay finite
        w[2] = 0.3  # a constant row
    return w


def _check_close(fast: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor, fmt):
    tol, rel_tol = (EXACT_TOL, EXACT_TOL) if fmt == "w8a8" else (BF16_TOL, BF16_REL_TOL)
    scale = torch.outer(x.float().norm(dim=1), w.norm(dim=1)) / w.shape[1] ** 0.5  # [M, N]
    excess = (fast.float() - ref).abs() - tol * scale
    assert excess.max() <= 0, f"{fmt}: worst element over tolerance by {excess.max():.3g}"
    rel = ((fast.float() - ref).norm() / ref.norm()).item()
    assert rel <= rel_tol, f"{fmt}: relative error {rel:.3g} > {rel_tol}"


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"K{s[0]}xN{s[1]}")
def test_fast_matches_reference(fmt, shape):
    num_in, num_out = shape
    w = _weight(num_out, num_in, seed=num_in * num_out)
    packed = quantize_weight(w, fmt)
    generator = torch.Generator().manual_seed(1)
    for rows in ROWS:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, num_in, generator=generator).to(dtype)
            ref = packed.linear_reference(x)
            assert ref.shape == (rows, num_out) and ref.dtype == torch.float32
            fast = packed.linear_fast(x)
            assert fast.shape == (rows, num_out), (fmt, rows, dtype)
            # The weight the format stands for, not the original: the kernels' own error only.
            _check_close(fast, ref, x, packed.dequantize(), f"{fmt} M={rows} {dtype}")


@pytest.mark.parametrize("fmt", ["int8", "int4-g32", "w4a8"])
def test_tolerance_catches_a_wrong_weight(fmt):
    """The check above can fail: one group's scale off by 25% (int4) or one row's (int8)."""
    w = _weight(48, 64, seed=3)
    packed = quantize_weight(w, fmt)
    x = torch.randn(4, 64)
    ref = packed.linear_reference(x)
    if fmt == "int8":
        packed.scales[5] *= 1.25
    else:
        packed.scales_and_zeros[1, 5, 0] *= 1.25  # group 1, row 5
        if fmt == "w4a8":  # the decode GEMV reads a row-major copy
            packed.row_scales_and_zeros[5, 1, 0] *= 1.25
    with pytest.raises(AssertionError):
        _check_close(packed.linear_fast(x), ref, x, w, fmt)


@pytest.mark.parametrize("fmt", ["int8", "w8a8"])
def test_int8_round_to_nearest_bound(fmt):
    w = _weight(40, 101, seed=5)
    packed = quantize_weight(w, fmt)
    deq = packed.dequantize()
    assert deq.shape == w.shape
    scales = packed.scales.float()[:, None]
    assert ((w - deq).abs() <= scales / 2 * (1 + 1e-6)).all()
    assert packed.qweight.abs().max() <= 127
    assert deq[1].abs().max() == 0  # the zero row stays zero


@pytest.mark.parametrize("fmt", ["int4-g32", "int4-g64", "int4-g128", "w4a8"])
def test_int4_round_to_nearest_bound(fmt):
    w = _weight(40, 160, seed=7)  # 160: a partial last group for 64 and 128
    packed = quantize_weight(w, fmt)
    deq = packed.dequantize()
    assert deq.shape == w.shape
    group = packed.group_size
    scales = packed.scales_and_zeros[..., 0].float().t()[: w.shape[0]]  # [N, G]
    per_weight = scales.repeat_interleave(group, dim=1)[:, : w.shape[1]]
    assert ((w - deq).abs() <= per_weight / 2 * (1 + 1e-5) + 1e-7).all()
    assert torch.allclose(deq[2], w[2], rtol=2**-8)  # a constant row is (nearly) exact
    assert deq[1].abs().max() < 1e-6  # the zero row stays zero


def test_per_token_activation_bound():
    x = torch.randn(7, 33) * torch.logspace(-3, 3, 7)[:, None]
    x[3] = 0.0
    q, scale = quantize_per_token(x)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert ((x - q.float() * scale).abs() <= scale / 2 * (1 + 1e-6)).all()
    assert (q.abs().amax(dim=1)[torch.arange(7) != 3] == 127).all()


def test_w8a8_is_the_integer_product():
    """The fast path's sum is the exact integer sum: compare with int64 arithmetic."""
    w = _weight(24, 101, seed=9)
    packed = quantize_weight(w, "w8a8")
    x = torch.randn(5, 101)
    xq, x_scale = quantize_per_token(x)
    acc = xq.long() @ packed.qweight[:, :101].long().t()
    want = acc.double() * x_scale.double() * packed.scales.double()
    torch.testing.assert_close(packed.linear_fast(x).double(), want, rtol=1e-6, atol=0)


def test_weight_bytes():
    w = torch.randn(1536, 576)
    bits = {fmt: QuantizedLinear.from_linear(_linear(w), fmt).bits_per_weight for fmt in FORMATS}
    assert bits["bf16"] == 16
    assert bits["int8"] == bits["w8a8"] == pytest.approx(8 + 16 / 576)
    assert bits["int4-g32"] == bits["w4a8"] == pytest.approx(4 + 32 / 32)
    assert bits["int4-g64"] == pytest.approx(4 + 32 / 64)
    # 576 is padded to 640 for groups of 128: the padding is read too, and counted.
    assert bits["int4-g128"] == pytest.approx((4 + 32 / 128) * 640 / 576)


def test_unknown_format_and_group_size():
    with pytest.raises(ValueError, match="unknown weight format"):
        quantize_weight(torch.randn(16, 32), "int4-g16")
    from zcode.quant.int4 import Int4Weight

    with pytest.raises(ValueError, match="group size"):
        Int4Weight.quantize(torch.randn(16, 32), group_size=16)


def _linear(w: torch.Tensor, bias: bool = False) -> nn.Linear:
    linear = nn.Linear(w.shape[1], w.shape[0], bias=bias)
    with torch.no_grad():
        linear.weight.copy_(w)
        if bias:
            linear.bias.normal_()
    return linear


@pytest.mark.parametrize("fmt", ["int8", "int4-g64", "w8a8"])
def test_quantized_linear_module(fmt):
    linear = _linear(_weight(33, 96, seed=11), bias=True)
    module = QuantizedLinear.from_linear(linear, fmt)
    x = torch.randn(2, 3, 96)
    for dtype in (torch.float32, torch.bfloat16):
        out = module(x.to(dtype))
        assert out.shape == (2, 3, 33) and out.dtype == dtype
    fast = module(x)
    module.kernel = "reference"
    ref = module(x)
    want = F.linear(x, module.packed.dequantize(), linear.bias)
    if fmt != "w8a8":  # w8a8's reference also quantizes the activations
        torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5)
    _check_close(
        (fast - linear.bias).view(6, 33),
        (ref - linear.bias).view(6, 33),
        x.view(6, 96),
        module.packed.dequantize(),
        fmt,
    )
    assert module(torch.randn(0, 96)).shape == (0, 33)  # a step that wants no logits
    with pytest.raises(ValueError, match="kernel"):
        module.kernel = "turbo"
    assert "format=" + fmt in repr(module)
