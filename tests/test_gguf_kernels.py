"""The C++ GGUF kernels (zcode/kernels/ggml.cpp) against the `gguf` package's dequantize.

Weights are random but valid blocks of every type the kernels run (GgufWeight.random: the
package's quantizer where it has one, random bytes with small fp16 scales for the K-quants).
Each GEMV output is checked two ways:

- against a float64 matmul of the package's dequantized weight with x quantized to int8 the way
  the kernel promises (llama.cpp's per-block activations, written here in numpy independently of
  the C++): the same math, so only fp32 rounding differs, |got - ref| <= 1e-6 sum |x_q| |w|;
- against float64 with x as given: rounding x to the nearest of 255 steps of amax / 127 per block
  moves each element by at most half a step, so an output by at most sum_k |w_k| step_k / 2.

Any misread scale, min, high bit or sub-block offset moves outputs by O(1) of sum |x| |w|;
test_every_byte_is_read_as_the_package_reads_it corrupts each byte of a block in turn and
requires the kernel to follow the package.
"""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from zcode.kernels import ggml
from zcode.quant.gguf import (
    ACTIVATION_BLOCK,
    GEMV_MAX_ROWS,
    INTERLEAVED,
    INTERLEAVED_TYPES,
    KERNEL_TYPES,
    GgufEmbedding,
    GgufWeight,
    dequantize_rows,
    interleaving_pays,
    type_name,
)

TYPES = sorted(KERNEL_TYPES)
SAME_QUANTIZATION_RTOL = 1e-6  # fp32 sums over a few blocks, relative to sum |x_q| |w|
# (num_out, blocks): N odd over a few blocks, one output of one block, a wider K.
SHAPES = [(33, 3), (1, 1), (17, 2)]


def _generator(*seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(seed) % 2**31)


def _in_features(ggml_type: int, num_blocks: int) -> int:
    return num_blocks * ACTIVATION_BLOCK.get(ggml_type, 32)


def _quantized_activations(x: torch.Tensor, ggml_type: int) -> np.ndarray:
    """x [M, K] fp32 as the GEMV sees it, float64: per block scale = amax / 127 (fp32), codes =
    round half to even of x / scale; for BF16 weights x rounded to bf16 (half to even on its
    fp32 bits, as llama.cpp); x itself for F32 and F16."""
    xs = x.float().numpy()
    if ggml_type == GGMLQuantizationType.BF16:
        bits = xs.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
        return rounded.view(np.float32).astype(np.float64)
    block = ACTIVATION_BLOCK.get(ggml_type)
    if block is None:
        return xs.astype(np.float64)
    blocks = xs.reshape(xs.shape[0], -1, block)
    scale = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)  # fp32, as the kernel
    codes = np.where(scale > 0, np.rint(blocks / np.where(scale > 0, scale, 1)), 0)
    assert np.abs(codes).max() <= 127
    return (codes.astype(np.float64) * scale.astype(np.float64)).reshape(xs.shape)


def _check_gemv(got: torch.Tensor, x: torch.Tensor, weights: list[GgufWeight]) -> None:
    """got [M, sum N] against both float64 references (see the module docstring)."""
    col = 0
    for w in weights:
        part = got[:, col : col + w.out_features].double().numpy()
        col += w.out_features
        w64 = w.dequantize(torch.float64).numpy()  # the package's dequantize
        xq = _quantized_activations(x, w.ggml_type)
        same = xq @ w64.T
        scale = np.abs(xq) @ np.abs(w64).T
        assert (np.abs(part - same) <= SAME_QUANTIZATION_RTOL * scale + 1e-30).all(), (
            f"{w.type_name}: off the same-quantization reference by "
            f"{(np.abs(part - same) / np.maximum(scale, 1e-30)).max():.3g} of sum |x||w|"
        )
        x64 = x.double().numpy()
        bound = _half_steps(x, w) @ np.abs(w64).T + SAME_QUANTIZATION_RTOL * scale
        assert (np.abs(part - x64 @ w64.T) <= bound).all(), w.type_name
    assert col == got.shape[1]


def _half_steps(x: torch.Tensor, w: GgufWeight) -> np.ndarray:
    """Half the activation rounding step of every element of x [M, K], float64 (bf16: 2^-9
    relative; 0 for F32 and F16 rows)."""
    if w.ggml_type == GGMLQuantizationType.BF16:
        return np.abs(x.double().numpy()) * 2.0**-9
    block = ACTIVATION_BLOCK.get(w.ggml_type)
    if block is None:
        return np.zeros(x.shape)
    blocks = np.abs(x.double().numpy()).reshape(x.shape[0], -1, block)
    return np.broadcast_to(blocks.max(-1, keepdims=True) / 127 / 2, blocks.shape).reshape(x.shape)


def test_kernels_build_here():
    assert ggml.available()


@pytest.mark.parametrize("ggml_type", TYPES, ids=type_name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s[0]}xB{s[1]}")
def test_gemv_matches_references(ggml_type, shape):
    num_out, num_blocks = shape
    num_in = _in_features(ggml_type, num_blocks)
    generator = _generator(ggml_type, *shape)
    w = GgufWeight.random(ggml_type, num_out, num_in, generator)
    for rows in (*range(1, 9), 9, 20):  # past 8: chunks of 8 rows on each tile of weight rows
        x = torch.randn(rows, num_in, generator=generator) * 3
        x[0, :7] = 0.0  # a partly zero block; an all-zero block when K is one small block
        got = w.mm_gemv(x)
        assert got.shape == (rows, num_out) and got.dtype == torch.float32
        _check_gemv(got, x, [w])
        assert w.linear_fast(x).equal(got)  # decode row counts take the GEMV


def test_gemv_takes_bf16_inputs_and_all_zero_rows():
    w = GgufWeight.random(GGMLQuantizationType.Q4_K, 9, 512, _generator(1))
    x = torch.randn(3, 512, generator=_generator(2)).to(torch.bfloat16)
    x[1] = 0.0
    got = w.mm_gemv(x)
    assert got.equal(w.mm_gemv(x.float())) and (got[1] == 0).all()


@pytest.mark.parametrize("ggml_type", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q6_K])
def test_gemv_of_no_rows_is_empty(ggml_type):
    w = GgufWeight.random(ggml_type, 5, 256, _generator(3))
    assert w.mm_gemv(torch.empty(0, 256)).shape == (0, 5)


def test_mixed_group_is_each_weight_side_by_side():
    # Gemma-3 Q4_K_M's mix, a Q5_K and the float rows, sharing one input.
    types = [
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q6_K,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.F16,
    ]
    generator = _generator(4)
    weights = [GgufWeight.random(t, n, 512, generator) for t, n in zip(types, (7, 3, 5, 1, 4, 2))]
    for rows in (1, 4, 8):
        x = torch.randn(rows, 512, generator=generator)
        got = GgufWeight.gemv_group(x, weights)
        assert got.equal(torch.cat([w.mm_gemv(x) for w in weights], dim=1))
        _check_gemv(got, x, weights)


@pytest.mark.parametrize("ggml_type", TYPES, ids=type_name)
def test_gemm_path_matches_reference(ggml_type):
    generator = _generator(5, ggml_type)
    num_in = _in_features(ggml_type, 2)
    w = GgufWeight.random(ggml_type, 37, num_in, generator)
    x = torch.randn(GEMV_MAX_ROWS + 1, num_in, generator=generator) * 3
    x[0, :7] = 0.0
    got = w.linear_fast(x)  # past the GEMV's rows: dequantize + fp32 GEMM (BF16: the GEMV's tiles)
    expected_path = w.mm_gemv if ggml_type == GGMLQuantizationType.BF16 else w.mm_dequantized
    assert got.equal(expected_path(x))
    # x quantized as the GEMV quantizes it: the same references, and a prompt token gets what
    # it would get decoded, up to fp32 summation order.
    _check_gemv(got, x, [w])
    decoded = torch.cat([w.mm_gemv(x[:4]), w.mm_gemv(x[4:])])
    scale = x.double().abs() @ w.dequantize(torch.float64).abs().T
    assert ((got.double() - decoded.double()).abs() <= 1e-5 * scale).all()


@pytest.mark.parametrize("ggml_type", TYPES, ids=type_name)
def test_dequantize_is_the_package_bit_for_bit(ggml_type):
    w = GgufWeight.random(ggml_type, 6, _in_features(ggml_type, 3), _generator(6, ggml_type))
    got = torch.ops.zcode.ggml_dequantize(w.data, w.ggml_type, w.in_features)
    assert got.equal(w.dequantize())
    every_other = w.data[::2]  # rows further apart than their bytes
    assert torch.ops.zcode.ggml_dequantize(every_other, w.ggml_type, w.in_features).equal(
        dequantize_rows(every_other.contiguous(), w.ggml_type)
    )
    assert torch.ops.zcode.ggml_dequantize(w.data[:0], w.ggml_type, w.in_features).shape == (
        0,
        w.in_features,
    )


def test_embedding_lookup_is_the_package():
    w = GgufWeight.random(GGMLQuantizationType.Q8_0, 100, 64, _generator(7))
    ids = torch.tensor([[3, 99, 3], [0, 1, 50]])
    got = GgufEmbedding(w)(ids)
    assert got.shape == (2, 3, 64)
    assert got.equal(w.dequantize()[ids])
    with pytest.raises(RuntimeError, match="out of"):
        GgufEmbedding(w)(torch.tensor([100]))


# Byte offsets of fp16 fields per type: flipping their exponent bits could make them inf.
FP16_FIELDS = {
    GGMLQuantizationType.Q4_0: (0,),
    GGMLQuantizationType.Q4_1: (0, 2),
    GGMLQuantizationType.Q5_0: (0,),
    GGMLQuantizationType.Q5_1: (0, 2),
    GGMLQuantizationType.Q8_0: (0,),
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
}


@pytest.mark.parametrize("ggml_type", sorted(FP16_FIELDS), ids=type_name)
def test_every_byte_is_read_as_the_package_reads_it(ggml_type):
    """Corrupt each byte of the middle block of a row in turn (all its bits; only mantissa bits
    of fp16 scales): the kernel must follow the package's reading of the corrupted block. A
    scale, min, high-bit or sub-block offset the kernel read from the wrong place would leave its
    output unchanged, or change it differently, and fail the same-quantization check."""
    generator = _generator(8, ggml_type)
    block_size, block_bytes = GGML_QUANT_SIZES[ggml_type]
    w = GgufWeight.random(ggml_type, 1, 3 * block_size, generator)
    x = torch.randn(2, 3 * block_size, generator=generator)
    before = w.mm_gemv(x)
    fp16_high_bytes = {offset + 1 for offset in FP16_FIELDS[ggml_type]}
    for offset in range(block_bytes):
        data = w.data.clone()
        data[0, block_bytes + offset] ^= 0x03 if offset in fp16_high_bytes else 0xFF
        corrupted = GgufWeight(data, ggml_type, w.in_features)
        got = corrupted.mm_gemv(x)
        assert not got.equal(before), f"{type_name(ggml_type)}: byte {offset} is not read"
        _check_gemv(got, x, [corrupted])


def test_fake_kernels_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 64)
        ws = [torch.empty(5, 68, dtype=torch.uint8), torch.empty(2, 68, dtype=torch.uint8)]
        assert torch.ops.zcode.ggml_gemv(x, ws, [8, 8]).shape == (3, 7)
        assert torch.ops.zcode.ggml_dequantize(ws[0], 8, 64).shape == (5, 64)
        row_ids = torch.empty(4, dtype=torch.long)
        assert torch.ops.zcode.ggml_dequantize(ws[0], 8, 64, row_ids).shape == (4, 64)


# ---- The interleaved layout (blocks of 16 rows side by side; ggml type | INTERLEAVED)

INTERLEAVED_LIST = sorted(INTERLEAVED_TYPES)


@pytest.mark.parametrize("ggml_type", INTERLEAVED_LIST, ids=type_name)
def test_interleaved_layout_is_the_same_bytes(ggml_type):
    w = GgufWeight.random(ggml_type, 48, _in_features(ggml_type, 3), _generator(9, ggml_type))
    x16 = w.interleaved_copy()
    assert x16.interleaved and x16.kernel_type == ggml_type | INTERLEAVED
    assert not x16.data.equal(w.data) and x16.data.shape == w.data.shape
    assert x16.file_rows().equal(w.data)
    assert x16.dequantize().equal(w.dequantize())  # the package's, on the file's order
    # the C++ dequantize (the prefill path) and the embedding lookup read the layout itself
    got = torch.ops.zcode.ggml_dequantize(x16.data, x16.kernel_type, x16.in_features)
    assert got.equal(w.dequantize())
    ids = torch.tensor([47, 0, 17, 17, 31])
    assert GgufEmbedding(x16)(ids).equal(w.dequantize()[ids])
    x = torch.randn(GEMV_MAX_ROWS + 1, w.in_features, generator=_generator(10))
    assert x16.linear_fast(x).equal(w.linear_fast(x))  # dequantize + GEMM: bit for bit


@pytest.mark.parametrize("ggml_type", INTERLEAVED_LIST, ids=type_name)
@pytest.mark.parametrize("shape", [(16, 1), (48, 3), (32, 8)], ids=lambda s: f"N{s[0]}xB{s[1]}")
def test_interleaved_gemv_matches_references(ggml_type, shape):
    num_out, num_blocks = shape
    generator = _generator(11, ggml_type, *shape)
    w = GgufWeight.random(ggml_type, num_out, _in_features(ggml_type, num_blocks), generator)
    x16 = w.interleaved_copy()
    for rows in (*range(1, 9), 9, 20):
        x = torch.randn(rows, w.in_features, generator=generator) * 3
        x[0, :7] = 0.0
        got = x16.mm_gemv(x)
        assert got.shape == (rows, num_out)
        _check_gemv(got, x, [x16])


@pytest.mark.parametrize("ggml_type", INTERLEAVED_LIST, ids=type_name)
def test_interleaved_kernel_reads_every_byte_of_every_row(ggml_type):
    """Corrupt each byte of the middle block of one row of a group (rows 0, 5 and 15 in turn),
    then interleave: the kernel must follow the package's reading of the corrupted file rows,
    so every byte lands where the kernel looks for it (d, m, high bits, each code lane)."""
    generator = _generator(12, ggml_type)
    block_size, block_bytes = GGML_QUANT_SIZES[ggml_type]
    w = GgufWeight.random(ggml_type, 16, 3 * block_size, generator)
    x = torch.randn(2, 3 * block_size, generator=generator)
    fp16_high_bytes = {offset + 1 for offset in FP16_FIELDS[ggml_type]}
    for row in (0, 5, 15):
        for offset in range(block_bytes):
            data = w.data.clone()
            data[row, block_bytes + offset] ^= 0x03 if offset in fp16_high_bytes else 0xFF
            corrupted = GgufWeight(data, ggml_type, w.in_features).interleaved_copy()
            got = corrupted.mm_gemv(x)
            _check_gemv(got, x, [corrupted])
            assert got[:, row].ne(w.mm_gemv(x)[:, row]).any(), f"row {row} byte {offset} unread"


def test_interleaved_and_row_weights_share_one_call():
    types = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q8_0]
    generator = _generator(13)
    weights = [GgufWeight.random(t, 32, 512, generator) for t in types]
    weights[0], weights[2] = weights[0].interleaved_copy(), weights[2].interleaved_copy()
    for rows in (1, 9):
        x = torch.randn(rows, 512, generator=generator)
        got = GgufWeight.gemv_group(x, weights)
        assert got.equal(torch.cat([w.mm_gemv(x) for w in weights], dim=1))
        _check_gemv(got, x, weights)


def test_interleaved_layout_needs_groups_of_16_rows():
    w = GgufWeight.random(GGMLQuantizationType.Q4_0, 24, 64, _generator(14))
    f16 = GGMLQuantizationType.F16  # float rows: no layout
    assert not interleaving_pays(w.ggml_type, 24) and not interleaving_pays(f16, 32)
    with pytest.raises(ValueError, match="no interleaved layout"):
        GgufWeight(w.data, w.ggml_type, 64, interleaved=True)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.zcode.ggml_gemv(torch.randn(1, 64), [w.data], [w.ggml_type | INTERLEAVED])
    with pytest.raises(RuntimeError, match="no interleaved layout"):
        torch.ops.zcode.ggml_interleave(torch.zeros(16, 128, dtype=torch.uint8), f16, 64)


@pytest.mark.parametrize("num_in", [37, 100, 4096])
def test_bf16_rows_at_prefill_row_counts(num_in):
    """BF16 rows run as a GEMM at any row count (tiles of 4 x rows by 4 weight rows, 32 k a
    step): K not a multiple of 32, x and weight rows that leave partial tiles, and at K = 4096
    (32 x rows per L2 block) several blocks of x rows."""
    w = GgufWeight.random(GGMLQuantizationType.BF16, 10, num_in, _generator(num_in))
    assert w.gemv_max_rows > 512
    for rows in (5, 66, 70):
        x = torch.randn(rows, num_in, generator=_generator(num_in, rows))
        _check_gemv(w.linear_fast(x), x, [w])
