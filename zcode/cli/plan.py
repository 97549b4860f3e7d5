"""`zcode calibrate` (the one artifact plans are made from) and `zcode plan` (the plan chosen for a
request's hints, printed without generating); the hint options `zcode generate` shares."""

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from zcode.cli import options
from zcode.cli.options import (
    add_dtype_option,
    add_formats_option,
    add_model_argument,
    add_quality_options,
    add_sparsity_option,
    add_speculative_options,
    attach_precision,
    check_quality_options,
    profile_formats,
    sparsity_args,
    speculative_args,
)
from zcode.errors import ValidationError

QUALITY_PRESETS = ("max", "balanced", "fast")  # zcode.harness.planner.QUALITY_BUDGETS_PCT


def add_hint_options(parser: argparse.ArgumentParser) -> None:
    hints = parser.add_argument_group("planning hints (any combination)")
    hints.add_argument(
        "--max-latency-ms",
        type=float,
        metavar="MS",
        help="predicted decode ms per token (the hardware cost model: zcode hw --fit-cost)",
    )
    hints.add_argument(
        "--max-quality-loss",
        type=float,
        metavar="PCT",
        help="predicted perplexity increase, in %% (from the --sparsity artifact)",
    )
    hints.add_argument(
        "--quality",
        choices=QUALITY_PRESETS,
        help="a quality-loss budget preset: max 0.5%%, balanced 2%%, fast 10%%",
    )
    hints.add_argument("--max-kv-bytes", type=int, metavar="N", help="KV cache bytes per token")
    hints.add_argument(
        "--experts-per-token",
        type=int,
        metavar="K",
        help="a MoE model's routed experts per token: each token's first K of its router's "
        "top_k (the other dimensions still planned)",
    )


def hint_args(args: argparse.Namespace) -> dict:
    """The hints given, as LLM.generate / Hints take them."""
    names = ("max_latency_ms", "max_quality_loss", "quality", "max_kv_bytes", "experts_per_token")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def add_commands(commands) -> None:
    calibrate = commands.add_parser(
        "calibrate",
        help="calibrate the planner: FFN levels, layer and KV-head importance, the router, "
        "precision sensitivity",
        description="Run MODEL over calibration text (Python standard-library sources) and write "
        "the calibration artifact that generate/plan/ppl/serve load with --sparsity: per-layer "
        "FFN activation thresholds (TEAL), each candidate FFN level's perplexity (on fp32 and "
        "int8 rows) on a separate calibration slice, layer and KV-head importance, and the "
        "routing predictor that plans skipped layers per prompt, and each other linear's "
        "sensitivity to each weight format (what --budget builds precision levels from). "
        "Latency is the hardware cost model's (zcode hw --fit-cost).",
    )
    add_model_argument(calibrate)
    calibrate.add_argument(
        "--out",
        metavar="PATH",
        help="where to write the artifact (default: the user cache directory, "
        "$ZCODE_CACHE_DIR or ~/.cache/zcode)",
    )
    calibrate.add_argument(
        "--tokens",
        type=int,
        default=4096,
        metavar="N",
        help="calibration tokens whose activations set the thresholds (default: %(default)s)",
    )
    calibrate.add_argument(
        "--eval-tokens",
        type=int,
        default=1024,
        metavar="N",
        help="tokens of the separate slice each candidate (FFN level, KV-head set, expert "
        "count) is scored on, one pass over it per candidate: more give steadier quality "
        "predictions; a byte-level tokenizer's 1024 are ~1 KB of text (default: %(default)s)",
    )
    calibrate.add_argument(
        "--router-tokens",
        type=int,
        metavar="N",
        help="calibration tokens the routing predictor is fitted on, in windows of 128 (each "
        "costs a pass per candidate depth; default: ~500 windows, which it needs to beat static "
        "depths on SmolLM2)",
    )
    add_formats_option(calibrate)
    calibrate.set_defaults(run=_calibrate)

    plan = commands.add_parser(
        "plan",
        help="print the plan chosen for planning hints, without generating",
        description="Print the execution plan the planner chooses for these hints: its "
        "predicted decode ms per token, predicted quality loss, KV bytes per token and the "
        "binding constraint, from the --sparsity artifact (with --budget, its precision levels "
        "too) and this machine's fitted cost model (with --speculative, the drafts' predicted "
        "gain in the ms per token).",
    )
    add_model_argument(plan)
    add_dtype_option(plan)
    add_sparsity_option(plan)
    add_quality_options(plan)
    add_hint_options(plan)
    add_speculative_options(plan)
    plan.add_argument(
        "--per-request-depth",
        action="store_true",
        help="plan skipped KV heads too (an engine that keeps KV per head)",
    )
    plan.add_argument("--batch-size", type=int, default=1, metavar="N", help="(default: 1)")
    plan.add_argument(
        "--context-len", type=int, default=512, metavar="N", help="(default: %(default)s)"
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(run=_plan)


def _calibrate(args: argparse.Namespace) -> None:
    from zcode.sparsity.artifact import default_path
    from zcode.sparsity.calibrate import ROUTER_WINDOW, calibrate

    if args.tokens < 512:
        raise ValidationError(f"--tokens must be at least 512, got {args.tokens}")
    if args.eval_tokens < 512:
        raise ValidationError(f"--eval-tokens must be at least 512, got {args.eval_tokens}")
    if args.router_tokens is not None and args.router_tokens < 2 * ROUTER_WINDOW:
        raise ValidationError(
            f"--router-tokens must be at least {2 * ROUTER_WINDOW}, got {args.router_tokens}"
        )
    formats = profile_formats(args)
    # per_request_depth: the router is fitted on requests skipping layers as data
    llm = options.load_llm(
        args.model, "float32", enable_prefix_caching=False, per_request_depth=True
    )
    if llm.tokenizer is None:
        raise ValidationError("calibration reads text: this checkpoint has no tokenizer")
    try:
        router = {} if args.router_tokens is None else {"router_tokens": args.router_tokens}
        artifact = calibrate(
            llm,
            num_tokens=args.tokens,
            num_eval_tokens=args.eval_tokens,
            formats=formats,
            **router,
        )
    except ValueError as e:
        raise ValidationError(str(e)) from e
    out = Path(args.out) if args.out else default_path(llm.model)
    artifact.save(out)
    for level in artifact.levels:
        print(
            f"ffn in {level.sparsity_in:.2f} mid {level.sparsity_mid:.2f}  "
            f"flops skipped {level.flops_skipped:.1%}  calibration ppl x{level.ppl_ratio:.4f}"
            + "".join(f", {w} rows x{r:.4f}" for w, r in level.weight_ppl_ratios.items())
        )
    if artifact.router is not None:
        depths = ", ".join(str(len(d)) for d in artifact.router["depths"])
        print(f"router: skipped-layer sets of {depths} layers")
    profile = artifact.sensitivity
    print(
        f"sensitivity: {len(profile['modules'])} units outside the FFNs x "
        f"{', '.join(profile['formats'])} (zcode generate --budget)"
    )
    print(f"wrote {out}")


def _plan(args: argparse.Namespace) -> None:
    check_quality_options(args)
    llm = options.load_llm(
        args.model,
        args.dtype,
        **({"per_request_depth": True} if args.per_request_depth else {}),
        **sparsity_args(args),
        **speculative_args(args),
    )
    attach_precision(llm, args)
    _print_plan(args, llm)


def _print_plan(args: argparse.Namespace, llm) -> None:
    """Prints the choice for `args`' hints on a loaded `llm`."""
    from zcode.harness.planner import Hints

    if args.batch_size < 1 or args.context_len < 1:
        raise ValidationError("--batch-size and --context-len must be positive")
    choice = llm.planner().choose(Hints(**hint_args(args)), args.batch_size, args.context_len)
    row = {
        "plan": choice.plan.name,
        "signature": choice.plan.signature(),
        "predicted_ms_per_token": choice.predicted_ms_per_token,
        "predicted_quality_loss_pct": choice.predicted_quality_loss_pct,
        "kv_bytes_per_token": choice.kv_bytes_per_token,
        "binding": choice.binding,
        "target_met": choice.target_met,
    }
    if choice.speculation is not None:  # --speculative, with the adaptive draft policy
        row |= {f"speculation_{k}": v for k, v in asdict(choice.speculation).items()}
    if args.json:
        json.dump(row, sys.stdout)
        sys.stdout.write("\n")
        return
    for key, value in row.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        print(f"{key:28} {'unknown' if value is None else value}")
