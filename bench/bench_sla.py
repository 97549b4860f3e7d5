"""generate(max_latency_ms=...) on SmolLM2-135M fp32 at batch 1: for several targets, the plan the
planner picks, its predicted and measured decode ms/token, and its quality cost on held-out text.

    .venv/bin/python bench/bench_sla.py [--quick] [--threads N] [--artifact PATH] [--no-refit]

The artifact (default: the user cache's, written by `zcode calibrate`; calibrated here if there
is none) gives the thresholds, the levels and the latency fit. By default the calibration's four
fit levels are timed again now and the fit redone (the load during calibration need not be
today's; the table also shows what the calibration's own fit predicted); --no-refit plans with
the calibration's fit. Either way the planner predicts the other levels out of sample, and the
table marks which chosen levels were fit points. Targets are spread between the fastest
predicted level and dense. Each target runs `repeats` times, interleaved with the others:
measured ms/token is each run's median step, min and median over runs; the ratio is measured /
predicted. Quality on held-out text only
(teacher-forced 512-token windows): perplexity change, greedy-token agreement and mean
KL(dense || plan) per token. Writes bench/results/sla.json.
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_sparsity import WINDOW, quality, run_sizes  # noqa: E402
from table_format import print_rows  # noqa: E402

from zcode import LLM  # noqa: E402
from zcode.calibration import corpus_tokens  # noqa: E402
from zcode.sampling_params import SamplingParams  # noqa: E402
from zcode.sparsity.apply import set_ffn_level  # noqa: E402
from zcode.sparsity.artifact import SparsityArtifact, default_path  # noqa: E402
from zcode.sparsity.calibrate import LATENCY_LEVELS, calibrate  # noqa: E402
from zcode.sparsity.latency import (  # noqa: E402
    fit_latency,
    kernel_mb_per_token,
    measure_latency_points,
)
from zcode.sparsity.planner import level_name, predicted_ms  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens, targets and repeats")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--artifact", help="a zcode calibrate artifact (default: the user cache's)")
    ap.add_argument(
        "--no-refit",
        dest="refit",
        action="store_false",
        help="plan with the calibration's latency fit instead of refitting in this run",
    )
    args = ap.parse_args()
    quick = args.quick
    heldout_tokens, repeats, decode_tokens = run_sizes(args)
    num_targets = 4 if quick else 6

    llm = LLM(None, dtype="float32", enable_prefix_caching=False)
    path = Path(args.artifact) if args.artifact else default_path(llm.model)
    if path.is_file():
        artifact = SparsityArtifact.load(path)
    else:
        print(f"no artifact at {path}: calibrating ...", flush=True)
        artifact = calibrate(llm)
        artifact.save(path)
    held = corpus_tokens(llm.tokenizer, "heldout", heldout_tokens)
    prompt = held[:64]
    fit_levels = [
        lv for lv in artifact.levels if (lv.sparsity_in, lv.sparsity_mid) in LATENCY_LEVELS
    ]
    calibration_fit = artifact.latency
    if args.refit:
        points = measure_latency_points(llm, artifact, fit_levels, prompt, repeats, decode_tokens)
        artifact.latency = fit_latency(points)
        print(f"refit on {[p[2] for p in points]} ms", flush=True)
    fit = artifact.latency
    set_ffn_level(llm.model, artifact, 0.0, 0.0)
    llm.sparsity = artifact

    predicted = {lv: predicted_ms(llm.model, artifact, lv) for lv in artifact.levels}
    slowest, fastest = max(predicted.values()), min(predicted.values())
    step = (slowest - fastest) / (num_targets - 1)
    targets = [fastest * 1.01 + k * step for k in range(num_targets)]
    params = SamplingParams(max_tokens=decode_tokens + 1, temperature=0, ignore_eos=True)
    llm.generate(prompt, params, max_latency_ms=slowest)  # warm-up: kernel build, allocator
    measured = {t: [] for t in targets}
    reports = {}
    for _ in range(repeats):
        for target in targets:
            out = llm.generate(prompt, params, max_latency_ms=target)[0]
            measured[target].append(out.plan["measured_ms_per_step"])
            reports[target] = out.plan

    level_of = {level_name(lv): lv for lv in artifact.levels}
    chosen = {level_of[reports[t]["plan"]] for t in targets}
    dense_level = artifact.levels[0]
    set_ffn_level(llm.model, artifact, 0.0, 0.0)
    windows = [held[i : i + WINDOW] for i in range(0, len(held) - 1, WINDOW)]
    dense_q, dense_logits = quality(llm, windows, None)
    qualities = {dense_level: {**dense_q, "greedy_agreement": 1.0, "kl_per_token": 0.0}}
    for lv in chosen - {dense_level}:
        set_ffn_level(llm.model, artifact, lv.sparsity_in, lv.sparsity_mid)
        qualities[lv], _ = quality(llm, windows, dense_logits)
    set_ffn_level(llm.model, artifact, 0.0, 0.0)

    rows = []
    for target in targets:
        report, lv = reports[target], level_of[reports[target]["plan"]]
        ms = measured[target]
        q = qualities[lv]
        rows.append(
            {
                **report,
                "fit_point": lv in fit_levels,
                "calibration_fit_predicted_ms": calibration_fit.predict_ms(
                    *kernel_mb_per_token(llm.model, lv.sparsity_in, lv.sparsity_mid)
                ),
                "measured_ms_min": min(ms),
                "measured_ms_median": statistics.median(ms),
                "ratio_min": min(ms) / report["predicted_ms_per_step"],
                "ratio_median": statistics.median(ms) / report["predicted_ms_per_step"],
                "heldout_ppl": q["ppl"],
                "heldout_ppl_increase": q["ppl"] / dense_q["ppl"] - 1,
                "greedy_agreement": q["greedy_agreement"],
                "kl_per_token": q["kl_per_token"],
            }
        )
    print(
        f"\nlatency fit: {fit.overhead_ms:.2f} ms + {fit.ms_per_mb:.4f} ms/MB dense "
        f"+ {fit.sparse_ms_per_mb:.4f} ms/MB sparse rows ({'refit now' if args.refit else path})"
    )
    print_rows(
        [
            "target ms",
            "plan",
            "fit pt",
            "FFN skip",
            "pred ms",
            "calib pred",
            "meas min/med",
            "meas/pred",
            "held-out +ppl",
            "agree",
            "KL",
        ],
        [
            (
                f"{r['max_latency_ms']:.1f}",
                r["plan"],
                "yes" if r["fit_point"] else "no",
                f"{r['ffn_flops_skipped']:.1%}",
                f"{r['predicted_ms_per_step']:.1f}",
                f"{r['calibration_fit_predicted_ms']:.1f}",
                f"{r['measured_ms_min']:.1f}/{r['measured_ms_median']:.1f}",
                f"{r['ratio_min']:.3f}/{r['ratio_median']:.3f}",
                f"{100 * r['heldout_ppl_increase']:+.2f}%",
                f"{r['greedy_agreement']:.3f}",
                f"{r['kl_per_token']:.4f}",
            )
            for r in rows
        ],
    )
    within = sum(abs(r["ratio_min"] - 1) <= 0.2 for r in rows)
    print(f"{within}/{len(rows)} targets: measured (min) within 20% of predicted")

    RESULTS.mkdir(exist_ok=True)
    meta = {
        "threads": torch.get_num_threads(),
        "quick": quick,
        "refit": args.refit,
        "heldout_tokens": len(held),
        "repeats": repeats,
        "decode_tokens": decode_tokens,
        "load_average_1_5_15_min": os.getloadavg(),  # others' work inflates measured ms
    }
    blob = {
        "meta": meta,
        "latency_fit": vars(fit),
        "calibration_latency_fit": vars(calibration_fit),
        "predicted_ms": {level_name(lv): ms for lv, ms in predicted.items()},
        "targets": rows,
    }
    (RESULTS / "sla.json").write_text(json.dumps(blob, indent=2))
    print(f"wrote {RESULTS / 'sla.json'}")


if __name__ == "__main__":
    main()
