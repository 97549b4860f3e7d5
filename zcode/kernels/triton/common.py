"""What the Triton GEMM kernels share: the dtype their dot products run in."""

import torch
import triton.language as tl


def dot_dtype(weight: torch.Tensor) -> dict:
    """Constexpr arguments COMPUTE (operand dtype) and PRECISION (tl.dot input_precision).

    bf16 / fp16 weights multiply in their own dtype on the tensor cores, accumulating in fp32, as
    the reference's F.linear on those weights does. fp32 weights multiply in full fp32 ("ieee"):
    tl.dot's default for fp32 operands rounds them to tf32 (~1e-3 relative error on a GPU, outside
    the ops' tolerance; the CPU interpreter does not show it).
    """
    if weight.dtype == torch.bfloat16:
        return {"COMPUTE": tl.bfloat16, "PRECISION": "tf32"}
    if weight.dtype == torch.float16:
        return {"COMPUTE": tl.float16, "PRECISION": "tf32"}
    return {"COMPUTE": tl.float32, "PRECISION": "ieee"}


def gemm_blocks(rows: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for a GEMM of `rows` rows: decode-sized row counts take the
    smallest tile tl.dot allows, so no program multiplies mostly padding. From the tile sweep of
    bench/bench_triton_gpu.py --sweep on an H200 (GLM-4.5-Air experts, bf16): at 1 and 16 rows
    N 32-128 x K 64-128 lie within 10% (N 128 at 1 row is 1.7x slower); at 2048 rows
    (64, 128, 64) 5.7 ms against 6.2 for (64, 64, 64); (64, 128, 128) exceeds shared memory."""
    return (16, 64, 64) if rows <= 16 else (64, 128, 64)
