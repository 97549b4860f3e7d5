"""`zcode plan`: the plan the planner chooses for a request's hints, printed without generating;
and the planning hint options `zcode generate` shares with it. Torch-free at import."""

import argparse
import json
import sys

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
        help="predicted perplexity increase, in %% (from --sparsity and --profile data)",
    )
    hints.add_argument(
        "--quality",
        choices=QUALITY_PRESETS,
        help="a quality-loss budget preset: max 0.5%%, balanced 2%%, fast 10%%",
    )
    hints.add_argument("--max-kv-bytes", type=int, metavar="N", help="KV cache bytes per token")


def hint_args(args: argparse.Namespace) -> dict:
    """The hints given, as LLM.generate / Hints take them."""
    names = ("max_latency_ms", "max_quality_loss", "quality", "max_kv_bytes")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def add_plan_command(commands, add_common) -> None:
    """`add_common(parser)`: cli.py's model, dtype, sparsity and precision-variant options."""
    plan = commands.add_parser(
        "plan",
        help="print the plan chosen for planning hints, without generating",
        description="Print the execution plan the planner chooses for these hints: its "
        "predicted decode ms per token, predicted quality loss, KV bytes per token and the "
        "binding constraint, from the --sparsity artifact, --profile precision variants and "
        "this machine's fitted cost model.",
    )
    add_common(plan)
    add_hint_options(plan)
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


def run_plan(args: argparse.Namespace, llm) -> None:
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
    if args.json:
        json.dump(row, sys.stdout)
        sys.stdout.write("\n")
        return
    for key, value in row.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        print(f"{key:28} {'unknown' if value is None else value}")
