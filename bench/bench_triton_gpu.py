"""The Triton kernels on a real GPU: correctness first, then time at GLM-sized shapes.

1. Every registered `cuda` variant on every case of its op, run on the GPU against the op's
   reference computed on CPU (the oracle), within the op's own tolerance.
2. The same kernels at GLM-4.5-Air / GLM-5 shapes, checked against the reference run by PyTorch on
   the GPU (rel error beside each row), timed with triton.testing.do_bench (median of its
   repetitions, min beside it) against that reference, and the weight bytes the step reads per
   second of kernel time.

    python bench/bench_triton_gpu.py [--sweep]  # CUDA + Triton; --sweep: MoE tile sizes only
"""

import dataclasses
import functools
import sys
import traceback

import torch

from zcode import kernels  # noqa: F401  (registers every op)
from zcode.forward_batch import ForwardBatch
from zcode.kernels.dsa import select_topk
from zcode.kernels.paged import BLOCK_SIZE
from zcode.kernels.registry import OPS, outputs_match


def to_device(value, device: str):
    """Tensors, tuples, lists and dataclasses of them (a ForwardBatch) moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple | list):
        return type(value)(to_device(v, device) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {
            f.name: to_device(getattr(value, f.name), device) for f in dataclasses.fields(value)
        }
        return dataclasses.replace(value, **fields)
    return value


def relative_error(actual, expected) -> float:
    """max |actual - expected| / max |expected|; for integer outputs, the count of mismatches."""
    if isinstance(expected, tuple | list):
        return max(relative_error(a, e) for a, e in zip(actual, expected))
    if not expected.is_floating_point():
        return float((actual.cpu() != expected.cpu()).sum())
    diff = (actual.float().cpu() - expected.float().cpu()).abs().max()
    return float(diff / expected.float().abs().max().clamp_min(1e-30))


def check_registered_cases() -> int:
    print("| op | variant | case | match | rel err |")
    print("|---|---|---|---|---|")
    failures = 0
    for op in OPS.values():
        for variant in (v for v in op.variants if v.backend == "cuda"):
            for case_name, make in op.cases():
                args = make(torch.Generator().manual_seed(0))
                if not variant.supports(*args):
                    continue
                expected = op.reference(*args)
                try:
                    actual = variant.fn(*to_device(make(torch.Generator().manual_seed(0)), "cuda"))
                    ok = outputs_match(actual, expected, *op.tolerance(*args))
                    err = f"{relative_error(actual, expected):.2e}"
                except Exception as e:  # report and go on: one broken kernel hides no other
                    ok, err = False, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
                    traceback.print_exc(file=sys.stderr)
                failures += not ok
                print(f"| {op.name} | {variant.name} | {case_name} | {ok} | {err} |")
    return failures


# --- GLM-sized shapes ------------------------------------------------------------------------


# Inputs are made on the device (the GLM-sized expert weights are GBs), from a seeded generator.
DEVICE = "cuda"  # bench_triton_gpu.DEVICE = "cpu" runs the shapes on CPU (a dry run)


def _gen(seed: int) -> dict:
    return {"generator": torch.Generator(DEVICE).manual_seed(seed), "device": DEVICE}


def routing_args(tokens: int, hidden: int, experts: int, groups: int, top_groups: int):
    g = _gen(1)
    x = torch.randn(tokens, hidden, **g)
    weight = torch.randn(experts, hidden, **g) * hidden**-0.5
    bias = torch.randn(experts, **g) * 0.1
    return x, weight, bias, 8, groups, top_groups, True, 2.5


def experts_args(tokens: int, hidden: int, inter: int, experts: int, dtype: torch.dtype):
    g = _gen(2)
    x = torch.randn(tokens, hidden, **g).to(dtype)
    weights, ids = torch.rand(tokens, experts, **g).topk(8, dim=-1)
    w_gate, w_up = (
        (torch.randn(experts, inter, hidden, dtype=dtype, **g) * hidden**-0.5) for _ in "gu"
    )
    w_down = torch.randn(experts, hidden, inter, dtype=dtype, **g) * inter**-0.5
    return x, weights, ids, w_gate, w_up, w_down


def decode_batch(num_seqs: int, context_len: int) -> ForwardBatch:
    blocks = -(-context_len // BLOCK_SIZE)
    tables = [list(range(s * blocks, (s + 1) * blocks)) for s in range(num_seqs)]
    batch = ForwardBatch.build([1] * num_seqs, [context_len] * num_seqs, tables, BLOCK_SIZE)
    return to_device(batch, DEVICE)


def indexer_args(num_seqs: int, context_len: int, heads: int = 32, dim: int = 128):
    g = _gen(3)
    batch = decode_batch(num_seqs, context_len)
    num_blocks = num_seqs * -(-context_len // BLOCK_SIZE)
    q = torch.randn(num_seqs, heads, dim, **g)
    cache = torch.randn(num_blocks, BLOCK_SIZE, dim, **g)
    weights = torch.randn(num_seqs, heads, **g) * heads**-0.5
    return q, cache, weights, batch, 2048


def sparse_attention_args(num_seqs: int, context_len: int, heads: int = 16):
    g = _gen(4)
    batch = decode_batch(num_seqs, context_len)
    q = torch.randn(num_seqs, heads, 192, **g)
    keys = torch.randn(num_seqs, context_len, heads, 192, **g)
    values = torch.randn(num_seqs, context_len, heads, 128, **g)
    ids = select_topk(torch.rand(num_seqs, 1, context_len, **g), batch, 2048)
    return q, keys, values, batch, ids, 192**-0.5


def sparse_ffn_args(tokens: int, hidden: int = 4096, inter: int = 13696, kept: float = 0.25):
    g = _gen(5)
    x = torch.randn(tokens, hidden, **g)
    w_gate, w_up = (torch.randn(inter, hidden, **g) * hidden**-0.5 for _ in "gu")
    w_down = torch.randn(hidden, inter, **g) * inter**-0.5
    ids = torch.randperm(inter, **g)[: int(inter * kept)].sort().values
    return x, w_gate, w_up, w_down, ids


def expert_bytes(args) -> int:
    _, _, ids, w_gate, w_up, w_down = args
    per_expert = sum(w[0].numel() * w.element_size() for w in (w_gate, w_up, w_down))
    return int(ids.unique().numel()) * per_expert


def sparse_ffn_bytes(args) -> int:
    _, w_gate, _, _, ids = args
    return 3 * ids.numel() * w_gate.shape[1] * w_gate.element_size()


# (op, shape name, args on the device, weight bytes read or None)
def shapes():
    air, glm5 = (4096, 1408, 128), (6144, 2048, 256)
    for tokens in (1, 16, 256):
        yield "moe_routing", f"T{tokens} E128 G1 (4.5-Air)", routing_args(tokens, 4096, 128, 1, 1)
        yield "moe_routing", f"T{tokens} E256 G8/4", routing_args(tokens, 6144, 256, 8, 4)
    for tokens in (1, 16, 256, 2048):
        args = experts_args(tokens, *air, torch.bfloat16)
        yield "moe_experts", f"T{tokens} 4.5-Air bf16", args, expert_bytes(args)
    args = experts_args(16, *glm5, torch.bfloat16)
    yield "moe_experts", "T16 GLM-5 bf16", args, expert_bytes(args)
    for seqs, ctx in ((1, 4096), (4, 16384)):
        yield "dsa_indexer", f"B{seqs} ctx{ctx} top2048", indexer_args(seqs, ctx)
        yield "dsa_sparse_attention", f"B{seqs} ctx{ctx} top2048", sparse_attention_args(seqs, ctx)
    for tokens in (1, 16):
        args = sparse_ffn_args(tokens)
        yield "sparse_ffn", f"T{tokens} D4096 I13696 25%", args, sparse_ffn_bytes(args)


def time_row(op_name: str, shape: str, args: tuple, weight_bytes: int | None) -> str:
    from triton.testing import do_bench

    op = OPS[op_name]
    triton_fn = next(v.fn for v in op.variants if v.backend == "cuda")
    try:
        err = relative_error(triton_fn(*args), op.reference(*args))
        t_med, t_min = do_bench(lambda: triton_fn(*args), quantiles=[0.5, 0.0])
        r_med, r_min = do_bench(lambda: op.reference(*args), quantiles=[0.5, 0.0])
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        return f"| {op_name} | {shape} | {type(e).__name__}: {str(e).splitlines()[0][:80]} |"
    gbps = f"{weight_bytes / t_med / 1e6:.0f}" if weight_bytes else "-"
    return (
        f"| {op_name} | {shape} | {t_med:.3f} / {t_min:.3f} | {r_med:.3f} / {r_min:.3f} "
        f"| {r_med / t_med:.2f}x | {gbps} | {err:.2e} |"
    )


def time_glm_shapes() -> None:
    print(
        "| op | shape | triton ms (median / min) | torch ms (median / min) | speed-up "
        "| weight GB/s | rel err vs torch |"
    )
    print("|---|---|---|---|---|---|---|")
    for op_name, shape, args, *weight_bytes in shapes():
        print(time_row(op_name, shape, args, weight_bytes[0] if weight_bytes else None))
        torch.cuda.empty_cache()


def sweep_moe_blocks() -> None:
    """moe_experts at GLM-4.5-Air decode and prefill row counts under other (M, N, K) tiles than
    gemm_blocks picks: the evidence for its choice."""
    from triton.testing import do_bench

    import zcode.kernels.triton.moe as triton_moe

    chosen = triton_moe.gemm_blocks
    print("\n| tokens | BLOCK_M, N, K | triton ms (median) | weight GB/s |")
    print("|---|---|---|---|")
    for tokens in (1, 16, 2048):
        args = experts_args(tokens, 4096, 1408, 128, torch.bfloat16)
        run = functools.partial(triton_moe.experts, *args)
        tiles_m = (16,) if tokens <= 16 else (64, 128)
        for blocks in [(m, n, k) for m in tiles_m for n in (32, 64, 128) for k in (64, 128)]:
            triton_moe.gemm_blocks = functools.partial(lambda rows, tiles: tiles, tiles=blocks)
            ms = do_bench(run, return_mode="median")
            print(f"| {tokens} | {blocks} | {ms:.3f} | {expert_bytes(args) / ms / 1e6:.0f} |")
        triton_moe.gemm_blocks = chosen
        torch.cuda.empty_cache()


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: this bench runs the Triton kernels on a GPU only", file=sys.stderr)
        return 2
    import triton

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"triton {triton.__version__}\n")
    with torch.inference_mode():
        if "--sweep" in sys.argv:
            sweep_moe_blocks()
            return 0
        failures = check_registered_cases()
        print(f"\n{failures} registered case(s) failed on the GPU\n")
        time_glm_shapes()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
