"""`zcode info` (a model from its config), `zcode hw` (this machine) and `zcode ppl`."""

import argparse
import dataclasses
import json
import time

from zcode.cli import options
from zcode.cli.options import (
    add_dtype_option,
    add_kv_cache_dtype_option,
    add_model_argument,
    add_skip_options,
    add_sparsity_option,
    apply_plan,
    fraction,
    kv_cache_dtype_args,
    positive_float,
    positive_int,
    read_plan,
    read_text,
    skip_args,
    sparsity_args,
)
from zcode.configs import DEFAULT_CONTEXT_LEN, DEFAULT_DISK_GBPS, shipped_configs
from zcode.errors import ValidationError


def add_commands(commands) -> None:
    info = commands.add_parser(
        "info",
        help="architecture, parameters, KV cache and memory per precision, without loading weights",
        description="Describe a model from its config alone (a directory holding only config.json "
        "is enough): architecture, size, parameter count (and active parameters per token for "
        "MoE), KV-cache bytes per token, and the memory its weights need at fp32, bf16, int8 and "
        "int4 plus the KV cache of one max-length sequence, against this machine's RAM. Then the "
        "fit plan: per llama.cpp file type (bf16, Q8_0, Q4_K_M, Q4_0) the file's size, whether "
        "it fits this machine's RAM whole or with the routed experts left on disk (expert "
        "offload: the disk read per token at a hit rate), and the batch-1 decode tok/s this "
        "machine's cost model predicts (the hardware probe runs once if none is cached).",
    )
    add_model_argument(
        info,
        f"HF model directory, its config.json, a .gguf file, or {', '.join(shipped_configs())}",
    )
    info.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    info.add_argument(
        "--context",
        type=positive_int,
        default=DEFAULT_CONTEXT_LEN,
        help=f"tokens of KV cache the fit plan reserves (default {DEFAULT_CONTEXT_LEN})",
    )
    info.add_argument(
        "--hit-rate",
        type=fraction,
        help="expert cache hit rate under offload (default: the cached share of the experts)",
    )
    info.add_argument(
        "--disk-gbps",
        type=positive_float,
        default=DEFAULT_DISK_GBPS,
        help=f"disk read bandwidth for offloaded experts, GB/s (default {DEFAULT_DISK_GBPS})",
    )
    info.set_defaults(run=_info)

    hw = commands.add_parser(
        "hw",
        help="this machine: cores, caches, ISA flags, measured bandwidth and matmul peaks",
        description="Probe the hardware: CPU model, cores, caches, ISA flags (AVX2, AVX-512, "
        "VNNI, AMX, BF16), torch's CPU capability, measured memory bandwidth and matmul "
        "throughput per dtype, and CUDA devices when present. Measurements take a few seconds "
        "and are cached per machine in the user cache directory.",
    )
    hw.add_argument("--refresh", action="store_true", help="measure again instead of the cache")
    hw.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    hw.add_argument(
        "--fit-cost",
        action="store_true",
        help="fit the cost model if this machine has none cached (minutes); with "
        "--refresh, fit it again",
    )
    hw.add_argument(
        "--compiled",
        action="store_true",
        help="with --fit-cost: also fit the cost of compiled decode steps (compile=True "
        "engines; minutes more), if the cached fit has none",
    )
    hw.set_defaults(run=_hw)

    ppl = commands.add_parser(
        "ppl",
        help="perplexity of a text file",
        description="Score the tokens of FILE with a sliding window (each token once, with up to "
        "WINDOW - STRIDE tokens of context) and print the perplexity, the number of tokens scored "
        "and the seconds spent scoring (model loading excluded).",
    )
    add_model_argument(ppl)
    ppl.add_argument("file", metavar="FILE", help="UTF-8 text file to score")
    ppl.add_argument(
        "--window",
        type=int,
        default=512,
        help="tokens per forward pass (default: %(default)s)",
    )
    ppl.add_argument(
        "--stride",
        type=int,
        default=256,
        help="tokens the window advances by; at most WINDOW (default: %(default)s)",
    )
    ppl.add_argument(
        "--max-tokens",
        type=int,
        metavar="N",
        help="score only the first N tokens of the file (default: all)",
    )
    ppl.add_argument(
        "--plan",
        metavar="PLAN.json",
        help="quantize the model's linears by this precision plan ({module: format}, or an "
        "object whose 'plan' is one) with round-to-nearest before scoring",
    )
    add_dtype_option(ppl)
    add_kv_cache_dtype_option(ppl)
    add_sparsity_option(ppl)
    add_skip_options(ppl)
    ppl.set_defaults(run=_ppl)


def _info(args: argparse.Namespace) -> None:
    from zcode.hardware import probe
    from zcode.hardware.cost_model import CostModel
    from zcode.info import FitOptions, format_info, model_info

    hardware = probe()
    fit = FitOptions(
        context_len=args.context,
        hit_rate=args.hit_rate,
        disk_gbps=args.disk_gbps,
        cost=CostModel.cached(hardware),
        read_bandwidth_gbps=hardware.read_bandwidth_gbps,
    )
    info = model_info(args.model, fit)
    print(json.dumps(info.to_dict(), indent=2) if args.json else format_info(info))


def _hw(args: argparse.Namespace) -> None:
    from zcode.hardware import format_report, probe
    from zcode.hardware.cost_model import CostModel, format_cost

    if args.compiled and not args.fit_cost:
        raise ValidationError("--compiled fits compiled steps: pass it with --fit-cost")
    info = probe(refresh=args.refresh)
    # The fit is cached under the machine and kernels version (cost_key), not the bare fingerprint.
    if args.fit_cost:
        cost = CostModel.load_or_fit(info, refresh=args.refresh, compiled=args.compiled)
    else:
        cost = CostModel.cached(info)
    if args.json:
        report = dataclasses.asdict(info) | {"cost_model": cost and dataclasses.asdict(cost)}
        print(json.dumps(report, indent=2))
    else:
        print(format_report(info) + "\n" + format_cost(cost))


def _ppl(args: argparse.Namespace) -> None:
    if args.window < 2:
        raise ValidationError(f"--window must be at least 2, got {args.window}")
    if not 0 < args.stride <= args.window:
        raise ValidationError(
            f"--stride must be between 1 and --window ({args.window}), got {args.stride}"
        )
    if args.max_tokens is not None and args.max_tokens < 2:
        raise ValidationError(f"--max-tokens must be at least 2, got {args.max_tokens}")
    text = read_text(args.file)
    plan = read_plan(args.plan) if args.plan else None
    skips = skip_args(args)
    llm = options.load_llm(
        args.model,
        args.dtype,
        float_weights=plan is not None,
        **kv_cache_dtype_args(args),
        **({"per_request_depth": True} if skips else {}),
        **sparsity_args(args),
    )
    if plan is not None:
        apply_plan(llm, plan)
    token_ids = llm.encode(text)[: args.max_tokens]
    if len(token_ids) < 2:
        raise ValidationError(
            f"{args.file}: perplexity needs at least 2 tokens, got {len(token_ids)}"
        )
    from zcode.ppl import perplexity

    start = time.perf_counter()
    result = perplexity(llm, token_ids, args.window, args.stride, **skips)
    seconds = time.perf_counter() - start
    print(f"perplexity  {result.perplexity:.4f}")
    print(f"tokens      {result.num_tokens} scored of {len(token_ids)}")
    print(f"seconds     {seconds:.2f}")
