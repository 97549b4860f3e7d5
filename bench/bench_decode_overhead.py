"""Decode overhead: eager vs compiled ZCode decode against the memory-bandwidth roofline, one run.

For each dtype (fp32, bf16) and batch size (1, 8) on SmolLM2-135M: decode tok/s of ZCode eager,
ZCode with compiled decode steps (the plan cache), and HF transformers in the same dtype; the
roofline from the bandwidth measured in the same run; the fraction of it each reaches; and the
per-step overhead = measured step time - roofline step time, before and after compilation.
Also: compile seconds, and the number of compiles a second request with the same plan causes
(must be 0).

    .venv/bin/python bench/bench_decode_overhead.py [--quick] [--repeats 5] [--threads 2]

Roofline step time = (weight bytes + KV bytes read by the step) / bandwidth, where the KV read is
B sequences x their mean context length x KV bytes per token. Decode timing is bench_core's:
between the first and the last new token there are N - 1 forward passes of B tokens. Runners
go round-robin within each repeat so that load from other jobs hits them alike.
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from bench_core import (
    HFRunner,
    ZCodeRunner,
    _cpu_seconds,
    _others_cores,
    build_prompts,
    measure_bandwidth,
)
from table_format import print_rows

RESULTS_PATH = Path(__file__).parent / "results" / "decode_overhead.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _kv_bytes_per_token(runner: ZCodeRunner) -> int:
    return runner.llm.engine.runner.kv_cache.bytes_per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="smoke run: 16 tokens, 1 repeat")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--dtypes", default="float32,bfloat16", help=f"subset of {list(DTYPES)}")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.new_tokens = 1, 16
    batches = [int(b) for b in args.batches.split(",")]
    dtypes = [d.strip() for d in args.dtypes.split(",")]
    if unknown := sorted(set(dtypes) - set(DTYPES)):
        parser.error(f"unknown dtypes {unknown}; choose from {list(DTYPES)}")
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 to time decoding")

    torch.set_num_threads(args.threads)
    from zcode.loader.checkpoint import resolve_model_path

    path = resolve_model_path(None)
    bw_tries = 2 if args.quick else 5
    bandwidth_start = measure_bandwidth(1 << 30, bw_tries)
    print(f"memory bandwidth {bandwidth_start / 1e9:.1f} GB/s; load {os.getloadavg()}")
    _, short_prompts = build_prompts(path, 8, max(batches))
    prompts = {b: short_prompts[:b] for b in batches}

    runners, compile_facts = {}, {}
    for dtype in dtypes:
        for kind in ("eager", "compiled"):
            runner = ZCodeRunner(dtype, compile=kind == "compiled")
            start = time.perf_counter()
            for b in batches:  # warm-up: compiles one graph per batch bucket
                runner.run(prompts[b], 4)
            if kind == "compiled":
                stats = runner.llm.engine.stats()
                graphs = runner.llm.engine.runner.graphs
                compile_facts[dtype] = {
                    "first_requests_s": time.perf_counter() - start,
                    "compile_s": graphs.compile_s,
                    "num_compiles_first_requests": stats["num_graph_compiles"],
                }
            runners[(dtype, kind)] = runner
        if not args.no_hf:
            runners[(dtype, "hf")] = HFRunner(path, DTYPES[dtype])
            for b in batches:
                runners[(dtype, "hf")].run(prompts[b], 4)
    print("loaded and warmed up:", ", ".join(f"{d}/{k}" for d, k in runners))

    samples = {(key, b): [] for key in runners for b in batches}
    tokens = {}
    cpu_start = _cpu_seconds()
    for repeat in range(args.repeats):
        for key, runner in runners.items():
            for b in batches:
                t = runner.run(prompts[b], args.new_tokens)
                samples[(key, b)].append(b * (args.new_tokens - 1) / t.decode_s)
                tokens[(key, b)] = t.token_ids
        print(f"repeat {repeat + 1}/{args.repeats} done")
    others_cores = _others_cores(cpu_start, _cpu_seconds())
    bandwidth = max(bandwidth_start, measure_bandwidth(1 << 30, bw_tries))

    rows, results = [], []
    for dtype in dtypes:
        facts = compile_facts[dtype]
        compiled_runner = runners[(dtype, "compiled")]
        facts["num_compiles_later_requests"] = (
            compiled_runner.llm.engine.stats()["num_graph_compiles"]
            - facts["num_compiles_first_requests"]
        )
        weight_bytes = compiled_runner.bytes_per_token
        kv_per_token = _kv_bytes_per_token(compiled_runner)
        for b in batches:
            mean_context = statistics.mean(len(p) for p in prompts[b]) + args.new_tokens / 2
            step_bytes = weight_bytes + b * mean_context * kv_per_token
            roofline_step_s = step_bytes / bandwidth
            roofline_tok_s = b / roofline_step_s
            r = {"dtype": dtype, "batch": b, "roofline_tok_s": roofline_tok_s}
            for kind in ("hf", "eager", "compiled"):
                if (dtype, kind) not in runners:
                    continue
                values = samples[((dtype, kind), b)]
                median = statistics.median(values)
                r[kind] = {
                    "best_tok_s": max(values),
                    "median_tok_s": median,
                    "roofline_fraction": median / roofline_tok_s,
                    "overhead_ms_per_step": (b / median - roofline_step_s) * 1e3,
                    "samples_tok_s": values,
                }
            r["greedy_tokens_equal_eager_compiled"] = (
                tokens[((dtype, "eager"), b)] == tokens[((dtype, "compiled"), b)]
            )
            results.append(r)
            hf = r.get("hf")
            rows.append(
                (
                    dtype,
                    str(b),
                    "n/a" if hf is None else f"{hf['best_tok_s']:.1f}/{hf['median_tok_s']:.1f}",
                    f"{r['eager']['best_tok_s']:.1f}/{r['eager']['median_tok_s']:.1f}",
                    f"{r['compiled']['best_tok_s']:.1f}/{r['compiled']['median_tok_s']:.1f}",
                    f"{roofline_tok_s:.1f}",
                    f"{r['eager']['roofline_fraction']:.0%}",
                    f"{r['compiled']['roofline_fraction']:.0%}",
                    f"{r['eager']['overhead_ms_per_step']:.1f}",
                    f"{r['compiled']['overhead_ms_per_step']:.1f}",
                    "yes" if r["greedy_tokens_equal_eager_compiled"] else "no",
                )
            )
    print()
    print_rows(
        (
            "dtype",
            "batch",
            "HF tok/s",
            "eager tok/s",
            "compiled tok/s",
            "roofline tok/s",
            "eager frac",
            "compiled frac",
            "eager overhead ms/step",
            "compiled overhead ms/step",
            "same greedy",
        ),
        rows,
    )
    print(
        f"tok/s as best/median over {args.repeats} repeats of {args.new_tokens} new tokens; "
        f"fractions and overheads from medians; bandwidth {bandwidth / 1e9:.1f} GB/s "
        f"(max of start/end); other processes used {others_cores:.2f} of {os.cpu_count()} cores"
    )
    for dtype, facts in compile_facts.items():
        print(
            f"{dtype}: first requests (one per batch bucket) took "
            f"{facts['first_requests_s']:.1f} s, of which compiling {facts['compile_s']:.1f} s, "
            f"{facts['num_compiles_first_requests']} compiles; later requests with the same "
            f"plan: {facts['num_compiles_later_requests']} compiles"
        )
    acceptance = {
        dtype: r["compiled"]["roofline_fraction"] >= 0.7
        for r in results
        for dtype in [r["dtype"]]
        if r["batch"] == 1
    }
    print(f"acceptance (compiled batch-1 decode >= 70% of roofline): {acceptance}")
    report = {
        "config": vars(args) | {"output": str(args.output), "model": str(path)},
        "bandwidth_bytes_per_s": bandwidth,
        "others_cores_while_timed": others_cores,
        "results": results,
        "compile": compile_facts,
        "acceptance_b1_roofline_70": acceptance,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
