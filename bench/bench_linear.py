"""Linear-layer kernels of every weight format against fp32 F.linear, measured in the same run.

    .venv/bin/python bench/bench_linear.py [--threads 1] [--rows 1,8,64,512] [--repeats 5]
        [--shapes 576x1536,1536x576,576x49152,544x1000] [--compile]

Shapes are KxN: SmolLM2-135M's q/gate/up (576x1536), down (1536x576) and tied lm_head
(576x49152), and an odd one (K not a multiple of 128, N not of 16) that exercises the padding.
Activations are fp32, as the default model runs, so each kernel's conversions are timed with it.

For each rows count M, one table: per shape and kernel the minimum and median microseconds per
call over `repeats` timed runs (each run long enough to time, at least one call), the effective
bandwidth of the weight (its bytes in that format / minimum time; activations ignored) and the
speed against fp32 F.linear measured in the same run. `*` marks the kernel the format's fast path
dispatches to at that M. On a shared machine, compare the median column with care and rerun.
"""

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from zcode.quant import quantize_weight
from zcode.quant.int4 import PACKED_MAX_ROWS as INT4_PACKED_MAX_ROWS
from zcode.quant.int8 import PACKED_MAX_ROWS as INT8_PACKED_MAX_ROWS

RUN_SECONDS = 0.01  # each timed run calls the kernel until at least this long has passed


def time_call(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(min, median) seconds per call."""
    fn()
    start = time.perf_counter()
    fn()
    one_call = time.perf_counter() - start
    number = max(1, int(RUN_SECONDS / max(one_call, 1e-7)))
    per_call = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        per_call.append((time.perf_counter() - start) / number)
    return min(per_call), statistics.median(per_call)


def kernels(weight: torch.Tensor, rows: int, compile_: bool) -> list[tuple[str, int, Callable]]:
    """(label, weight bytes, x -> y) for every candidate at this shape."""
    num_out, num_in = weight.shape
    bf16 = quantize_weight(weight, "bf16")
    int8 = quantize_weight(weight, "int8")
    w8a8 = quantize_weight(weight, "w8a8")
    g32 = quantize_weight(weight, "int4-g32")
    g128 = quantize_weight(weight, "int4-g128")
    w4a8 = quantize_weight(weight, "w4a8")
    int8_packed = rows <= INT8_PACKED_MAX_ROWS
    int4_packed = rows <= INT4_PACKED_MAX_ROWS
    out = [
        ("fp32 F.linear", weight.numel() * 4, lambda x: F.linear(x, weight)),
        ("bf16 F.linear*", bf16.weight_bytes, bf16.linear_fast),
        ("int8 int8pack_mm" + "*" * int8_packed, int8.weight_bytes, int8.mm_packed),
        ("int8 deq+bf16" + "*" * (not int8_packed), int8.weight_bytes, int8.mm_dequantized),
        ("w8a8 _int_mm*", w8a8.weight_bytes, w8a8.linear_fast),
        ("int4-g32 int4pack_mm" + "*" * int4_packed, g32.weight_bytes, g32.mm_packed),
        ("int4-g32 deq+bf16" + "*" * (not int4_packed), g32.weight_bytes, g32.mm_dequantized),
        ("int4-g128 int4pack_mm" + "*" * int4_packed, g128.weight_bytes, g128.mm_packed),
        ("w4a8 (g32) fast*", w4a8.weight_bytes, w4a8.linear_fast),
    ]
    if compile_:
        # dynamic=False: one graph per shape, the best case for inductor.
        deq8 = torch.compile(
            lambda x: F.linear(x.bfloat16(), int8.qweight.bfloat16() * int8.scales[:, None]),
            dynamic=False,
        )
        deq4 = torch.compile(lambda x: g32.mm_dequantized(x), dynamic=False)
        out += [
            ("int8 compiled deq+bf16", int8.weight_bytes, deq8),
            ("int4-g32 compiled deq+bf16", g32.weight_bytes, deq4),
        ]
    assert all(w > 0 for _, w, _ in out), (num_out, num_in)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", default="1,8,64,512")
    parser.add_argument("--shapes", default="576x1536,1536x576,576x49152,544x1000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="add torch.compile candidates")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    generator = torch.Generator().manual_seed(0)
    weights = {(k, n): torch.randn(n, k, generator=generator) * k**-0.5 for k, n in shapes}

    print(f"torch {torch.__version__}, {args.threads} threads, {args.repeats} runs per cell")
    for rows in rows_list:
        print(f"\nM = {rows}")
        header = (
            f"{'KxN':>10} {'kernel':<28} {'min us':>10} {'median us':>10} {'GB/s':>7} {'x fp32':>7}"
        )
        print(header)
        print("-" * len(header))
        for (k, n), weight in weights.items():
            x = torch.randn(rows, k, generator=generator)
            base = None
            for label, num_bytes, fn in kernels(weight, rows, args.compile):
                best, median = time_call(lambda fn=fn, x=x: fn(x), args.repeats)
                base = base or best
                print(
                    f"{f'{k}x{n}':>10} {label:<28} {best * 1e6:>10.1f} {median * 1e6:>10.1f} "
                    f"{num_bytes / best / 1e9:>7.2f} {base / best:>7.2f}"
                )


if __name__ == "__main__":
    main()
