"""Per-request layer and KV-head skipping on SmolLM2-135M: requests that skip the least
important decoder layers or KV heads for their whole lifetime, served by the same engine as
dense requests.

    .venv/bin/python bench/bench_request_depth.py [--quick] [--compile] [--artifact PATH]
        [--layers 2,4,6] [--heads 10,20,30]

Rankings come from the calibration artifact (zcode calibrate; the default artifact path unless
--artifact): layers by Block Influence (ShortGPT; never the first or the last), KV heads by the
perplexity ablation of calibrate. Plan "layers k" skips the k lowest-ranked layers, "heads k"
the k lowest-ranked KV heads (a layer keeps one). Reported per plan:
- quality on held-out text, through the engine: each window is a request whose prompt logits the
  runner computed (recorded as they leave it): perplexity, greedy agreement and KL(dense || plan);
- KV: the pages the request held, measured in the page pool, as bytes per token against dense;
- speed: batch-1 decode ms/token (min and median over interleaved repeats) against dense in the
  same engine, and dense in an engine without pages (what paging itself costs);
- a batch of 4 (2 dense + 2 on the plan): decode step ms against 4 dense, the case where a layer
  runs for some rows and not others. A skipped KV head saves KV memory, not compute: its heads
  still run for the batch and are masked.
Steps are eager unless --compile: then a decode batch whose requests share a plan runs that
plan's compiled graph (compiled once per plan and batch bucket, before timing), and the mixed
batch of 4 steps eagerly.
Writes bench/results/request_depth.json.
"""

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench_sparsity import decode_step_ms  # noqa: E402
from table_format import print_rows  # noqa: E402

from zcode import LLM  # noqa: E402
from zcode.calibration import corpus_tokens  # noqa: E402
from zcode.sampling_params import SamplingParams  # noqa: E402
from zcode.sparsity.artifact import SparsityArtifact, default_path  # noqa: E402
from zcode.sparsity.head_skip import prune_order  # noqa: E402
from zcode.sparsity.layer_skip import skip_order  # noqa: E402

RESULTS = Path(__file__).parent / "results"
WINDOW = 512


class LogitsRecorder:
    """Keeps the logits the runner returns for each request, in step order."""

    def __init__(self, llm: LLM) -> None:
        self.runner = llm.engine.runner
        self.logits: dict[str, list[torch.Tensor]] = {}

    def __enter__(self) -> "LogitsRecorder":
        execute = self.runner.execute

        def recording(scheduled, row_settings=None):
            outs = execute(scheduled, row_settings)
            for s, logits in zip(scheduled, outs, strict=True):
                self.logits.setdefault(s.seq.request_id, []).append(logits)
            return outs

        self.runner.execute = recording
        return self

    def __exit__(self, *exc) -> None:
        del self.runner.execute  # back to the class's method


def window_logits(llm: LLM, windows: list[list[int]], plan: dict) -> list[torch.Tensor]:
    """[T, V] logits of each window, run as requests that skip what `plan` names."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0)
    engine = llm.engine
    with LogitsRecorder(llm) as rec:
        seqs = [engine.add_request(w, params, **plan) for w in windows]
        while engine.has_unfinished():
            engine.step()
    return [torch.cat(rec.logits[s.request_id])[: len(w)] for s, w in zip(seqs, windows)]


def quality(logits: list[torch.Tensor], dense: list[torch.Tensor], windows) -> dict:
    nll, count, agree, kl = 0.0, 0, 0, 0.0
    for plan_logits, dense_logits, ids in zip(logits, dense, windows, strict=True):
        logp = F.log_softmax(plan_logits[:-1], -1)
        dense_logp = F.log_softmax(dense_logits[:-1], -1)
        nll -= logp.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
        agree += (dense_logp.argmax(-1) == logp.argmax(-1)).sum().item()
        kl += F.kl_div(logp, dense_logp, log_target=True, reduction="sum").item()
        count += len(ids) - 1
    return {"ppl": math.exp(nll / count), "greedy_agreement": agree / count, "kl": kl / count}


def kv_bytes_per_token(llm: LLM, prompt: list[int], plan: dict) -> float:
    """Bytes of the KV pages the request holds after its prefill, per token (its own blocks or
    cached ones it shares)."""
    engine = llm.engine
    pages = engine.block_manager.pages
    seq = engine.add_request(prompt, SamplingParams(max_tokens=2), **plan)
    engine.step()
    held = sum(pages.held(b) for b in seq.block_table)
    while engine.has_unfinished():
        engine.step()
    unit_bytes_per_token = engine.runner.kv_cache.bytes_per_token / pages.num_units
    return held * unit_bytes_per_token * engine.block_manager.block_size / len(prompt)


def plans_from(artifact: SparsityArtifact, layer_counts, head_counts) -> dict[str, dict]:
    layers, heads = skip_order(artifact.layer_scores), prune_order(artifact.head_scores)
    plans = {"dense": {}}
    plans |= {f"layers {k}": {"skip_layers": sorted(layers[:k])} for k in layer_counts}
    plans |= {f"heads {k}": {"skip_kv_heads": sorted(heads[:k])} for k in head_counts}
    return plans


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    ap.add_argument("--artifact", help="a zcode calibrate artifact (default: the cached one)")
    ap.add_argument("--layers", default="2,4,6", help="layer counts a plan skips")
    ap.add_argument("--heads", default="10,20,30", help="KV-head counts a plan skips")
    ap.add_argument("--compile", action="store_true", help="compiled decode steps (fp32)")
    args = ap.parse_args()
    heldout, repeats, new_tokens = (1024, 2, 16) if args.quick else (2048, 5, 48)

    engine_args = {"dtype": "float32", "kv_cache_bytes": 256 << 20, "compile": args.compile}
    llm = LLM(None, per_request_depth=True, **engine_args)
    path = Path(args.artifact) if args.artifact else default_path(llm.model)
    if not path.exists():
        raise SystemExit(f"no sparsity artifact at {path}: run zcode calibrate first")
    artifact = SparsityArtifact.load(path)
    artifact.check_model(llm.model)
    counts = [[int(k) for k in arg.split(",") if k] for arg in (args.layers, args.heads)]
    plans = plans_from(artifact, *counts)
    held = corpus_tokens(llm.tokenizer, "heldout", heldout)
    windows = [held[i : i + WINDOW] for i in range(0, len(held) - 1, WINDOW)]
    print(
        f"rankings from {path}; {len(windows)} held-out windows of <= {WINDOW} tokens; "
        f"{torch.get_num_threads()} threads"
    )

    logits = {name: window_logits(llm, windows, plan) for name, plan in plans.items()}
    rows = []
    for name, plan in plans.items():
        q = quality(logits[name], logits["dense"], windows)
        kv = kv_bytes_per_token(llm, windows[0][:256], plan)
        rows.append({"plan": name, **plan, **q, "kv_bytes_per_token": kv})
    dense = rows[0]

    plain = LLM(None, **engine_args)
    prompt = windows[-1][:64]
    if args.compile:  # compile every graph the timed runs use
        decode_step_ms(plain, [prompt], 2)
        for plan in plans.values():
            decode_step_ms(llm, [prompt], 2, [plan])
            decode_step_ms(llm, [prompt] * 4, 2, [{}, {}, plan, plan])
    b1 = {name: [] for name in plans} | {"no pages": []}
    mixed = {name: [] for name in plans}
    for _ in range(repeats):  # interleaved, so drift hits every configuration alike
        b1["no pages"].append(decode_step_ms(plain, [prompt], new_tokens))
        for name, plan in plans.items():
            b1[name].append(decode_step_ms(llm, [prompt], new_tokens, [plan]))
            four = [{}, {}, plan, plan]
            mixed[name].append(decode_step_ms(llm, [prompt] * 4, new_tokens, four))

    def ms(xs):
        return f"{min(xs):.1f}/{statistics.median(xs):.1f}"

    median = statistics.median
    table = []
    for row in rows:
        name = row["plan"]
        row |= {
            "b1_ms": b1[name],
            "b1_speedup_median": median(b1["dense"]) / median(b1[name]),
            "b4_mixed_ms": mixed[name],
            "b4_mixed_speedup_median": median(mixed["dense"]) / median(mixed[name]),
        }
        table.append(
            (
                name,
                f"{row['ppl']:.3f}",
                f"{100 * (row['ppl'] / dense['ppl'] - 1):+.2f}%",
                f"{row['greedy_agreement']:.3f}",
                f"{row['kl']:.4f}",
                f"{row['kv_bytes_per_token'] / 1024:.1f}",
                f"{100 * (1 - row['kv_bytes_per_token'] / dense['kv_bytes_per_token']):.1f}%",
                ms(b1[name]),
                f"{row['b1_speedup_median']:.2f}x",
                ms(mixed[name]),
                f"{row['b4_mixed_speedup_median']:.2f}x",
            )
        )
    print_rows(
        [
            "plan",
            "ppl",
            "d ppl",
            "agree",
            "KL",
            "KV KiB/tok",
            "KV saved",
            "b1 ms min/med",
            "b1 x",
            "b4 mixed ms",
            "b4 x",
        ],
        table,
    )
    for row in rows[1:]:
        print(f"{row['plan']}: {row.get('skip_layers') or row.get('skip_kv_heads')}")
    no_pages = median(b1["no pages"])
    print(
        f"dense without pages: {ms(b1['no pages'])} ms/token; paging costs "
        f"{100 * (median(b1['dense']) / no_pages - 1):+.1f}% at batch 1 (medians)"
    )
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "new_tokens": new_tokens,
        "heldout_tokens": len(held),
        "artifact": str(path),
        "compile": args.compile,
        "no_pages_b1_ms": b1["no pages"],
    }
    out = RESULTS / ("request_depth_compiled.json" if args.compile else "request_depth.json")
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
