"""Tensor parallelism: TP=2 against one process on this machine, and the bytes it moves.

    .venv/bin/python bench/bench_distributed.py [--model PATH] [--tokens 32] [--repeats 3]
        [--expert-parallel]

Runs the same greedy generation (one 32-token prompt, batch 1) in one process with 1 and 2
threads and as two ranks of 1 thread each (spawned as torchrun would, gloo over loopback):
decode tok/s (the N-token generation less the 1-token one, max and median over repeats), rank
0's resident weights, and the bytes each decode token sends through the collectives, counted
at the calls (payload: a ring all-reduce sends 2 (N-1)/N of it per rank). On a 2-core machine
expect no gain: the collectives add a round trip per layer and save only half the arithmetic,
which is small at decode.

Then the cost model of the same scheme at real GLM sizes: payload per token (bf16) of the two
all-reduces per layer and the logits all-gather, and its time over a link of the given GB/s with
the given latency per collective; and for the MoE layers, the bytes per token of our
all-reduce against an all-to-all dispatch and combine (zcode.distributed.traffic).
"""

import argparse
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from table_format import print_rows  # noqa: E402

PROMPT_IDS = list(range(3, 35))  # token ids: tiny checkpoints have no tokenizer
# (name, layers, hidden, vocab, MoE layers, routed experts, top-k) from
# /work/shared/reference/glm-architecture.md and zcode/configs
GLM_SIZES = [
    ("GLM-4.5-Air", 46, 4096, 151552, 45, 128, 8),
    ("GLM-4.5", 92, 5120, 151552, 89, 160, 8),
    ("GLM-5", 78, 6144, 154880, 75, 256, 8),
]


def _worker(rank: int, world_size: int, port: int, args, threads: int, out: str) -> None:
    import zcode.distributed.layers as layers
    from zcode import LLM, SamplingParams
    from zcode.distributed.shard import weight_bytes

    torch.set_num_threads(threads)
    moved = {"all_reduce": 0, "all_gather": 0}

    def counting(name, collective):
        def run(x, group):
            moved[name] += x.numel() * x.element_size()
            return collective(x, group)

        return run

    layers.all_reduce = counting("all_reduce", layers.all_reduce)
    layers.all_gather = counting("all_gather", layers.all_gather)
    parallel = {}
    if world_size > 1:
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )  # fmt: skip
        parallel = {"tensor_parallel_size": world_size, "expert_parallel": args.expert_parallel}
    llm = LLM(args.model, **parallel)  # ranks > 0 follow here and exit with rank 0
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(PROMPT_IDS, many)  # warm-up: kernels built and autotuned
    times, bytes_per_token = [], {}
    for _ in range(args.repeats):
        start, before = time.perf_counter(), dict(moved)
        llm.generate(PROMPT_IDS, one)
        middle, after_one = time.perf_counter(), dict(moved)
        llm.generate(PROMPT_IDS, many)
        end = time.perf_counter()
        times.append((end - middle) - (middle - start))
        # the N-token run less the 1-token run: the N - 1 decode steps
        bytes_per_token = {
            k: ((moved[k] - after_one[k]) - (after_one[k] - before[k])) / (args.tokens - 1)
            for k in moved
        }
    result = {"decode_s": times, "weight_bytes": weight_bytes(llm.model), **bytes_per_token}
    torch.save(result, out)


def _measure(args, world_size: int, threads: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(suffix=".pt")
    context = multiprocessing.get_context("spawn")
    ranks = [
        context.Process(target=_worker, args=(r, world_size, port, args, threads, out))
        for r in range(world_size)
    ]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join()
    if any(p.exitcode for p in ranks):
        sys.exit(f"a rank failed: exit codes {[p.exitcode for p in ranks]}")
    result = torch.load(out)
    os.unlink(out)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M GGUF)")
    parser.add_argument("--tokens", type=int, default=32, help="decode tokens per generation")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--link-gbps", type=float, default=25.0, help="GB/s of the link")
    parser.add_argument("--latency-us", type=float, default=30.0, help="us per collective")
    parser.add_argument(
        "--expert-parallel", action="store_true", help="MoE models: whole experts per rank"
    )
    args = parser.parse_args()
    runs = {
        "1 process, 1 thread": _measure(args, 1, 1),
        "1 process, 2 threads": _measure(args, 1, 2),
        "TP=2, 1 thread per rank": _measure(args, 2, 1),
    }
    rows = []
    base = statistics.median(
        (args.tokens - 1) / t for t in runs["1 process, 2 threads"]["decode_s"]
    )
    for name, r in runs.items():
        tok_s = [(args.tokens - 1) / t for t in r["decode_s"]]
        rows.append(
            (
                name,
                f"{max(tok_s):.1f}",
                f"{statistics.median(tok_s):.1f}",
                f"{statistics.median(tok_s) / base:.2f}",
                f"{r['weight_bytes'] / 2**20:.1f}",
                f"{r['all_reduce'] / 1024:.1f}",
                f"{r['all_gather'] / 1024:.1f}",
            )
        )
    headers = ["run", "tok/s max", "tok/s median", "vs 1p2t", "rank-0 weights MiB"]
    print_rows(headers + ["all-reduce KiB/tok", "all-gather KiB/tok"], rows)
    print()
    cost = []
    for name, num_layers, hidden, vocab, *_ in GLM_SIZES:
        for tp in (2, 8):
            reduce_bytes = 2 * num_layers * hidden * 2  # bf16, attention and FFN
            gather_bytes = vocab * 4 * (tp - 1) / tp  # fp32 logits from the other ranks
            wire = 2 * (tp - 1) / tp * reduce_bytes + gather_bytes
            ms = wire / (args.link_gbps * 1e9) * 1e3 + (2 * num_layers + 1) * args.latency_us / 1e3
            cost.append((name, str(tp), f"{reduce_bytes / 2**20:.2f}", f"{wire / 2**20:.2f}",
                         f"{ms:.2f}"))  # fmt: skip
    print(f"cost model at {args.link_gbps} GB/s, {args.latency_us} us per collective:")
    print_rows(["model", "TP", "all-reduce MiB/tok", "wire MiB/tok/rank", "ms/token"], cost)
    print()
    print("MoE layers, bf16, uniform routing: bytes sent per token by all ranks")
    print_rows(["model", "ranks", "all-reduce MiB/tok", "all-to-all MiB/tok", "ratio"], moe_rows())


def moe_rows() -> list[tuple]:
    from zcode.distributed.traffic import moe_bytes_per_token

    rows = []
    for name, _, hidden, _, moe_layers, experts, top_k in GLM_SIZES:
        for ranks in (2, 8, 32):
            moved = moe_bytes_per_token(hidden, experts, top_k, ranks, bytes_per_value=2)
            reduce_mib, a2a_mib = (moved[k] * moe_layers / 2**20 for k in moved)
            rows.append((name, str(ranks), f"{reduce_mib:.2f}", f"{a2a_mib:.2f}",
                         f"{a2a_mib / reduce_mib:.2f}"))  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
