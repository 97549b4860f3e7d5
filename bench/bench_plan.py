"""The planner's predictions against measurements, on SmolLM2-135M in fp32 by default.

    .venv/bin/python bench/bench_plan.py [--quick] [--model PATH] [--artifact PATH] [--fit-cost]

1. Quality model (zcode.harness.planner: log-perplexity increases add across dimensions): the
   held-out perplexity increase of combined plans, FFN level x skipped KV groups (the dimensions
   that combine on a float model: precision variants quantize FFNs, which sparse FFNs cannot read
   yet), against the planner's prediction; Spearman rank correlation over the plans.
2. Latency (the hardware cost model): over a grid of (max_latency_ms, max_quality_loss) targets,
   the plan chosen, its predicted and measured batch-1 decode ms/token (min / median of
   --repeats runs, targets round-robin), and whether the fastest run is within 10% of the
   latency target. Needs this machine's fitted cost model (`zcode hw --fit-cost`, or
   --fit-cost here).

The sparsity artifact is read from --artifact or the cache (zcode calibrate), else calibrated
now. Writes bench/results/plan.json.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

from scipy.stats import spearmanr

sys.path.insert(0, str(Path(__file__).parent))
from table_format import print_rows  # noqa: E402

from zcode import LLM  # noqa: E402
from zcode.calibration import corpus_tokens  # noqa: E402
from zcode.hardware.cost_model import CostModel  # noqa: E402
from zcode.hardware.probe import probe  # noqa: E402
from zcode.harness.planner import Candidate  # noqa: E402
from zcode.ppl import perplexity  # noqa: E402
from zcode.sampling_params import SamplingParams  # noqa: E402
from zcode.sparsity.artifact import SparsityArtifact, default_path  # noqa: E402
from zcode.sparsity.calibrate import calibrate  # noqa: E402

RESULTS = Path(__file__).parent / "results"
WINDOW = 512
QUALITY_BUDGETS_PCT = (1.0, 5.0, 20.0)
LATENCY_QUANTILES = (0.1, 0.4, 0.7, 1.0)  # of the candidates' predicted ms, low to high


def load_artifact(
    llm: LLM, path: str | None, num_tokens: int, num_eval_tokens: int
) -> SparsityArtifact:
    path = Path(path) if path else default_path(llm.model)
    if path.is_file():
        return SparsityArtifact.load(path)
    artifact = calibrate(llm, num_tokens=num_tokens, num_eval_tokens=num_eval_tokens)
    artifact.save(path)
    return artifact


def spread(candidates: list[Candidate], num_plans: int) -> list[Candidate]:
    """`num_plans` candidates evenly spaced in predicted loss (the first the least loss)."""
    ranked = sorted(candidates, key=lambda c: c.quality_loss_pct)
    step = max(1, (len(ranked) - 1) / max(1, num_plans - 1))
    picked = {round(i * step) for i in range(num_plans)}
    return [ranked[i] for i in sorted(picked) if i < len(ranked)]


def quality_rows(llm: LLM, candidates: list[Candidate], heldout: list[int]) -> list[dict]:
    dense = min(candidates, key=lambda c: (c.quality_loss_pct, -c.plan.ffn_density))
    base = perplexity(llm, heldout, WINDOW, WINDOW, plan=dense.plan).perplexity
    rows = []
    for c in candidates:
        ppl = perplexity(llm, heldout, WINDOW, WINDOW, plan=c.plan).perplexity
        rows.append(
            {
                "plan": c.plan.name,
                "predicted_loss_pct": c.quality_loss_pct,
                "measured_loss_pct": 100 * (ppl / base - 1),
                "ppl": ppl,
            }
        )
        print(f"{c.plan.name}: ppl {ppl:.4f}", flush=True)
    return rows


def latency_rows(
    llm: LLM, candidates: list[Candidate], prompt: list[int], repeats: int
) -> list[dict]:
    """Each target's plan generated `repeats` times, targets round-robin within a repeat; a
    run's measured ms/token is its report's (the median decode step's). A target is met when
    the fastest run is within 10% of it: the cost model predicts the idle machine (its fit
    takes best-of step times), and other processes only ever make a run slower."""
    ms = sorted(c.ms_per_token for c in candidates)
    targets = [ms[round(q * (len(ms) - 1))] for q in LATENCY_QUANTILES]
    grid = [(target, budget) for target in targets for budget in QUALITY_BUDGETS_PCT]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    llm.generate(prompt, params, max_latency_ms=targets[-1])  # warm-up: kernels, allocator
    reports = {cell: [] for cell in grid}
    for _ in range(repeats):
        for target, budget in grid:
            out = llm.generate(prompt, params, max_latency_ms=target, max_quality_loss=budget)[0]
            reports[target, budget].append(out.plan)
    rows = []
    for (target, budget), runs in reports.items():
        measured = [r.measured_ms_per_token for r in runs]
        report = runs[0]
        rows.append(
            {
                "max_latency_ms": target,
                "max_quality_loss": budget,
                "plan": report.plan,
                "binding": report.binding,
                "target_met": report.target_met,
                "predicted_ms": report.predicted_ms_per_token,
                "measured_ms_min": min(measured),
                "measured_ms_median": statistics.median(measured),
                "within_10pct": min(measured) <= 1.1 * target,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", help="HF directory or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--artifact", help="sparsity artifact (default: cached or calibrated)")
    parser.add_argument("--calibration-tokens", type=int, default=4096)
    parser.add_argument("--calibration-eval-tokens", type=int, default=1024)
    parser.add_argument("--heldout-tokens", type=int, default=4096)
    parser.add_argument("--num-plans", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each latency target")
    parser.add_argument("--fit-cost", action="store_true", help="fit the cost model if missing")
    args = parser.parse_args()
    if args.quick:
        args.heldout_tokens, args.num_plans = 1024, 6
    llm = LLM(args.model, dtype="float32", per_request_depth=True, kv_cache_bytes=256 << 20)
    llm.sparsity = load_artifact(
        llm, args.artifact, args.calibration_tokens, args.calibration_eval_tokens
    )
    llm.cost_model = CostModel.load_or_fit() if args.fit_cost else CostModel.cached(probe())
    llm.declare_default_plan()
    candidates = llm.planner().candidates()
    heldout = corpus_tokens(llm.tokenizer, "heldout", args.heldout_tokens)

    quality = quality_rows(llm, spread(candidates, args.num_plans), heldout)
    rho = spearmanr(
        [r["predicted_loss_pct"] for r in quality], [r["measured_loss_pct"] for r in quality]
    ).statistic
    print_rows(
        ["plan", "predicted +ppl %", "measured +ppl %"],
        [
            (r["plan"], f"{r['predicted_loss_pct']:.2f}", f"{r['measured_loss_pct']:.2f}")
            for r in quality
        ],
    )
    print(f"Spearman(predicted, measured held-out perplexity increase) = {rho:.3f}")

    latency = []
    if llm.cost_model is None:
        print("latency: no fitted cost model on this machine (zcode hw --fit-cost, or --fit-cost)")
    else:
        latency = latency_rows(llm, candidates, heldout[:64], args.repeats)
        print_rows(
            [
                "max ms",
                "max +ppl %",
                "plan",
                "binding",
                "predicted ms",
                "measured ms min / median",
                "<=1.1x",
            ],
            [
                (
                    f"{r['max_latency_ms']:.2f}",
                    f"{r['max_quality_loss']:g}",
                    r["plan"],
                    r["binding"],
                    f"{r['predicted_ms']:.2f}",
                    f"{r['measured_ms_min']:.2f} / {r['measured_ms_median']:.2f}",
                    "yes" if r["within_10pct"] else "no",
                )
                for r in latency
            ],
        )
        met = statistics.mean(r["within_10pct"] for r in latency)
        print(
            f"targets met by measured ms/token within 10% (fastest of {args.repeats} runs): "
            f"{met:.0%} of {len(latency)}"
        )
    RESULTS.mkdir(exist_ok=True)
    blob = {"spearman": rho, "quality": quality, "latency": latency}
    (RESULTS / "plan.json").write_text(json.dumps(blob, indent=2) + "\n")


if __name__ == "__main__":
    main()
