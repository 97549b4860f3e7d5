"""`zcode quantize` (a quantized checkpoint) and `zcode profile` (per-module sensitivity)."""

import argparse
import json
import time
from pathlib import Path

from zcode.cli import options
from zcode.cli.options import (
    add_dtype_option,
    add_formats_option,
    add_model_argument,
    apply_plan,
    profile_formats,
    read_plan,
    read_text,
)
from zcode.errors import ValidationError


def add_commands(commands) -> None:
    quantize = commands.add_parser(
        "quantize",
        help="write a quantized checkpoint that zcode loads directly",
        description="Quantize MODEL's linear layers (one format everywhere, a precision plan, or "
        "the planner's plan for a bits budget) and write OUT: safetensors with the packed "
        "weights and the plan as metadata, quantization.json, config.json and the tokenizer. "
        "GPTQ calibrates on Python standard-library source text (zcode.calibration).",
    )
    add_model_argument(quantize)
    quantize.add_argument("--out", required=True, metavar="DIR", help="directory to write")
    precision = quantize.add_mutually_exclusive_group(required=True)
    precision.add_argument(
        "--format", metavar="FMT", help="one format for every quantizable linear, e.g. int4-g32"
    )
    precision.add_argument("--plan", metavar="PLAN.json", help="module -> format map")
    precision.add_argument(
        "--budget",
        metavar="BUDGET",
        help="the precision planner's plan for this budget (needs --profile): average bits per "
        "weight (4.5bits), bytes of weights (60MB) or a decode-step latency (12ms)",
    )
    quantize.add_argument(
        "--profile",
        metavar="PROFILE.json",
        help="the sensitivity profile --budget plans from (written by 'zcode profile')",
    )
    quantize.add_argument(
        "--method",
        choices=["rtn", "gptq"],
        default="rtn",
        help="round-to-nearest, or GPTQ's error-compensating update (default: %(default)s)",
    )
    quantize.add_argument(
        "--hadamard",
        action="store_true",
        help="rotate each quantized linear's inputs by a block Hadamard matrix",
    )
    quantize.add_argument(
        "--calibration-tokens",
        type=int,
        default=2048,
        metavar="N",
        help="calibration tokens for GPTQ, run in windows of 512 (default: %(default)s)",
    )
    quantize.set_defaults(run=_quantize)

    profile = commands.add_parser(
        "profile",
        help="sensitivity of each linear module to each weight format",
        description="Quantize each quantizable linear of MODEL alone (round-to-nearest; a MoE "
        "layer's experts together, per projection) in each format and measure the mean KL "
        "divergence of the next-token distributions from the unquantized model's, and the "
        "perplexity delta, on calibration text (Python standard-library sources). Writes OUT "
        "(JSON: module -> format -> kl, ppl_delta, bytes) and a heatmap next to it (.png). The "
        "report is what 'zcode quantize --budget' plans from.",
    )
    add_model_argument(profile)
    profile.add_argument("--out", required=True, metavar="OUT.json", help="report to write")
    profile.add_argument(
        "--tokens",
        type=int,
        default=512,
        metavar="N",
        help="calibration tokens, one sequence (default: %(default)s)",
    )
    add_formats_option(profile)
    add_dtype_option(profile, default="float32")
    profile.set_defaults(run=_profile)


def _quantize(args: argparse.Namespace) -> None:
    from zcode.calibration import corpus_tokens
    from zcode.quant import quantizable_modules
    from zcode.quant.activations import collect_hessians
    from zcode.quant.artifact import save_artifact

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValidationError(f"--out {out}: exists and is not an empty directory")
    if args.calibration_tokens < 2:
        raise ValidationError(
            f"--calibration-tokens must be at least 2, got {args.calibration_tokens}"
        )
    if args.profile and not args.budget:
        raise ValidationError("--profile is what --budget plans from: add --budget")
    plan = read_plan(args.plan) if args.plan else None
    if args.budget:
        plan = _plan_for_budget(args.budget, args.profile)
    llm = options.load_llm(args.model, "float32")
    if args.format:
        plan = {name: args.format for name in quantizable_modules(llm.model)}
    hessians = None
    if args.method == "gptq":
        if llm.tokenizer is None:
            raise ValidationError("GPTQ calibrates on text: this checkpoint has no tokenizer")
        tokens = corpus_tokens(llm.tokenizer, "calibration", args.calibration_tokens)
        hessians = collect_hessians(llm, tokens, [n for n, f in plan.items() if f != "fp32"])
    apply_plan(llm, plan, method=args.method, hessians=hessians, hadamard=args.hadamard)
    save_artifact(llm.model, llm.tokenizer, out, args.method, args.hadamard)
    formats = sorted(set(plan.values()))
    print(
        f"wrote {out}: {len(plan)} modules ({', '.join(formats)}), method {args.method}"
        + (", hadamard" if args.hadamard else "")
    )


def _plan_for_budget(budget: str, profile_path: str | None) -> dict[str, str]:
    from zcode.quant.planner import plan_for_budget

    if profile_path is None:
        raise ValidationError(
            "--budget plans from a sensitivity profile: pass --profile PROFILE.json "
            "(written by 'zcode profile MODEL')"
        )
    text = read_text(profile_path)
    try:
        profile = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValidationError(f"{profile_path}: not JSON: {e}") from e
    if not isinstance(profile, dict) or not isinstance(profile.get("modules"), dict):
        raise ValidationError(f"{profile_path}: not a sensitivity profile (no 'modules')")
    return plan_for_budget(profile, budget)  # PlanError, a ValidationError, for a bad budget


def _profile(args: argparse.Namespace) -> None:
    from zcode.calibration import corpus_tokens
    from zcode.quant.report import draw_heatmap
    from zcode.quant.sensitivity import profile_sensitivity

    formats = profile_formats(args)
    if args.tokens < 2:
        raise ValidationError(f"--tokens must be at least 2, got {args.tokens}")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise ValidationError(f"--out {out}: directory {out.parent} does not exist")
    llm = options.load_llm(args.model, args.dtype)
    if llm.tokenizer is None:
        raise ValidationError("profiling calibrates on text: this checkpoint has no tokenizer")
    tokens = corpus_tokens(llm.tokenizer, "calibration", args.tokens)
    start = time.perf_counter()
    report = profile_sensitivity(llm.model, tokens, formats)
    seconds = time.perf_counter() - start
    out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    draw_heatmap(report, out.with_suffix(".png"))
    print(
        f"wrote {out} and {out.with_suffix('.png')}: {len(report['modules'])} modules x "
        f"{len(formats)} formats on {len(tokens)} tokens in {seconds:.0f} s"
    )
