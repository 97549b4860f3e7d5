"""Expert offload: decode speed, hit rate and disk reads at expert-cache budgets of a MoE model.

    .venv/bin/python bench/bench_offload.py MODEL [--budgets 25,50,100] [--repeats 3]

MODEL is a HF directory or a GGUF file, loaded as stored (its experts memory-mapped). Each
budget is a percentage of the routed experts' bytes; "none" is the engine without an expert
cache (no page is dropped: its experts stay in the page cache once read). Every run loads the
model afresh, so it starts cold (the cache drops every expert's pages when it attaches) and no
other instance in the process maps pages the cache drops; budgets run round-robin within each
repeat. One greedy request per run: decode tok/s = (N - 1) / (t_last - t_first) over its N new
tokens (after `--warmup` tokens of an untimed request on another prompt, if given: the figures
are then the budget's steady state, without the first reads every cold start pays). Disk
MB/token: the bytes of the experts the cache missed (model) and the process's reads
from storage by /proc/self/io (measured; readahead may read more), per token run (prompt and
decode). Tokens must be identical at every budget. `--prefetch on,off` runs every budget with
and without reading the next layer's predicted experts ahead; prefetch recall is the share of
misses read ahead, precision the share of experts read ahead that were then routed.
"""

import argparse
import gc
import statistics
import time
from dataclasses import dataclass

import torch
from table_format import print_rows

from zcode.engine.expert_cache import process_read_bytes
from zcode.llm import LLM
from zcode.sampling_params import SamplingParams

PROMPT = "The history of the printing press begins in"
WARMUP_PROMPT = "A short guide to the rivers of Europe, from the Danube"
MB = 1e6


@dataclass(frozen=True)
class Run:
    decode_tok_s: float
    token_ids: list[int]
    hit_rate: float | None
    model_read_bytes_per_token: float
    measured_read_bytes_per_token: float | None
    budget_bytes: int | None
    expert_bytes: int | None
    prefetch_recall: float | None
    prefetch_precision: float | None


def run_once(
    model: str, budget_percent: float | None, prefetch: bool, args: argparse.Namespace
) -> Run:
    cache_args = {}
    if budget_percent is not None:
        cache_args = {
            "expert_cache_fraction": budget_percent / 100,
            "expert_cache_prefetch": prefetch,
        }
    llm = LLM(
        model, kv_cache_bytes=64 << 20, compile=args.compile, max_num_seqs=1,
        expert_cache_policy=args.policy, **cache_args,
    )  # fmt: skip
    engine = llm.engine
    if args.warmup:
        params = SamplingParams(temperature=0, max_tokens=args.warmup, ignore_eos=True)
        engine.add_request(prompt_ids(llm, WARMUP_PROMPT, args), params)
        while engine.has_unfinished():
            engine.step()
    ids = prompt_ids(llm, PROMPT, args)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    stats_at_start = engine.stats()
    read_at_start = process_read_bytes()
    engine.add_request(ids, params)
    times, out = [], None
    while engine.has_unfinished():
        (out,) = engine.step()
        times.append(time.perf_counter())
    read_at_end = process_read_bytes()
    num_tokens = len(ids) + args.max_tokens - 1
    measured = None if read_at_start is None else (read_at_end - read_at_start) / num_tokens
    stats = engine.stats()
    report = out.expert_cache or {}  # this request's

    def counted(key: str) -> int:  # during the timed request
        return stats.get(key, 0) - stats_at_start.get(key, 0)

    misses = counted("expert_cache_lookups") - counted("expert_cache_hits")
    prefetched, prefetch_hits = (
        counted(k) for k in ("expert_cache_prefetched", "expert_cache_prefetch_hits")
    )
    run = Run(
        decode_tok_s=(args.max_tokens - 1) / (times[-1] - times[0]),
        token_ids=out.token_ids,
        hit_rate=report.get("hit_rate"),
        model_read_bytes_per_token=report.get("disk_bytes_per_token", 0.0),
        measured_read_bytes_per_token=measured,
        budget_bytes=stats.get("expert_cache_budget_bytes"),
        expert_bytes=stats.get("expert_cache_expert_bytes"),
        prefetch_recall=prefetch_hits / misses if prefetched and misses else None,
        prefetch_precision=prefetch_hits / prefetched if prefetched else None,
    )
    del llm, engine
    gc.unfreeze()  # the engine froze the heap (LLMEngine._freeze_heap): collect it too, so
    gc.collect()  # the file is unmapped before the next run's cache drops its pages
    return run


def prompt_ids(llm: LLM, text: str, args: argparse.Namespace) -> list[int]:
    if llm.tokenizer is not None:
        return llm.encode(text)
    first = 3 + len(text) % 7  # without a tokenizer: distinct ids per prompt
    return list(range(first, first + args.prompt_len))


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="HF directory or .gguf file of a MoE model")
    parser.add_argument("--budgets", default="25,50,100", help="percent of the experts' bytes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16, help="without a tokenizer")
    parser.add_argument(
        "--warmup", type=int, default=0,
        help="new tokens of an untimed request on another prompt first (the cache then holds "
        "what the budget keeps, not nothing: steady-state hit rate, first reads excluded)",
    )  # fmt: skip
    parser.add_argument("--policy", default="lru", choices=["lru", "lfu"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--compile", action="store_true", help="compiled decode steps")
    parser.add_argument("--prefetch", default="on", help="on, off or on,off: next-layer read-ahead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prefetch_modes = [{"on": True, "off": False}[m] for m in args.prefetch.split(",")]
    budgets = [(None, False)] + [
        (float(b), p) for b in args.budgets.split(",") for p in prefetch_modes
    ]
    runs: dict[tuple[float | None, bool], list[Run]] = {b: [] for b in budgets}
    for repeat in range(args.repeats):
        for budget, prefetch in budgets:
            runs[budget, prefetch].append(run_once(args.model, budget, prefetch, args))
            run = runs[budget, prefetch][-1]
            label = f"budget {budget}% prefetch {prefetch}"
            print(f"  {label}: {run.decode_tok_s:.2f} tok/s, hit rate {run.hit_rate}", flush=True)
        print(f"repeat {repeat + 1}/{args.repeats} done", flush=True)
    reference = runs[None, False][0].token_ids
    rows = []
    for (budget, prefetch), rs in runs.items():
        speeds = [r.decode_tok_s for r in rs]
        last = rs[-1]
        measured = [r.measured_read_bytes_per_token for r in rs]
        rows.append((
            "none" if budget is None else f"{budget:g}%",
            "-" if budget is None else ("on" if prefetch else "off"),
            "-" if last.budget_bytes is None else f"{last.budget_bytes / MB:.2f}",
            f"{min(speeds):.1f}",
            f"{statistics.median(speeds):.1f}",
            _fmt(statistics.mean(r.hit_rate for r in rs) if last.hit_rate is not None else None,
                 ".3f"),
            f"{statistics.mean(r.model_read_bytes_per_token for r in rs) / MB:.3f}",
            _fmt(None if None in measured else statistics.mean(measured) / MB, ".3f"),
            _fmt(last.prefetch_recall, ".3f"),
            _fmt(last.prefetch_precision, ".3f"),
            "yes" if all(r.token_ids == reference for r in rs) else "NO",
        ))  # fmt: skip
    expert_gb = next(r.expert_bytes for rs in runs.values() for r in rs if r.expert_bytes)
    print(
        f"\n{args.model}: routed experts {expert_gb / 1e9:.3f} GB, policy {args.policy}, "
        f"{args.threads} threads, {args.max_tokens} new tokens after a warm-up of {args.warmup}, "
        f"{args.repeats} repeats"
    )
    headers = ["budget", "prefetch", "MB", "tok/s min", "tok/s median", "hit rate",
               "disk MB/tok (model)", "disk MB/tok (measured)", "prefetch recall",
               "prefetch precision", "same tokens"]  # fmt: skip
    print_rows(headers, rows)
    if not all(row[-1] == "yes" for row in rows):
        raise SystemExit("tokens differ between budgets")


if __name__ == "__main__":
    main()
