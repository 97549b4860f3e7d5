"""Tensor and pipeline parallelism: TP=2 and PP=2 against one process on this machine, and the
bytes they move.

    .venv/bin/python bench/bench_distributed.py [--model PATH] [--tokens 32] [--repeats 3]
        [--expert-parallel]

Runs the same greedy generation (one 32-token prompt, batch 1) in one process with 1 and 2
threads and as two ranks of 1 thread each (spawned as torchrun would, gloo over loopback), split
by tensors (TP) or by layers (PP): decode tok/s (the N-token generation less the 1-token one,
max and median over repeats), rank 0's resident weights, and the bytes each decode token sends
through the collectives and the pipeline's point-to-point sends, counted at the calls (payload:
a ring all-reduce sends 2 (N-1)/N of it per rank). On a 2-core machine expect no gain: the
collectives add a round trip per layer and save only half the arithmetic, which is small at
decode; the pipeline stages run one after the other, so at best it matches one process.

Then the cost model of the same scheme at real GLM sizes: payload per token (bf16) of the two
all-reduces per layer and the logits all-gather, and its time over a link of the given GB/s with
the given latency per collective; and for the MoE layers, the bytes per token of our
all-reduce against an all-to-all dispatch and combine (zcode.distributed.traffic). And for
pipeline parallelism, per decode token: the hidden state [D] sent across each of the N - 1 stage
boundaries and the sampled row's fp32 logits sent back to rank 0, against TP's all-reduces.

Measured on this 2-core VM (SmolLM2-135M Q4_1, --repeats 3, tok/s max / median): one process
27.0 / 26.3 with 1 thread, 33.7 / 33.5 with 2; TP=2 6.7 / 6.1 (0.18x); PP=2 15.3 / 14.9. Rank 0
holds 48.8 MiB of weights under TP=2 and 60.4 under PP=2, against 101.9 in one process; TP=2
sends 137.2 KiB of all-reduce payload and 96.0 KiB of all-gather per token. A gloo all-reduce of
576 floats between 2 processes takes 1.5-2.0 ms here against a 35 us TCP loopback round trip,
and a SmolLM2 token makes ~61 collectives: latency, not bytes, is what TP costs on this machine.

Scaling to real GLM sizes (the cost model above; not measured): a decode token under TP makes
2 L + 1 collectives (93 for GLM-4.5-Air, 185 for GLM-4.5, 157 for GLM-5) and a rank sends
1.0-1.8 MiB (Air) or 2.1-3.7 MiB (GLM-4.5, GLM-5) at TP 2-8, mostly the fp32 logits and the
ring share of the all-reduces: 0.04-0.16 ms at 25 GB/s. The latency term dominates: 2.8, 5.6
and 4.7 ms per token at 30 us a collective (a fast network), 0.5-0.9 ms at 5 us (NCCL within a
node), but 140-370 ms at gloo's 1.5-2.0 ms above. So TP pays only where a collective costs
microseconds and the weight bytes it takes off each rank (GLM-4.5-Air reads ~12B active
parameters, ~24 GB in bf16, per token) take longer to read than its collectives take. Across
slow links, PP sends one bf16 hidden state per stage boundary (8-84 KiB per token at 2-8 stages)
plus the sampled row's fp32 logits back to rank 0 (592-605 KiB, the larger part), with one
latency per stage. For the MoE layers an all-to-all dispatch sends as much as our all-reduce at 2
ranks, 0.67x at 8 and 0.23x at 32 (uniform routing): expert parallelism wants it at scale.
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


def _worker(rank: int, port: int, args, threads: int, parallel: dict, out: str) -> None:
    """`parallel`: LLM's arguments for the split, {} for one process."""
    import zcode.distributed.layers as layers
    import zcode.distributed.pipeline as pipeline
    from zcode import LLM, SamplingParams
    from zcode.distributed.shard import weight_bytes

    torch.set_num_threads(threads)
    moved = {"all_reduce": 0, "all_gather": 0, "send": 0}

    def counting(name, collective):
        def run(x, *rest):
            moved[name] += x.numel() * x.element_size()
            return collective(x, *rest)

        return run

    layers.all_reduce = counting("all_reduce", layers.all_reduce)
    layers.all_gather = counting("all_gather", layers.all_gather)
    pipeline.send = counting("send", pipeline.send)  # rank 0's hidden states
    if parallel:
        os.environ.update(
            RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
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


def _measure(args, threads: int, parallel: dict) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(suffix=".pt")
    context = multiprocessing.get_context("spawn")
    ranks = [
        context.Process(target=_worker, args=(r, port, args, threads, parallel, out))
        for r in range(2 if parallel else 1)
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
    tp = {"tensor_parallel_size": 2, "expert_parallel": args.expert_parallel}
    runs = {
        "1 process, 1 thread": _measure(args, 1, {}),
        "1 process, 2 threads": _measure(args, 2, {}),
        "TP=2, 1 thread per rank": _measure(args, 1, tp),
        "PP=2, 1 thread per rank": _measure(args, 1, {"pipeline_parallel_size": 2}),
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
                f"{r['send'] / 1024:.1f}",
            )
        )
    headers = ["run", "tok/s max", "tok/s median", "vs 1p2t", "rank-0 weights MiB"]
    print_rows(headers + ["all-reduce KiB/tok", "all-gather KiB/tok", "rank-0 send KiB/tok"], rows)
    print()
    cost = []
    for name, num_layers, hidden, vocab, *_ in GLM_SIZES:
        for tp in (2, 8):
            reduce_bytes = 2 * num_layers * hidden * 2  # bf16, attention and FFN
            wire = tp_wire_bytes(num_layers, hidden, vocab, tp)
            ms = wire / (args.link_gbps * 1e9) * 1e3 + (2 * num_layers + 1) * args.latency_us / 1e3
            cost.append((name, str(tp), f"{reduce_bytes / 2**20:.2f}", f"{wire / 2**20:.2f}",
                         f"{ms:.2f}"))  # fmt: skip
    print(f"cost model at {args.link_gbps} GB/s, {args.latency_us} us per collective:")
    print_rows(["model", "TP", "all-reduce MiB/tok", "wire MiB/tok/rank", "ms/token"], cost)
    print()
    print("MoE layers, bf16, uniform routing: bytes sent per token by all ranks")
    print_rows(["model", "ranks", "all-reduce MiB/tok", "all-to-all MiB/tok", "ratio"], moe_rows())
    print()
    print(f"pipeline stages at decode, {args.link_gbps} GB/s, {args.latency_us} us per send:")
    headers = ["model", "stages", "hidden KiB/tok", "logits KiB/tok", "ms/token", "vs TP wire"]
    print_rows(headers, pp_rows(args.link_gbps, args.latency_us))


def tp_wire_bytes(num_layers: int, hidden: int, vocab: int, tp: int) -> float:
    """Bytes one rank sends per decode token under TP: its ring share of the two bf16
    all-reduces per layer, and its fp32 logits for the all-gather."""
    reduce_bytes = 2 * num_layers * hidden * 2
    return 2 * (tp - 1) / tp * reduce_bytes + vocab * 4 * (tp - 1) / tp


def pp_rows(link_gbps: float, latency_us: float) -> list[tuple]:
    """Per decode token: hidden [D] bf16 over each of the N - 1 boundaries, the sampled row's
    [vocab] fp32 logits back to rank 0 (it samples); against a TP rank's wire bytes at the same
    N. The logits dominate at GLM's vocabulary: sampling on the last stage and sending the
    token id back (vLLM) would leave only the hidden states."""
    rows = []
    for name, num_layers, hidden, vocab, *_ in GLM_SIZES:
        for stages in (2, 8):
            hidden_bytes = (stages - 1) * hidden * 2
            logits_bytes = vocab * 4
            ms = (hidden_bytes + logits_bytes) / (link_gbps * 1e9) * 1e3 + stages * latency_us / 1e3
            tp_wire = tp_wire_bytes(num_layers, hidden, vocab, stages)
            rows.append((name, str(stages), f"{hidden_bytes / 1024:.1f}",
                         f"{logits_bytes / 1024:.1f}", f"{ms:.3f}",
                         f"{(hidden_bytes + logits_bytes) / tp_wire:.3f}"))  # fmt: skip
    return rows


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
