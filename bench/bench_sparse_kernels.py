"""Row-skipping kernel choices for SparseMLP at decode, against dense F.linear in the same run.

    .venv/bin/python bench/bench_sparse_kernels.py [--quick] [--threads N] [--tokens 1,4,8]

y = (x * mask) @ W_t for SmolLM2's FFN shapes (gate|up: [576, 3072], down: [1536, 576]), 30
layers' worth of distinct weights so they stream from DRAM, at 1 and a few tokens a call: dense
F.linear on the [N, K] weight, the C++ row-skipping kernel on fp32 rows and on int8 rows (the
int8 format's codes and scales, a quarter of the bytes), index_select + matmul (copies the kept
rows), and F.embedding_bag with per-sample weights (one token only). Min and median ms over
interleaved repeats.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from table_format import print_rows  # noqa: E402

from zcode.sparsity import kernel  # noqa: E402
from zcode.sparsity.sparse_mlp import int8_rows  # noqa: E402

SHAPES = {"gate|up": (576, 3072), "down": (1536, 576)}
NUM_LAYERS = 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--tokens", default="1,4,8", help="tokens a call, comma-separated")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 5 if args.quick else 15
    rows = []
    torch.manual_seed(0)
    for name, (k, n) in SHAPES.items():
        w = [torch.randn(n, k) for _ in range(NUM_LAYERS)]  # nn.Linear layout
        w_t = [wi.t().contiguous() for wi in w]  # one input channel per row
        int8 = [int8_rows(wt) for wt in w_t]
        for num_tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(num_tokens, k)
            for sparsity in (0.0, 0.3, 0.5, 0.7):
                thresh = float(x.abs().quantile(sparsity)) if sparsity else -1.0
                cases = _cases(x, w, w_t, int8, thresh)
                ms = {c: [] for c in cases}
                for _ in range(repeats):
                    for c, fn in cases.items():
                        start = time.perf_counter()
                        fn()
                        ms[c].append(1e3 * (time.perf_counter() - start))
                dense = min(ms["dense F.linear"])
                for c in cases:
                    rows.append(
                        (
                            name,
                            str(num_tokens),
                            f"{sparsity:.1f}",
                            c,
                            f"{min(ms[c]):.2f}",
                            f"{statistics.median(ms[c]):.2f}",
                            f"{dense / min(ms[c]):.2f}",
                        )
                    )
    print(f"threads {torch.get_num_threads()}, {NUM_LAYERS} layers of weights per call")
    print_rows(["matrix", "tokens", "sparsity", "kernel", "ms min", "ms median", "x dense"], rows)


def _cases(x, w, w_t, int8, thresh) -> dict:
    ones = torch.ones(x.shape[1])
    masked = x * (x.abs() > thresh)
    per_token = torch.full((x.shape[0],), thresh)  # [T]: the kernel takes each token's
    rows_kept = masked.ne(0).any(dim=0).nonzero().squeeze(1)
    cases = {
        "dense F.linear": lambda: [F.linear(x, wi) for wi in w],
        "C++ row skip": lambda: [kernel.sparse_rows(x, ones, per_token, wt, 0.85) for wt in w_t],
        "C++ row skip, int8 rows": lambda: [
            kernel.sparse_rows(x, ones, per_token, codes, 0.85, scales) for codes, scales in int8
        ],
        "index_select+mm": lambda: [
            masked[:, rows_kept] @ wt.index_select(0, rows_kept) for wt in w_t
        ],
    }
    if x.shape[0] == 1:
        vals = masked[0, rows_kept]
        cases["embedding_bag"] = lambda: [
            F.embedding_bag(rows_kept[None], wt, per_sample_weights=vals[None], mode="sum")
            for wt in w_t
        ]
    return cases


if __name__ == "__main__":
    main()
