"""The planner's predictions against measurements, on SmolLM2-135M in fp32 by default.

    .venv/bin/python bench/bench_plan.py [--quick] [--model PATH] [--artifact PATH] [--fit-cost]
        [--budget 4.5bits [--variant-cap 400MB]]

1. Every candidate plan (or --num-plans of them, evenly spaced in predicted loss) measured:
   held-out perplexity increase, and batch-1 decode ms/token (the min / median of --repeats runs,
   plans round-robin). The quality model (zcode.harness.planner: log-perplexity increases add
   across dimensions; an FFN level on int8 rows is measured as one) against the measured
   increases: Spearman rank correlation. The dimensions that combine on a float model:
   precision (the rows the sparse FFN kernel reads: fp32 as loaded, or int8; with --budget also
   the precision levels of the other linears, built from the artifact's sensitivity profile:
   the budget's plan, int8 and unquantized variants under --variant-cap), the FFN level,
   skipped KV groups (skipped layers need a router: bench_router.py) and, on a MoE model
   (--model), the routed experts a token runs.
2. Pareto frontiers of those measurements (ms/token, perplexity increase): each dimension alone
   (int8 FFN rows at the dense level and full depth; FFN levels on fp32 rows at full depth; KV
   groups skipped at the dense fp32 FFN; fewer experts a token) and the joint product, with
   the area each dominates up to the dense plan's ms and a 20% loss (larger is better); plotted
   with the planner's choices below to bench/results/plan_pareto.png.
3. Latency (the hardware cost model): over a grid of (max_latency_ms, max_quality_loss) targets,
   the plan chosen, its predicted and measured batch-1 decode ms/token (min / median of
   --repeats runs, targets round-robin), and whether the fastest run is within 10% of the
   latency target. The planner checks a target at the latency feedback's scale (the median
   measured over predicted ms of the latest requests, those of part 1 first; printed beside
   each prediction; ZCODE_LATENCY_FEEDBACK=0: the cost model alone), and the targets are spread
   over the candidates' predicted ms at the context the requests are planned at, times that
   scale when the grid starts (at the fit's own scale, on a host slower than at the fit, the
   tightest targets are below what any plan can do). Part 1's plans are explicit, so their
   predictions are the cost model's own. Needs this machine's fitted cost
   model (`zcode hw --fit-cost`, or --fit-cost here).

The sparsity artifact is read from --artifact or the cache (zcode calibrate), else calibrated
now (--calibration-eval-tokens: the slice its candidates are scored on; 4096 for
scripts/train_tiny_moe.py's model, whose byte-level tokenizer makes the default 1024 ~1 KB of
text: its 4 and 6 experts a token scored +2.42 and +2.46 there, +6.1 and +1.7 % held out).
Writes bench/results/plan.json and plan_pareto.png (plan_<model>.* for --model).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

from scipy.stats import spearmanr
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from table_format import print_rows  # noqa: E402

from zcode import LLM  # noqa: E402
from zcode.calibration import corpus_tokens  # noqa: E402
from zcode.hardware.cost_model import CostModel  # noqa: E402
from zcode.hardware.probe import probe, read_bandwidth_gbps  # noqa: E402
from zcode.harness.planner import Candidate  # noqa: E402
from zcode.llm import planning_context_len  # noqa: E402
from zcode.ppl import perplexity  # noqa: E402
from zcode.quant.variants import attach_variants  # noqa: E402
from zcode.sampling_params import SamplingParams  # noqa: E402
from zcode.sparsity.artifact import SparsityArtifact, default_path  # noqa: E402
from zcode.sparsity.calibrate import calibrate  # noqa: E402

RESULTS = Path(__file__).parent / "results"
WINDOW = 512
QUALITY_BUDGETS_PCT = (1.0, 5.0, 20.0)
LATENCY_QUANTILES = (0.1, 0.4, 0.7, 1.0)  # of the candidates' predicted ms, low to high
PROMPT_TOKENS, DECODE_TOKENS = 64, 32
FRONTIER_MAX_LOSS_PCT = 20.0  # the frontiers' areas are measured up to this loss


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
    """`num_plans` candidates evenly spaced in predicted loss (the first the least loss), and
    each dimension's fastest plan cutting it alone, so that every single-dimension frontier has
    a point past the dense plan."""
    ranked = sorted(candidates, key=lambda c: (c.quality_loss_pct, len(dimensions(c.plan))))
    step = max(1, (len(ranked) - 1) / max(1, num_plans - 1))
    picked = {round(i * step) for i in range(num_plans)}
    for dimension in {d for c in ranked for d in dimensions(c.plan)}:
        alone = [i for i, c in enumerate(ranked) if dimensions(c.plan) == {dimension}]
        picked.add(min(alone, key=lambda i: ranked[i].ms_per_token or 0.0, default=0))
    return [ranked[i] for i in sorted(picked) if i < len(ranked)]


def dimensions(plan) -> frozenset[str]:
    """The dimensions a plan cuts: "precision" (FFN rows other than the loaded fp32, quantized
    linears), "sparsity" (an FFN level past dense), "depth" (skips), "experts" (fewer routed
    experts a token than the model's top_k)."""
    extras = dict(plan.extras)
    level = {float(v) for k, v in extras.items() if k.startswith("ffn_sparsity_")}
    cut = {"sparsity"} if level - {0.0} else set()
    if extras.get("ffn_weights", "fp32") != "fp32" or plan.precision:
        cut.add("precision")
    if "experts_per_token" in extras:
        cut.add("experts")
    return frozenset(cut | ({"depth"} if plan.skip_layers or plan.skip_kv_heads else set()))


def measure(
    llm: LLM, candidates: list[Candidate], heldout: list[int], prompt: list[int], repeats: int
) -> list[dict]:
    """Each candidate's held-out perplexity increase (over the dense plan's) and decode
    ms/token (its report's: the median decode step's), `repeats` runs, plans round-robin."""
    dense = min(candidates, key=lambda c: (c.quality_loss_pct, len(dimensions(c.plan))))
    base = perplexity(llm, heldout, WINDOW, WINDOW, plan=dense.plan).perplexity
    loss_pct = {}
    for c in tqdm(candidates, desc="held-out perplexity"):
        ppl = perplexity(llm, heldout, WINDOW, WINDOW, plan=c.plan).perplexity
        loss_pct[c.plan.name] = 100 * (ppl / base - 1)
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0, ignore_eos=True)
    llm.generate(prompt, params, plan=dense.plan)  # warm-up: kernels, allocator
    ms = {c.plan.name: [] for c in candidates}
    for _ in tqdm(range(repeats), desc="decode ms, rounds"):
        for c in candidates:
            ms[c.plan.name].append(llm.generate(prompt, params, plan=c.plan)[0].plan)
    return [
        {
            "plan": c.plan.name,
            "dimensions": sorted(dimensions(c.plan)),
            "predicted_loss_pct": c.quality_loss_pct,
            "measured_loss_pct": loss_pct[c.plan.name],
            "predicted_ms": ms[c.plan.name][0].predicted_ms_per_token,
            "measured_ms_min": min(r.measured_ms_per_token for r in ms[c.plan.name]),
            "measured_ms_median": statistics.median(
                r.measured_ms_per_token for r in ms[c.plan.name]
            ),
        }
        for c in candidates
    ]


def frontier(rows: list[dict]) -> list[dict]:
    """The rows no other row beats on both measured ms (min) and measured loss, by ms."""
    out = []
    for r in sorted(rows, key=lambda r: (r["measured_ms_min"], r["measured_loss_pct"])):
        if not out or r["measured_loss_pct"] < out[-1]["measured_loss_pct"]:
            out.append(r)
    return out


def dominated_area(points: list[dict], max_ms: float, max_loss: float) -> float:
    """The area of (ms, loss %) up to (max_ms, max_loss) that the frontier's points dominate."""
    area, prev_loss = 0.0, max_loss
    for r in points:  # by ms, loss falling
        loss = min(r["measured_loss_pct"], max_loss)
        if r["measured_ms_min"] < max_ms and loss < prev_loss:
            area += (max_ms - r["measured_ms_min"]) * (prev_loss - loss)
            prev_loss = loss
    return area


FRONTIERS = {  # name: which plans (by the dimensions they cut) it is drawn from
    "precision alone": lambda dims: dims <= {"precision"},
    "sparsity alone": lambda dims: dims <= {"sparsity"},
    "depth alone": lambda dims: dims <= {"depth"},
    "experts alone": lambda dims: dims <= {"experts"},
    "joint": lambda dims: True,
}


def frontiers(rows: list[dict]) -> dict[str, list[dict]]:
    """Each frontier of FRONTIERS whose dimension some plan cuts (the joint one always)."""
    cut = {d for r in rows for d in r["dimensions"]}
    return {
        name: frontier([r for r in rows if keep(frozenset(r["dimensions"]))])
        for name, keep in FRONTIERS.items()
        if name == "joint" or name.removesuffix(" alone") in cut
    }


def plot(rows: list[dict], fronts: dict, latency: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ax.scatter(
        [r["measured_ms_min"] for r in rows],
        [r["measured_loss_pct"] for r in rows],
        color="lightgray",
        s=12,
        label="every candidate",
    )
    for (name, points), style in zip(fronts.items(), ("v-", "o-", "s-", "^-", "D-")):
        xs = [r["measured_ms_min"] for r in points]
        ys = [r["measured_loss_pct"] for r in points]
        ax.step(xs, ys, style, where="post", label=f"{name} frontier", markersize=4)
    loss = {r["plan"]: r["measured_loss_pct"] for r in rows}
    picked = [r for r in latency if r["plan"] in loss]
    if picked:
        ax.scatter(
            [r["measured_ms_min"] for r in picked],
            [loss[r["plan"]] for r in picked],
            marker="x",
            color="black",
            s=50,
            zorder=5,
            label="planner's choices (latency grid)",
        )
    ax.set_xlabel("batch-1 decode ms/token (min over runs)")
    ax.set_ylabel("held-out perplexity increase, %")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_ylim(bottom=-0.5)
    ax.set_title(f"{title} fp32: measured plans, quality vs latency")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def latency_rows(
    llm: LLM, candidates: list[Candidate], prompt: list[int], repeats: int
) -> list[dict]:
    """Each target's plan generated `repeats` times, targets round-robin within a repeat; a
    run's measured ms/token is its report's (the median decode step's). A target is met when
    the fastest run is within 10% of it: the cost model predicts the idle machine (its fit
    takes best-of step times), and other processes only ever make a run slower. `candidates`:
    predicted at the context the requests are planned at. The targets are spread over those
    predictions at the scale the planner checks them at when the grid starts (the latency
    feedback's, from part 1's runs): at the fit's own scale, on a host slower than at the fit,
    the tightest targets are below what any plan can do, and missing them measures the host."""
    scale = llm.latency_feedback.scale() if llm.latency_feedback is not None else 1.0
    ms = sorted(c.ms_per_token * scale for c in candidates)
    targets = [ms[round(q * (len(ms) - 1))] for q in LATENCY_QUANTILES]
    grid = [(target, budget) for target in targets for budget in QUALITY_BUDGETS_PCT]
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0, ignore_eos=True)
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
                "latency_scale": report.latency_scale,
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
    parser.add_argument("--num-plans", type=int, help="measure this many (default: every plan)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each plan and target")
    parser.add_argument("--fit-cost", action="store_true", help="fit the cost model if missing")
    parser.add_argument("--budget", help="precision levels of the linears outside the FFNs too")
    parser.add_argument(
        "--variant-cap",
        default="400MB",
        help="memory for their variants; SmolLM2's all fit, so one level is unquantized "
        "(default: %(default)s)",
    )
    args = parser.parse_args()
    if args.quick:
        args.heldout_tokens, args.num_plans = 1024, 12
    llm = LLM(args.model, dtype="float32", per_request_depth=True, kv_cache_bytes=256 << 20)
    llm.sparsity = load_artifact(
        llm, args.artifact, args.calibration_tokens, args.calibration_eval_tokens
    )
    llm.cost_model = CostModel.load_or_fit() if args.fit_cost else CostModel.cached(probe())
    llm.declare_default_plan()
    if args.budget:
        attach_variants(llm, llm.sparsity.sensitivity, args.budget, args.variant_cap)
    heldout = corpus_tokens(llm.tokenizer, "heldout", args.heldout_tokens)
    prompt = heldout[:PROMPT_TOKENS]
    context_len = planning_context_len([len(prompt)], DECODE_TOKENS)
    candidates = llm.planner().candidates(context_len=context_len)
    measured = candidates if args.num_plans is None else spread(candidates, args.num_plans)

    rows = measure(llm, measured, heldout, prompt, args.repeats)
    print_rows(
        ["plan", "predicted +ppl %", "measured +ppl %", "predicted ms", "measured ms min / median"],
        [
            (
                r["plan"],
                f"{r['predicted_loss_pct']:.2f}",
                f"{r['measured_loss_pct']:.2f}",
                "-" if r["predicted_ms"] is None else f"{r['predicted_ms']:.2f}",
                f"{r['measured_ms_min']:.2f} / {r['measured_ms_median']:.2f}",
            )
            for r in rows
        ],
    )
    rho = spearmanr(
        [r["predicted_loss_pct"] for r in rows], [r["measured_loss_pct"] for r in rows]
    ).statistic
    print(
        f"Spearman(predicted, measured held-out perplexity increase) = {rho:.3f} over {len(rows)}"
    )
    if rows[0]["predicted_ms"] is not None:
        errors = [r["measured_ms_min"] / r["predicted_ms"] - 1 for r in rows]
        within = statistics.mean(abs(e) <= 0.1 for e in errors)
        print(
            f"measured (fastest run) over predicted ms: median {statistics.median(errors):+.1%}, "
            f"range {min(errors):+.1%} .. {max(errors):+.1%}; within 10%: {within:.0%}"
        )

    fronts = frontiers(rows)
    dense_ms = min((r for r in rows if not r["dimensions"]), key=lambda r: r["measured_loss_pct"])[
        "measured_ms_min"
    ]
    areas = {
        name: dominated_area(points, dense_ms, FRONTIER_MAX_LOSS_PCT)
        for name, points in fronts.items()
    }
    for name, points in fronts.items():
        path = ", ".join(
            f"{r['measured_ms_min']:.1f} ms {r['measured_loss_pct']:.1f}%" for r in points
        )
        print(f"{name} frontier ({areas[name]:.1f} ms x % dominated): {path}")

    latency = []
    if llm.cost_model is None:
        print("latency: no fitted cost model on this machine (zcode hw --fit-cost, or --fit-cost)")
    else:
        gbps = [read_bandwidth_gbps()]
        latency = latency_rows(llm, candidates, prompt, args.repeats)
        gbps.append(read_bandwidth_gbps())
        print_rows(
            [
                "max ms",
                "max +ppl %",
                "plan",
                "binding",
                "predicted ms (x scale)",
                "measured ms min / median",
                "<=1.1x",
            ],
            [
                (
                    f"{r['max_latency_ms']:.2f}",
                    f"{r['max_quality_loss']:g}",
                    r["plan"],
                    r["binding"],
                    f"{r['predicted_ms']:.2f} (x{r['latency_scale']:.2f})",
                    f"{r['measured_ms_min']:.2f} / {r['measured_ms_median']:.2f}",
                    "yes" if r["within_10pct"] else "no",
                )
                for r in latency
            ],
        )
        met = statistics.mean(r["within_10pct"] for r in latency)
        print(
            f"targets met by measured ms/token within 10% (fastest of {args.repeats} runs): "
            f"{met:.0%} of {len(latency)}; read bandwidth before / after "
            f"{min(gbps):.1f}-{max(gbps):.1f} GB/s, the cost model's steps timed at "
            + (f"{llm.cost_model.fit_read_gbps:.1f}" if llm.cost_model.fit_read_gbps else "?")
        )
    RESULTS.mkdir(exist_ok=True)
    model_name = "SmolLM2-135M" if args.model is None else Path(args.model).stem
    stem = "plan" if args.model is None else f"plan_{model_name}"
    plot(rows, fronts, latency, model_name, RESULTS / f"{stem}_pareto.png")
    blob = {
        "spearman": rho,
        "plans": rows,
        "frontiers": {name: [r["plan"] for r in points] for name, points in fronts.items()},
        "frontier_areas": areas,
        "latency": latency,
    }
    (RESULTS / f"{stem}.json").write_text(json.dumps(blob, indent=2) + "\n")
    print(f"wrote {RESULTS / stem}.json and {RESULTS / stem}_pareto.png")


if __name__ == "__main__":
    main()
