"""The C++ decode GEMV (zcode/kernels/gemv.cpp) against float64 references, eager and compiled.

Every CPU with a C++ compiler builds the kernels (AVX-512 BF16 + VNNI paths, or the portable
ones): a failed build fails these tests rather than skipping them.
"""

import pytest
import torch

from zcode.kernels import gemv
from zcode.layers.linear import Linear
from zcode.quant.int4 import W4A8Weight
from zcode.quant.int8 import W8A8Weight


def test_kernels_build_here():
    assert gemv.available()


# Up to 4 rows in one tile of sums; 5 to 32 (a verifying step's) in tiles of 4, the last partial.
FLOAT_ROWS = [1, 2, 3, 4, 5, 8, 13, 16, 23, 32]


@pytest.mark.parametrize("rows", FLOAT_ROWS)
@pytest.mark.parametrize("in_features,out_features", [(576, 1536), (101, 33), (64, 1)])
def test_bf16_linear_matches_float64(rows, in_features, out_features):
    torch.manual_seed(rows)
    layer = Linear(in_features, out_features, bias=True).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    exact = x.double() @ layer.weight.double().T  # [rows, N]: products of bf16 are exact
    # Only the fp32 sum and the final bf16 rounding of the GEMV output and of the bias add.
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    expected = (exact.to(torch.bfloat16) + layer.bias).double()
    tolerance = 2**-7 * (expected.abs() + exact.abs()) + 1e-6
    assert ((got.double() - expected).abs() <= tolerance).all()
    # The bias-free part is the exact sum to fp32 accuracy: the kernel ran, not a bf16 F.linear.
    raw = torch.ops.zcode.gemv_bf16(x, [layer.weight])
    assert torch.allclose(raw.double(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", FLOAT_ROWS)
@pytest.mark.parametrize("in_features,out_features", [(576, 1536), (101, 33), (17, 1)])
def test_fp32_linear_matches_float64(rows, in_features, out_features):
    torch.manual_seed(rows)
    layer = Linear(in_features, out_features, bias=True).requires_grad_(False)
    x = torch.randn(rows, in_features)
    exact = x.double() @ layer.weight.double().T + layer.bias.double()  # [rows, N]
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-5)
    raw = torch.ops.zcode.gemv_f32(x, [layer.weight])  # the path Linear took at these row counts
    assert torch.allclose(got, raw + layer.bias, rtol=0, atol=0)


@pytest.mark.parametrize("bf16_arithmetic", [False, True])
def test_bf16_linear_past_the_gemv_rows_is_one_rounding_of_the_exact_product(
    bf16_arithmetic, monkeypatch
):
    """Past the GEMV's rows a bf16 Linear is a GEMM: torch's bf16 one where the CPU multiplies bf16
    in hardware, else fp32 GEMMs over weight tiles widened exactly (oneDNN's emulated bf16 ran
    ~7x slower). Either way: the exact product rounded once to bf16, then the bias."""
    from zcode.quant import formats

    monkeypatch.setattr(formats, "bf16_arithmetic", lambda: bf16_arithmetic)
    calls = []

    def spy(x, w, bias=None):
        calls.append((x.dtype, w.dtype, w.shape[0]))
        return torch_linear(x, w, bias)

    torch_linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    torch.manual_seed(0)
    out_features = 2 * formats.DEQUANT_TILE_ROWS + 37  # three tiles, the last partial
    layer = Linear(96, out_features, bias=True).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(2, 40, 96).to(torch.bfloat16)  # 80 rows: past FLOAT_GEMV_MAX_ROWS
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 40, out_features)
    exact = x.double() @ layer.weight.double().T
    expected = (exact.to(torch.bfloat16) + layer.bias).double()
    tolerance = 2**-7 * (expected.abs() + exact.abs()) + 1e-6
    assert ((got.double() - expected).abs() <= tolerance).all()
    if bf16_arithmetic:
        assert calls == [(torch.bfloat16, torch.bfloat16, out_features)]
    else:
        tiles = [formats.DEQUANT_TILE_ROWS, formats.DEQUANT_TILE_ROWS, 37]
        assert calls == [(torch.float32, torch.float32, rows) for rows in tiles]


@pytest.mark.parametrize(
    "machine,flags,native",
    [
        ("x86_64", ("avx2", "fma"), False),  # Zen 2/3, Intel client cores: oneDNN emulates bf16
        ("x86_64", ("avx2", "avx512f"), False),  # Skylake-X: AVX-512 without BF16
        ("x86_64", ("avx512f", "avx512_bf16"), True),  # Zen 4/5, Cooper Lake
        ("x86_64", ("avx512f", "amx_bf16"), True),  # Sapphire Rapids
        ("x86_64", None, True),  # flags unknown: torch's bf16 GEMM as asked
        ("aarch64", (), True),  # other ISAs: taken at their word
    ],
)
def test_bf16_arithmetic_is_read_from_the_cpu_flags(machine, flags, native, monkeypatch):
    import importlib

    from zcode.quant.formats import bf16_arithmetic

    probe = importlib.import_module("zcode.hardware.probe")  # the module, not its probe()
    monkeypatch.setattr(probe, "isa_flags", lambda: flags)
    monkeypatch.setattr("platform.machine", lambda: machine)
    assert bf16_arithmetic() is native


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize(
    "rows,in_features,out_features", [(1, 101, 33), (3, 576, 48), (4, 200, 17)]
)
def test_w4a8_gemv_matches_reference(group, rows, in_features, out_features):
    torch.manual_seed(group + rows)
    w = torch.randn(out_features, in_features) * in_features**-0.5
    packed = W4A8Weight.quantize(w, group)
    x = torch.randn(rows, in_features) * 3
    ref = packed.linear_reference(x)  # float64 math on the int8 codes and dequantized weight
    got = packed.mm_gemv(x)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert packed.linear_fast(x).equal(got)  # decode row counts take the GEMV


@pytest.mark.parametrize("rows,in_features,out_features", [(1, 101, 33), (3, 576, 48), (4, 64, 1)])
def test_w8a8_gemv_matches_reference(rows, in_features, out_features):
    torch.manual_seed(rows)
    packed = W8A8Weight.quantize(torch.randn(out_features, in_features) * in_features**-0.5)
    x = torch.randn(rows, in_features) * 3
    ref = packed.linear_reference(x)  # float64 math on the int8 codes
    got = packed.mm_gemv(x)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert packed.linear_fast(x).equal(got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_of_no_rows_is_empty(dtype):
    # A step can ask for no logits (a prefill chunk that does not complete its prompt).
    layer = Linear(32, 8).to(dtype).requires_grad_(False)
    assert layer(torch.randn(0, 32).to(dtype)).shape == (0, 8)


def test_gemv_rejects_too_many_rows():
    with pytest.raises(RuntimeError, match="1 to 32 rows, got 33"):
        torch.ops.zcode.gemv_bf16(torch.randn(33, 32), [torch.randn(8, 32).to(torch.bfloat16)])
    w = W8A8Weight.quantize(torch.randn(8, 32))
    with pytest.raises(RuntimeError, match="1 to 4 rows, got 5"):
        torch.ops.zcode.gemv_w8a8(torch.randn(5, 32), [w.qweight], [w.scales], [w.row_sums], 1e-8)


def test_compiled_graph_calls_the_kernel_once_per_layer():
    torch.manual_seed(0)
    layer = Linear(64, 48, bias=False).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(1, 64).to(torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True)
    assert compiled(x).equal(layer(x))
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("eager")
    torch._dynamo.reset()
    torch.compile(layer, backend=counter, fullgraph=True)(x)
    ops = [n.target for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert torch.ops.zcode.gemv_bf16.default in ops or torch.ops.zcode.gemv_bf16 in ops


def test_autograd_keeps_torch_linear():
    layer = Linear(32, 8).to(torch.bfloat16)  # parameters require grad: F.linear runs
    layer(torch.randn(1, 32).to(torch.bfloat16)).float().sum().backward()
    assert layer.weight.grad is not None


# Sibling linears of uneven widths (k/v narrower than q; W4A8 pads rows to 16, so a matrix's
# padding rows must not shift its neighbours' columns), over odd input widths.
GROUP_WIDTHS = (33, 7, 1)


def _group_modules(kind: str, in_features: int) -> list[torch.nn.Module]:
    from zcode.quant.linear import QuantizedLinear

    modules = []
    for n in GROUP_WIDTHS:
        layer = Linear(in_features, n, bias=True).requires_grad_(False)
        if kind == "bf16-linear":
            layer = layer.to(torch.bfloat16)
        elif kind != "fp32-linear":
            layer = QuantizedLinear.from_linear(layer, kind)
        modules.append(layer)
    return modules


@pytest.mark.parametrize("kind", ["fp32-linear", "bf16-linear", "bf16", "w4a8", "w4a8-g64", "w8a8"])
@pytest.mark.parametrize("rows,in_features", [(1, 576), (2, 101), (4, 128)])
def test_linear_group_is_one_call_equal_to_each_module(kind, rows, in_features, monkeypatch):
    from zcode.layers.linear import linear_group

    torch.manual_seed(rows)
    in_features = 128 if kind == "w4a8-g64" else in_features  # K_pad: a multiple of 64
    modules = _group_modules(kind, in_features)
    dtype = torch.bfloat16 if kind == "bf16-linear" else torch.float32
    x = torch.randn(rows, in_features).to(dtype)
    # Each module's GEMV alone, checked against float64 above. (A QuantizedLinear alone takes
    # its autotuned kernel, which for a matrix this small may be another; a group takes the GEMV.)
    separate = [
        m(x) if isinstance(m, Linear) else (m.packed.mm_gemv(x) + m.bias).to(dtype) for m in modules
    ]
    for m in modules:  # the group must not call the modules
        monkeypatch.setattr(m, "forward", lambda *_: pytest.fail("module ran on its own"))
    grouped = linear_group(x, modules)
    assert [g.shape for g in grouped] == [(rows, n) for n in GROUP_WIDTHS]
    for g, s in zip(grouped, separate):
        assert g.dtype == s.dtype and g.equal(s)


def test_linear_group_runs_modules_alone_when_they_cannot_share_a_call():
    from zcode.layers.linear import linear_group
    from zcode.quant.linear import QuantizedLinear

    torch.manual_seed(0)
    x = torch.randn(2, 64)
    mixed = _group_modules("w4a8", 64)[:2] + [QuantizedLinear.from_linear(Linear(64, 5), "w8a8")]
    calls = []
    hooked = _group_modules("fp32-linear", 64)
    hooked[1].register_forward_pre_hook(lambda *_: calls.append(1))
    many_rows = torch.randn(gemv.MAX_ROWS + 1, 64)
    for modules, inputs in [(mixed, x), (hooked, x), (_group_modules("w4a8", 64), many_rows)]:
        expected = [m(inputs) for m in modules]
        assert all(g.equal(e) for g, e in zip(linear_group(inputs, modules), expected))
    assert calls == [1, 1]  # the hook saw both calls: the group went module by module


def test_gemv_rejects_weights_of_different_widths():
    weights = [torch.randn(8, 32), torch.randn(8, 33)]
    with pytest.raises(RuntimeError, match=r"\[N, 32\]"):
        torch.ops.zcode.gemv_f32(torch.randn(1, 32), weights)
