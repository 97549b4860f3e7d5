"""The precision planner's acceptance on SmolLM2-135M: planned mixed precision against uniform
formats, predicted loss against measured loss, and the quality/speed Pareto plot, in one run.

    .venv/bin/python bench/bench_precision.py [--quick] [--profile PROFILE.json]
        [--profile-tokens 512] [--repeats 2] [--out bench/results/precision.json]

Configurations, each applied to the same fp32 model (the embedded Q4_1 GGUF dequantized):
fp32; uniform int8, int4-g32, int4-g64, int4-g128 by round-to-nearest (RTN), the formats the
profile measured; the same int4 formats by GPTQ (zcode.quant.gptq, Hessians from 2048
calibration tokens); and the planner's plans (zcode.quant.planner) at byte budgets:

- matched: exactly the bytes of each uniform int4 format (its bits per weight count the 4-bit
  codes plus the bf16 scale and zero of every group, and the padding of K = 576 to 640 at
  g128). Each matched plan is realised twice: by RTN, as profiled, and by GPTQ (the planner
  chooses the map, GPTQ quantizes each module in the format chosen), so that the plan meets
  each uniform int4 format with the same quantizer at the same bytes.
- spread: SPREAD_BUDGETS more, evenly in bytes from the cheapest plan to uniform int8.

The weights are dequantized Q4_1 (group 32), so int4-g32 RTN reproduces the decoder layers
almost exactly; at int4-g32's 5.0 bits the only richer option, int8, costs 3 bits more per weight
and no mix of cheaper formats pays for it, so the plan there is uniform int4-g32 itself.

Quality runs the reference kernels (dequantize, fp32 F.linear: the format's own rounding, as
the profile measured it); speed runs the fast kernels. Quality is measured on held-out text
the profile never saw (`corpus_tokens(tok, "heldout", 2048)`): perplexity with window 512,
stride 256 (zcode.ppl), and the mean KL(fp32 || plan) of the next-token distributions over the
first 512 held-out tokens. The predicted loss of a plan is the sum of its units' KL in the
profile (calibration text, each unit quantized alone by RTN); the Spearman correlation of
predicted against measured KL and perplexity delta is reported across the RTN-realised plans
(scipy.stats.spearmanr).

generate(quality=) (zcode.quant.variants): the model quantized to the plan at int4-g64's bytes
("fast"), with variants of the units the memory cap --variant-cap holds in int8 ("balanced") and
unquantized ("max"); held-out perplexity and KL of each level, last (it quantizes the model).

Speed: batch-1 decode tok/s of each configuration (fast kernels) after a 16-token prompt,
min and median seconds of --repeats runs, configurations round-robin within a repeat so load
from other jobs hits them alike. Bytes per token: every linear's weight as it is stored (packed
weights plus scales for the quantized ones) plus the norms; the embedding lookup reads one row.

Without --profile the sensitivity profile is measured first (slow on 2 shared cores: tens of
minutes at 512 tokens); `zcode profile --out P.json` writes one to pass here.
--quick: 1024 held-out tokens, 2 spread budgets, 1 repeat of 16 decode tokens, no GPTQ.
"""

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from scipy.stats import spearmanr
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))  # table_format, run as a script

from table_format import print_rows  # noqa: E402

from zcode.calibration import corpus_tokens  # noqa: E402
from zcode.llm import LLM  # noqa: E402
from zcode.ppl import perplexity  # noqa: E402
from zcode.quant import apply_precision, quantizable_modules  # noqa: E402
from zcode.quant.linear import QuantizedLinear  # noqa: E402
from zcode.quant.planner import module_formats, plan  # noqa: E402
from zcode.quant.report import draw_pareto  # noqa: E402
from zcode.quant.sensitivity import SingleSequenceRunner, profile_sensitivity  # noqa: E402
from zcode.quant.variants import attach_variants, swap  # noqa: E402
from zcode.sampling_params import SamplingParams  # noqa: E402

RESULTS_DIR = Path(__file__).parent / "results"
WINDOW, STRIDE = 512, 256
KL_TOKENS = 512
SPREAD_BUDGETS = 6  # with the 3 matched ones, 9 planned budgets for the Spearman correlation
PROFILE_FORMATS = ("int8", "int4-g32", "int4-g64", "int4-g128", "w8a8", "w4a8")
UNIFORM_INT4 = ("int4-g32", "int4-g64", "int4-g128")
UNIFORM_RTN = ("int8", *UNIFORM_INT4)
PROMPT = "The capital of France is"


def uniform_bits(profile: dict, fmt: str) -> float:
    modules = profile["modules"].values()
    return (
        8
        * sum(e["formats"][fmt]["bytes"] for e in modules)
        / sum(e["num_weights"] for e in modules)
    )


def matched_budgets(profile: dict) -> dict[str, str]:
    """Uniform int4 format -> a byte budget of exactly its bytes, for the formats profiled."""
    modules = profile["modules"].values()
    return {
        fmt: f"{sum(e['formats'][fmt]['bytes'] for e in modules)}B"
        for fmt in UNIFORM_INT4
        if fmt in profile["formats"]
    }


def spread_budgets(profile: dict, count: int) -> list[str]:
    """`count` byte budgets spread evenly from the cheapest plan to uniform int8, both ends in."""
    modules = profile["modules"].values()
    formats = [f for f in UNIFORM_RTN if f in profile["formats"]]
    cheapest = sum(min(e["formats"][f]["bytes"] for f in formats) for e in modules)
    int8 = sum(e["formats"]["int8"]["bytes"] for e in modules)
    steps = count - 1
    return [f"{cheapest + (int8 - cheapest) * i // steps}B" for i in range(steps + 1)]


def unit_bytes(entry: dict, fmt: str) -> int:
    """Bytes of one profiled unit's weights in a format ("fp32": as loaded, 4 per weight)."""
    return 4 * entry["num_weights"] if fmt == "fp32" else entry["formats"][fmt]["bytes"]


def bytes_per_token(model: nn.Module) -> int:
    """Bytes one decode step reads: every linear's stored weight (packed + scales when
    quantized, tied lm_head counted once as a matrix) plus norm weights; not the embedding."""
    total = 0
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            total += module.weight_bytes
        elif isinstance(module, nn.Linear):  # zcode.layers.Linear too
            total += module.weight.numel() * module.weight.element_size()
        elif name.endswith("norm"):
            total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    return total


class Config:
    """One configuration: its plan is quantized on first use, its modules kept for later."""

    def __init__(self, label: str, kind: str, formats: dict[str, str], **options) -> None:
        self.label, self.kind, self.formats, self.options = label, kind, formats, options
        self.modules: dict[str, nn.Module] | None = None

    @contextmanager
    def applied(self, llm: LLM) -> Iterator[None]:
        """The plan's modules swapped into llm.model, the originals put back afterwards."""
        model = llm.model
        names = [n for n, f in self.formats.items() if f != "fp32"]
        originals = {n: model.get_submodule(n) for n in names}
        if self.modules is None:
            self.modules = apply_precision(model, self.formats, kernel="reference", **self.options)
        else:
            swap(model, self.modules)
        try:
            yield
        finally:
            swap(model, originals)


def decode_seconds(llm: LLM, prompt_ids: list[int], num_new: int) -> float:
    """Seconds between the first and the last of `num_new` greedy tokens at batch 1."""
    engine = llm.engine
    params = SamplingParams(max_tokens=num_new, temperature=0, ignore_eos=True)
    seq = engine.add_request(prompt_ids, params)
    engine.step()  # prefill + first token
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    seconds = time.perf_counter() - start
    assert seq.num_output_tokens == num_new
    return seconds


def measured_kl(llm: LLM, kl_ids: list[int], dense: torch.Tensor) -> float:
    with SingleSequenceRunner(llm.model, kl_ids) as runner:
        quant = runner.log_probs()
    return (dense.exp() * (dense - quant)).sum(-1).mean().item()


def matched_verdicts(by_label: dict[str, dict], matched: dict[str, str]) -> dict[str, dict]:
    """Per uniform int4 format: its perplexity by RTN and GPTQ, the plan's at exactly its bytes
    realised by each, and whether the plan beats both uniform rows (each plan against the
    uniform format under the same quantizer, and the RTN plan also against uniform GPTQ)."""
    verdicts = {}
    for fmt in matched:
        ppl = {
            key: by_label[label]["ppl"] if label in by_label else None
            for key, label in (
                ("uniform_rtn", fmt),
                ("uniform_gptq", f"{fmt} gptq"),
                ("plan_rtn", f"plan@{fmt}"),
                ("plan_gptq", f"plan@{fmt} gptq"),
            )
        }
        best = min((k for k in ppl if k.startswith("plan") and ppl[k] is not None), key=ppl.get)
        rivals = [k for k in ppl if k.startswith("uniform") and ppl[k] is not None]
        beats = all(ppl[best] < ppl[rival] for rival in rivals)
        verdicts[fmt] = {
            **ppl,
            "bits_per_weight": by_label[fmt]["bits_per_weight"],
            "best_plan": best,
            "beats_uniform": beats,
            "verdict": f"{best.replace('_', ' ')} "
            + ("beats " if beats else "does NOT beat ")
            + " and ".join(k.removeprefix("uniform_").upper() for k in rivals),
        }
    return verdicts


def quality_variant_rows(
    llm: LLM,
    profile: dict,
    budget: str,
    cap: str,
    heldout: list[int],
    kl_ids: list[int],
    dense: torch.Tensor,
) -> list[dict]:
    """The precision variants' three levels on the model (quantized in place to the `budget`
    plan, so this runs last): each level's plan with held-out perplexity and KL."""
    attach_variants(llm, profile, budget, cap, kernel="reference")
    rows = []
    executor = llm.engine.executor
    for quality, level in llm.precision_variants.levels.items():
        ppl = perplexity(llm, heldout, WINDOW, STRIDE, plan=level.plan).perplexity
        executor.apply(level.plan)  # the model as the plan runs it, for the KL's own forwards
        kl = measured_kl(llm, kl_ids, dense)
        executor.apply(executor.default)
        rows.append(
            {"quality": quality, "plan": level.plan.name, "predicted_kl": level.predicted_kl}
            | {"ppl": ppl, "measured_kl": kl}
        )
        print(f"quality={quality:>8}: ppl {ppl:.4f}  KL {kl:.5f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--profile", type=Path, help="sensitivity profile JSON to plan from")
    parser.add_argument("--profile-tokens", type=int, default=512)
    parser.add_argument("--heldout-tokens", type=int, default=2048)
    parser.add_argument(
        "--repeats", type=int, default=2, help="decode timings per config; 0 skips speed"
    )
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--variant-cap",
        default="64MB",
        help="memory cap of the generate(quality=) variants measured at int4-g64's bytes",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "precision.json")
    args = parser.parse_args()
    if args.quick:
        args.heldout_tokens, args.repeats, args.decode_tokens = 1024, 1, 16
    torch.set_num_threads(args.threads)
    # Prefix caching off: every configuration must compute its own KV, not reuse fp32's.
    llm = LLM(None, dtype="float32", enable_prefix_caching=False, kv_cache_bytes=256 << 20)
    tok = llm.tokenizer
    if args.profile is not None:
        profile = json.loads(args.profile.read_text())
    else:
        calibration = corpus_tokens(tok, "calibration", args.profile_tokens)
        profile = profile_sensitivity(llm.model, calibration, PROFILE_FORMATS)
    heldout = corpus_tokens(tok, "heldout", args.heldout_tokens)
    kl_ids = heldout[:KL_TOKENS]
    prompt_ids = tok.encode(PROMPT)
    with SingleSequenceRunner(llm.model, kl_ids) as runner:
        dense = runner.log_probs()

    names = quantizable_modules(llm.model)
    configs = [Config("fp32", "uniform", {})]
    configs += [
        Config(fmt, "uniform", {n: fmt for n in names})
        for fmt in UNIFORM_RTN
        if fmt in profile["formats"]
    ]
    hessians = None
    if not args.quick:
        from zcode.quant.activations import collect_hessians

        hessians = collect_hessians(llm, corpus_tokens(tok, "calibration", 2048), names)
        configs += [
            Config(
                f"{fmt} gptq", "uniform", {n: fmt for n in names}, method="gptq", hessians=hessians
            )
            for fmt in UNIFORM_INT4
            if fmt in profile["formats"]
        ]
    matched = matched_budgets(profile)
    labelled = [(f"plan@{fmt}", budget) for fmt, budget in matched.items()]
    for budget in spread_budgets(profile, 2 if args.quick else SPREAD_BUDGETS):
        labelled.append((f"plan {plan(profile, budget).bits_per_weight:.3f}b", budget))
    plans = {}
    for label, budget in labelled:
        chosen = plan(profile, budget)
        formats = module_formats(profile, chosen.formats)
        plans[label] = (budget, chosen)
        configs.append(Config(label, "planned", formats))
        if hessians is not None and label.startswith("plan@"):
            plans[f"{label} gptq"] = (budget, chosen)
            configs.append(
                Config(f"{label} gptq", "planned", formats, method="gptq", hessians=hessians)
            )
    num_weights = sum(e["num_weights"] for e in profile["modules"].values())
    unit_of_module = {m: u for u, e in profile["modules"].items() for m in e["members"]}

    results = []
    for config in configs:
        with config.applied(llm):
            ppl = perplexity(llm, heldout, WINDOW, STRIDE).perplexity
            kl = measured_kl(llm, kl_ids, dense)
            bpt = bytes_per_token(llm.model)
        unit_formats = {unit_of_module[n]: f for n, f in config.formats.items()}
        planned_bytes = sum(
            unit_bytes(profile["modules"][u], unit_formats.get(u, "fp32"))
            for u in profile["modules"]
        )
        row = {
            "label": config.label,
            "kind": config.kind,
            "method": config.options.get("method", "rtn"),
            "ppl": ppl,
            "measured_kl": kl,
            "bytes_per_token": bpt,
            "bits_per_weight": 8 * planned_bytes / num_weights,
            "predicted_kl": None,
            "decode_s": [],
        }
        if config.label in plans:
            budget, chosen = plans[config.label]
            counts = list(chosen.formats.values())
            row |= {
                "budget": budget,
                "predicted_kl": chosen.predicted_kl,
                "format_counts": {f: counts.count(f) for f in sorted(set(counts))},
            }
        elif config.formats and row["method"] == "rtn":
            row["predicted_kl"] = sum(
                profile["modules"][u]["formats"][f]["kl"] for u, f in unit_formats.items()
            )
        results.append(row)
        print(f"{config.label:>18}: ppl {ppl:.4f}  KL {kl:.5f}", flush=True)

    for _ in range(args.repeats):  # round-robin: every configuration once per repeat
        for config, row in zip(configs, results):
            with config.applied(llm):
                for module in (config.modules or {}).values():
                    module.kernel = "fast"
                decode_seconds(llm, prompt_ids, 4)  # warm-up
                row["decode_s"].append(decode_seconds(llm, prompt_ids, args.decode_tokens))

    dense_ppl = results[0]["ppl"]
    for row in results:
        row["ppl_delta"] = row["ppl"] - dense_ppl
        timed = row["decode_s"]  # empty with --repeats 0
        row["decode_tok_s_best"] = (args.decode_tokens - 1) / min(timed) if timed else None
        row["decode_tok_s_median"] = (
            (args.decode_tokens - 1) / statistics.median(timed) if timed else None
        )
        row["decode_tok_s"] = row["decode_tok_s_median"]
    planned = [r for r in results if r["kind"] == "planned" and r["method"] == "rtn"]
    rho_kl = spearmanr([r["predicted_kl"] for r in planned], [r["measured_kl"] for r in planned])
    rho_ppl = spearmanr([r["predicted_kl"] for r in planned], [r["ppl_delta"] for r in planned])

    print_rows(
        [
            "config",
            "bits/w",
            "MB/token",
            "ppl",
            "ppl delta",
            "pred KL",
            "meas KL",
            "tok/s best",
            "tok/s med",
        ],
        [
            (
                r["label"],
                f"{r['bits_per_weight']:.3f}",
                f"{r['bytes_per_token'] / 1e6:.1f}",
                f"{r['ppl']:.4f}",
                f"{r['ppl_delta']:+.4f}",
                "-" if r["predicted_kl"] is None else f"{r['predicted_kl']:.5f}",
                f"{r['measured_kl']:.5f}",
                *(
                    "-" if r[key] is None else f"{r[key]:.1f}"
                    for key in ("decode_tok_s_best", "decode_tok_s_median")
                ),
            )
            for r in results
        ],
    )
    print(
        f"Spearman (planned, n={len(planned)}): predicted vs measured KL "
        f"{rho_kl.statistic:.3f} (p {rho_kl.pvalue:.2g}); predicted KL vs ppl delta "
        f"{rho_ppl.statistic:.3f} (p {rho_ppl.pvalue:.2g})"
    )
    verdicts = matched_verdicts({r["label"]: r for r in results}, matched)
    print_rows(
        ["uniform int4", "bits/w", "RTN ppl", "GPTQ ppl", "plan RTN ppl", "plan GPTQ ppl", "plan"],
        [
            (
                fmt,
                f"{v['bits_per_weight']:.3f}",
                *(
                    "-" if v[key] is None else f"{v[key]:.4f}"
                    for key in ("uniform_rtn", "uniform_gptq", "plan_rtn", "plan_gptq")
                ),
                v["verdict"],
            )
            for fmt, v in verdicts.items()
        ],
    )
    variant_rows = quality_variant_rows(
        llm, profile, matched["int4-g64"], args.variant_cap, heldout, kl_ids, dense
    )
    print_rows(
        ["quality", "plan", "units", "variant MB", "pred KL", "meas KL", "ppl"],
        [
            (
                r["quality"],
                r["plan"],
                str(len(r["variant_units"])),
                f"{r['variant_memory_bytes'] / 1e6:.1f}",
                f"{r['predicted_kl']:.5f}",
                f"{r['measured_kl']:.5f}",
                f"{r['ppl']:.4f}",
            )
            for r in variant_rows
        ],
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "heldout_tokens": len(heldout),
                "profile_tokens": profile["num_tokens"],
                "profile_formats": profile["formats"],
                "threads": args.threads,
                "decode_tokens": args.decode_tokens,
                "repeats": args.repeats,
                "spearman_predicted_vs_measured_kl": rho_kl.statistic,
                "spearman_predicted_kl_vs_ppl_delta": rho_ppl.statistic,
                "matched_budgets": verdicts,
                "quality_variants": variant_rows,
                "rows": results,
            },
            indent=1,
        )
        + "\n"
    )
    png = args.out.with_suffix(".png")
    draw_pareto(results, png)
    print(f"wrote {args.out} and {png}")
    if math.isnan(rho_kl.statistic):
        print("note: Spearman undefined (constant predictions or measurements)")


if __name__ == "__main__":
    main()
