"""The Triton kernels on a real GPU: correctness first, then time at GLM-sized shapes.

1. Every registered `cuda` variant on every case of its op, and each MoE expert path forced
   (decode GEMVs, grouped GEMM), run on the GPU against the op's reference computed on CPU (the
   oracle), within the op's own tolerance.
2. The MoE expert paths side by side at GLM-4.5-Air / GLM-5 decode sizes: each checked against the
   reference run by PyTorch on the GPU, then timed (triton.testing.do_bench median; the decode
   path also replayed from a CUDA graph, as an engine's decode step runs it, without Python's
   launch overhead), with the expert bytes read per second and their share of an H200's 4.8 TB/s.
3. The other kernels at GLM shapes, checked and timed against that reference the same way.
4. --sweep: the tile sizes of the decode GEMVs and the grouped GEMM, the fastest printed.

    PYTHONPATH=. python3 bench/bench_triton_gpu.py [--sweep]  # CUDA + Triton, no C++ builds

zcode.kernels imports the `gguf` package (GGUF weights are a linear format): where the GPU machine
lacks it, install its wheel first (pure Python, no dependencies beyond numpy/pyyaml/tqdm).
"""

import dataclasses
import functools
import gc
import sys
import time
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


def forced_paths() -> dict[str, list[tuple[str, object]]]:
    """Per op, the code paths a variant chooses between, each to be checked on every case."""
    from zcode.kernels.triton import moe

    return {"moe_experts": [("decode", moe.experts_decode), ("grouped", moe.experts_grouped)]}


def check_registered_cases() -> int:
    print("| op | variant | case | match | rel err |")
    print("|---|---|---|---|---|")
    failures = 0
    for op in OPS.values():
        runs = [(v.name, v.fn, v.supports) for v in op.variants if v.backend == "cuda"]
        runs += [(name, fn, lambda *args: True) for name, fn in forced_paths().get(op.name, [])]
        for name, fn, supports in runs:
            for case_name, make in op.cases():
                args = make(torch.Generator().manual_seed(0))
                if not supports(*args):
                    continue
                expected = op.reference(*args)
                try:
                    actual = fn(*to_device(make(torch.Generator().manual_seed(0)), "cuda"))
                    ok = outputs_match(actual, expected, *op.tolerance(*args))
                    err = f"{relative_error(actual, expected):.2e}"
                except Exception as e:  # report and go on: one broken kernel hides no other
                    ok, err = False, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
                    traceback.print_exc(file=sys.stderr)
                failures += not ok
                print(f"| {op.name} | {name} | {case_name} | {ok} | {err} |")
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


AIR, GLM5 = (4096, 1408, 128), (6144, 2048, 256)  # (hidden, moe inter, routed experts)
PEAK_GBPS = 4800  # H200 HBM3e, the datasheet's figure


def expert_weights(hidden: int, inter: int, experts: int, dtype: torch.dtype) -> tuple:
    g = _gen(2)
    w_gate, w_up = (
        (torch.randn(experts, inter, hidden, dtype=dtype, **g) * hidden**-0.5) for _ in "gu"
    )
    w_down = torch.randn(experts, hidden, inter, dtype=dtype, **g) * inter**-0.5
    return w_gate, w_up, w_down


def routed_tokens(tokens: int, hidden: int, experts: int, dtype: torch.dtype) -> tuple:
    g = _gen(3)
    x = torch.randn(tokens, hidden, **g).to(dtype)
    weights, ids = torch.rand(tokens, experts, **g).topk(8, dim=-1)
    return x, weights, ids


def experts_args(tokens: int, hidden: int, inter: int, experts: int, dtype: torch.dtype):
    return *routed_tokens(tokens, hidden, experts, dtype), *expert_weights(
        hidden, inter, experts, dtype
    )


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
    w_down_t = torch.randn(inter, hidden, **g) * inter**-0.5
    ids = torch.randperm(inter, **g)[: int(inter * kept)].sort().values
    return x, w_gate, w_up, w_down_t, ids


def expert_bytes(args) -> int:
    _, _, ids, w_gate, w_up, w_down = args
    per_expert = sum(w[0].numel() * w.element_size() for w in (w_gate, w_up, w_down))
    return int(ids.unique().numel()) * per_expert


def sparse_ffn_bytes(args) -> int:
    _, w_gate, _, _, ids = args
    return 3 * ids.numel() * w_gate.shape[1] * w_gate.element_size()


# (op, shape name, args on the device, weight bytes read or None)
def shapes():
    for tokens in (1, 16, 256):
        yield "moe_routing", f"T{tokens} E128 G1 (4.5-Air)", routing_args(tokens, 4096, 128, 1, 1)
        yield "moe_routing", f"T{tokens} E256 G8/4", routing_args(tokens, 6144, 256, 8, 4)
    for tokens in (256, 2048):  # prefill: the grouped GEMM (decode sizes: time_moe_paths)
        args = experts_args(tokens, *AIR, torch.bfloat16)
        yield "moe_experts", f"T{tokens} 4.5-Air bf16", args, expert_bytes(args)
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
    gbps = bandwidth(weight_bytes, t_med) if weight_bytes else "-"
    return (
        f"| {op_name} | {shape} | {t_med:.3f} / {t_min:.3f} | {r_med:.3f} / {r_min:.3f} "
        f"| {r_med / t_med:.2f}x | {gbps} | {err:.2e} |"
    )


def time_glm_shapes() -> None:
    print(
        "| op | shape | triton ms (median / min) | torch ms (median / min) | speed-up "
        f"| weight GB/s (% of {PEAK_GBPS / 1000:.1f} TB/s) | rel err vs torch |"
    )
    print("|---|---|---|---|---|---|---|")
    for op_name, shape, args, *weight_bytes in shapes():
        print(time_row(op_name, shape, args, weight_bytes[0] if weight_bytes else None))
        torch.cuda.empty_cache()


def graph_ms(fn) -> float:
    """Median ms of `fn` replayed from a CUDA graph: the kernels' time without Python's launch
    overhead (an engine's decode step runs from a graph). `fn` must have run once (compiled).
    The garbage collector waits meanwhile: a Triton kernel it finalizes unloads its CUDA module,
    which breaks a capture (triton 3.6's do_bench_cudagraph does not guard against it)."""
    from triton.testing import do_bench_cudagraph

    gc.collect()
    gc.disable()
    try:
        return do_bench_cudagraph(fn, return_mode="median")
    finally:
        gc.enable()


def bandwidth(weight_bytes: int, ms: float) -> str:
    gbps = weight_bytes / ms / 1e6
    return f"{gbps:.0f} ({100 * gbps / PEAK_GBPS:.0f}%)"


MOE_PATH_TOLERANCE = 3e-2  # bf16: the reference rounds gate, up and each expert's output


def time_moe_paths() -> int:
    """The decode GEMVs beside the grouped GEMM (the path before them) at decode token counts;
    returns the number of paths whose output disagreed with the reference."""
    from zcode.kernels.triton import moe

    print(
        f"moe_experts paths, bf16 (decode GEMVs up to {moe.DECODE_MAX_ROWS} rows = tokens x 8); "
        f"GB/s of the hit experts' weights (% of {PEAK_GBPS / 1000:.1f} TB/s)\n"
    )
    print(
        "| model | T | experts hit | rel err decode / grouped | grouped ms | grouped GB/s "
        "| decode ms | decode GB/s | decode graph ms | decode graph GB/s | torch ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    failures = 0
    for model, shape, token_counts in (("4.5-Air", AIR, (1, 2, 4, 8, 16)), ("GLM-5", GLM5, (1, 8))):
        weights = expert_weights(*shape, torch.bfloat16)
        for tokens in token_counts:
            args = (*routed_tokens(tokens, shape[0], shape[2], torch.bfloat16), *weights)
            row, bad = moe_path_row(args)
            failures += bad
            print(f"| {model} | {tokens} | {row} |")
        del weights
        torch.cuda.empty_cache()
    return failures


def moe_path_row(args: tuple) -> tuple[str, int]:
    """One row of time_moe_paths: each path checked against the reference, then timed."""
    from triton.testing import do_bench

    from zcode.kernels.triton import moe

    decode = functools.partial(moe.experts_decode, *args)
    grouped = functools.partial(moe.experts_grouped, *args)
    reference = functools.partial(OPS["moe_experts"].reference, *args)
    expected = reference()
    errs = [relative_error(fn(), expected) for fn in (decode, grouped)]
    nbytes = expert_bytes(args)
    grouped_ms, decode_ms, torch_ms = (
        do_bench(fn, return_mode="median") for fn in (grouped, decode, reference)
    )
    replay_ms = graph_ms(decode)
    row = (
        f"{int(args[2].unique().numel())} | {errs[0]:.1e} / {errs[1]:.1e} "
        f"| {grouped_ms:.3f} | {bandwidth(nbytes, grouped_ms)} "
        f"| {decode_ms:.3f} | {bandwidth(nbytes, decode_ms)} "
        f"| {replay_ms:.3f} | {bandwidth(nbytes, replay_ms)} | {torch_ms:.3f}"
    )
    return row, sum(err > MOE_PATH_TOLERANCE for err in errs)


# the decode GEMV tiles the sweep tries: (BLOCK_N, BLOCK_K, split_k, num_warps)
GATE_UP_TILES = [
    (16, 256, 4, 4), (32, 256, 4, 4), (64, 128, 4, 4), (32, 128, 8, 4), (32, 512, 2, 4),
    (32, 256, 1, 4), (32, 256, 2, 4), (16, 512, 8, 4), (64, 256, 2, 8), (8, 512, 4, 2),
]  # fmt: skip
DOWN_TILES = [
    (32, 128, 2, 4), (32, 256, 1, 4), (16, 256, 2, 4), (64, 128, 2, 4), (32, 128, 4, 4),
    (64, 256, 1, 8), (16, 128, 4, 2), (128, 128, 1, 8),
]  # fmt: skip


def sweep_decode_tiles() -> int:
    """The decode GEMVs at GLM-4.5-Air sizes from a CUDA graph: gate/up tiles under the default
    down tiles, then down tiles under the best gate/up ones, each checked against the reference
    before it is timed; the fastest printed. Returns the number of tiles that failed."""
    from zcode.kernels.triton import moe

    weights = expert_weights(*AIR, torch.bfloat16)
    cases = [(*routed_tokens(t, AIR[0], AIR[2], torch.bfloat16), *weights) for t in (1, 8)]
    expected = [OPS["moe_experts"].reference(*args) for args in cases]
    print(
        "\n| stage | tiles (N, K, split, warps) | rel err "
        "| T1 graph ms | T1 GB/s | T8 graph ms | T8 GB/s |"
    )
    print("|---|---|---|---|---|---|---|")
    best, failures = moe.DECODE_TILES, 0
    for stage, candidates in (("gate_up", GATE_UP_TILES), ("down", DOWN_TILES)):
        timed = []
        for tile in candidates:
            tiles = dataclasses.replace(best, **{stage: moe.GemvTiles(*tile)})
            runs = [functools.partial(moe.experts_decode, *args, tiles=tiles) for args in cases]
            err = max(relative_error(run(), ref) for run, ref in zip(runs, expected))
            if err > MOE_PATH_TOLERANCE:
                failures += 1
                print(f"| {stage} | {tile} | {err:.1e} MISMATCH | | | | |")
                continue
            ms = [graph_ms(run) for run in runs]
            gbps = [expert_bytes(args) / t / 1e6 for args, t in zip(cases, ms)]
            timed.append((sum(ms), tiles))
            print(
                f"| {stage} | {tile} | {err:.1e} | {ms[0]:.4f} | {gbps[0]:.0f} "
                f"| {ms[1]:.4f} | {gbps[1]:.0f} |"
            )
        best = min(timed, key=lambda t: t[0])[1]
    print(f"\nbest decode tiles (T1 + T8 graph ms): {best}; default {moe.DECODE_TILES}")
    return failures


def sweep_moe_blocks() -> None:
    """moe_experts' grouped GEMM at GLM-4.5-Air prefill row counts under other (M, N, K) tiles
    than gemm_blocks picks: the evidence for its choice."""
    from triton.runtime.errors import OutOfResources
    from triton.testing import do_bench

    from zcode.kernels.triton import moe

    print("\n| tokens | BLOCK_M, N, K | grouped ms (median) | weight GB/s |")
    print("|---|---|---|---|")
    for tokens in (16, 2048):
        args = experts_args(tokens, *AIR, torch.bfloat16)
        tiles_m = (16,) if tokens <= 16 else (64, 128)
        for blocks in [(m, n, k) for m in tiles_m for n in (32, 64, 128) for k in (64, 128)]:
            run = functools.partial(moe.experts_grouped, *args, blocks=blocks)
            try:
                ms = do_bench(run, return_mode="median")
            except OutOfResources:  # (64, 128, 128) and up need more shared memory than an SM has
                print(f"| {tokens} | {blocks} | out of shared memory | |")
                continue
            print(f"| {tokens} | {blocks} | {ms:.3f} | {expert_bytes(args) / ms / 1e6:.0f} |")
        torch.cuda.empty_cache()


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: this bench runs the Triton kernels on a GPU only", file=sys.stderr)
        return 2
    import triton

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"triton {triton.__version__}\n")
    start = time.perf_counter()
    sections = [check_registered_cases, time_moe_paths, time_glm_shapes]
    if "--sweep" in sys.argv:
        sections += [sweep_decode_tiles, sweep_moe_blocks]
    failures = 0
    with torch.inference_mode():
        for section in sections:
            failures += section() or 0
            print(f"\n[{section.__name__} done at {time.perf_counter() - start:.0f} s]\n")
    print(f"{failures} check(s) failed on the GPU")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
