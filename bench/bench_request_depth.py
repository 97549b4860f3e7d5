"""Per-request layer skipping on SmolLM2-135M: requests that skip the least influential decoder
layers for their whole lifetime, served by the same engine as dense requests.

    .venv/bin/python bench/bench_request_depth.py [--quick] [--artifact PATH] [--depths 0,2,4,6]

Layers are ranked by Block Influence (ShortGPT): the calibration artifact's scores (zcode
calibrate; the default artifact path when it exists), else measured here on calibration text.
Request k skips the k lowest-ranked layers (never the first or the last). Reported per k:
- quality on held-out text, through the engine: each window is a request whose prompt logits the
  runner computed (recorded as they leave it): perplexity, greedy agreement and KL(dense || k);
- KV: the pages the request held, measured in the page pool, as bytes per token against dense;
- speed: batch-1 decode ms/token (min and median over interleaved repeats) against dense in the
  same engine, and dense in an engine without per-layer pages (what paging itself costs);
- a batch of 4 (2 dense + 2 at depth k): decode step ms against 4 dense, the case where a layer
  runs for some rows and not others.
All steps are eager: compiled decode does not take per-request skips yet.
Writes bench/results/request_depth.json.
"""

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from table_format import print_rows  # noqa: E402

from zcode import LLM  # noqa: E402
from zcode.calibration import corpus_tokens  # noqa: E402
from zcode.sampling_params import SamplingParams  # noqa: E402
from zcode.sparsity.artifact import SparsityArtifact, default_path  # noqa: E402
from zcode.sparsity.layer_skip import BlockInfluence, skip_order  # noqa: E402

RESULTS = Path(__file__).parent / "results"
WINDOW = 512


class LogitsRecorder:
    """Keeps the logits the runner returns for each request, in step order."""

    def __init__(self, llm: LLM) -> None:
        self.runner = llm.engine.runner
        self.logits: dict[str, list[torch.Tensor]] = {}

    def __enter__(self) -> "LogitsRecorder":
        execute = self.runner.execute

        def recording(scheduled):
            outs = execute(scheduled)
            for s, logits in zip(scheduled, outs, strict=True):
                self.logits.setdefault(s.seq.request_id, []).append(logits)
            return outs

        self.runner.execute = recording
        return self

    def __exit__(self, *exc) -> None:
        del self.runner.execute  # back to the class's method


def layer_scores(llm: LLM, artifact_path: str | None) -> torch.Tensor:
    path = Path(artifact_path) if artifact_path else default_path(llm.model)
    if path.exists():
        print(f"layer ranking: Block Influence from {path}")
        return SparsityArtifact.load(path).layer_scores
    print("layer ranking: Block Influence measured on 2048 calibration tokens")
    calib = corpus_tokens(llm.tokenizer, "calibration", 2048)
    with BlockInfluence(llm.model) as bi:
        llm.generate(
            [calib[i : i + WINDOW] for i in range(0, len(calib), WINDOW)],
            SamplingParams(max_tokens=1),
        )
    return bi.scores()


def window_logits(llm: LLM, windows: list[list[int]], skip: list[int]) -> list[torch.Tensor]:
    """[T, V] logits of each window, run as requests that skip `skip`."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0)
    engine = llm.engine
    with LogitsRecorder(llm) as rec:
        seqs = [engine.add_request(w, params, skip_layers=skip) for w in windows]
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


def kv_bytes_per_token(llm: LLM, prompt: list[int], skip: list[int]) -> float:
    """Bytes of the KV pages the request holds after its prefill, per token (its own blocks or
    cached ones it shares)."""
    engine = llm.engine
    pages = engine.block_manager.pages
    seq = engine.add_request(prompt, SamplingParams(max_tokens=2), skip_layers=skip)
    engine.step()
    held = sum(pages.held(b) for b in seq.block_table)
    while engine.has_unfinished():
        engine.step()
    layer_bytes_per_token = engine.runner.kv_cache.bytes_per_token / pages.num_layers
    return held * layer_bytes_per_token * engine.block_manager.block_size / len(prompt)


def decode_ms(llm: LLM, prompts: list[list[int]], skips: list[list[int]], new_tokens: int):
    """Median wall ms of a decode step with these requests running together."""
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens + 1, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(p, params, skip_layers=s) for p, s in zip(prompts, skips)]
    times, prefilled = [], False
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        if prefilled:
            times.append(1e3 * (time.perf_counter() - start))
        prefilled = all(s.num_computed_tokens >= s.num_prompt_tokens for s in seqs)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    ap.add_argument("--artifact", help="a zcode calibrate artifact for the layer ranking")
    ap.add_argument("--depths", default="0,2,4,6", help="layers skipped per request, 0 first")
    args = ap.parse_args()
    depths = [int(k) for k in args.depths.split(",")]
    if depths[0] != 0:
        raise SystemExit("--depths starts with 0, the dense baseline")
    heldout, repeats, new_tokens = (1024, 2, 16) if args.quick else (2048, 5, 48)

    llm = LLM(None, dtype="float32", per_request_depth=True, kv_cache_bytes=256 << 20)
    order = skip_order(layer_scores(llm, args.artifact))
    skips = {k: sorted(order[:k]) for k in depths}
    held = corpus_tokens(llm.tokenizer, "heldout", heldout)
    windows = [held[i : i + WINDOW] for i in range(0, len(held) - 1, WINDOW)]
    print(
        f"{len(windows)} held-out windows of <= {WINDOW} tokens; {torch.get_num_threads()} threads"
    )

    logits = {k: window_logits(llm, windows, skips[k]) for k in depths}
    rows = []
    for k in depths:
        q = quality(logits[k], logits[0], windows)
        kv = kv_bytes_per_token(llm, windows[0][:256], skips[k])
        rows.append({"depth": k, "skip_layers": skips[k], **q, "kv_bytes_per_token": kv})
    dense_ppl = rows[0]["ppl"]

    plain = LLM(None, dtype="float32", kv_cache_bytes=256 << 20)
    prompt = windows[-1][:64]
    b1 = {k: [] for k in depths} | {"no pages": []}
    mixed = {k: [] for k in depths}
    for _ in range(repeats):  # interleaved, so drift hits every configuration alike
        b1["no pages"].append(decode_ms(plain, [prompt], [[]], new_tokens))
        for k in depths:
            b1[k].append(decode_ms(llm, [prompt], [skips[k]], new_tokens))
            four = [skips[0], skips[0], skips[k], skips[k]]
            mixed[k].append(decode_ms(llm, [prompt] * 4, four, new_tokens))

    def ms(xs):
        return f"{min(xs):.1f}/{statistics.median(xs):.1f}"

    base = statistics.median(b1[0])
    table = []
    for row in rows:
        k = row["depth"]
        row |= {
            "b1_ms_min": min(b1[k]),
            "b1_ms_median": statistics.median(b1[k]),
            "b1_speedup_median": base / statistics.median(b1[k]),
            "b4_mixed_ms_min": min(mixed[k]),
            "b4_mixed_ms_median": statistics.median(mixed[k]),
            "b4_mixed_speedup_median": statistics.median(mixed[0]) / statistics.median(mixed[k]),
        }
        table.append(
            (
                str(k),
                ",".join(map(str, row["skip_layers"])) or "-",
                f"{row['ppl']:.3f}",
                f"{100 * (row['ppl'] / dense_ppl - 1):+.2f}%",
                f"{row['greedy_agreement']:.3f}",
                f"{row['kl']:.4f}",
                f"{row['kv_bytes_per_token'] / 1024:.1f}",
                f"{100 * (1 - row['kv_bytes_per_token'] / rows[0]['kv_bytes_per_token']):.1f}%",
                ms(b1[k]),
                f"{row['b1_speedup_median']:.2f}x",
                ms(mixed[k]),
                f"{row['b4_mixed_speedup_median']:.2f}x",
            )
        )
    print_rows(
        [
            "skip",
            "layers",
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
    no_pages = statistics.median(b1["no pages"])
    print(
        f"dense without per-layer pages: {ms(b1['no pages'])} ms/token; paging costs "
        f"{100 * (base / no_pages - 1):+.1f}% at batch 1 (medians)"
    )
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "new_tokens": new_tokens,
        "heldout_tokens": len(held),
        "no_pages_b1_ms": b1["no pages"],
    }
    out = RESULTS / "request_depth.json"
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
