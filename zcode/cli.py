"""The `zcode` command line: generate, chat, info, ppl and quantize over the `LLM` API, and serve.

User mistakes (a bad flag value, a missing file, a checkpoint we cannot read) end with one line
`zcode: error: ...` on stderr and exit status 2; Ctrl-C exits 130 without a traceback.
"""

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

# Only light modules at the top: `zcode --help` and a Ctrl-C during start-up must not wait on
# torch; each command imports the engine when it runs.
from zcode.cli_plan import add_hint_options, add_plan_command, hint_args
from zcode.config import SPECULATIVE_METHODS
from zcode.configs import DEFAULT_CONTEXT_LEN, DEFAULT_DISK_GBPS, shipped_configs
from zcode.distributed.config import ParallelConfig
from zcode.errors import CheckpointError, RankFailure, ValidationError

if TYPE_CHECKING:
    from zcode.llm import LLM
    from zcode.sampling_params import SamplingParams

DEFAULT_MODEL_HELP = "default: the embedded SmolLM2-135M-Instruct"
SAMPLING_HELP = (
    "Sampling defaults follow llama.cpp's llama-cli (temperature 0.8, top-k 40, top-p 0.95, "
    "min-p 0.05, no repetition penalty); --temperature 0 is greedy, as in vLLM."
)


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, like every other user mistake."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"zcode: error: {message} (see '{self.prog} --help')\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("zcode")
    except PackageNotFoundError:  # run from a source tree that was not installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="zcode",
        description="ZCode: run, inspect and measure GLM-family and Llama-style models on CPU.",
    )
    parser.add_argument("--version", action="version", version=f"zcode {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate = commands.add_parser(
        "generate",
        help="generate a continuation of a prompt",
        description=f"Print the model's continuation of PROMPT. {SAMPLING_HELP}",
    )
    generate.add_argument(
        "prompt", metavar="PROMPT", help="the prompt text; '-' reads it from stdin"
    )
    _add_model_option(generate)
    _add_sampling_options(generate, max_tokens=256)
    generate.add_argument(
        "--chat",
        action="store_true",
        help="send PROMPT as a user message through the model's chat template "
        "(default: PROMPT is raw text to continue)",
    )
    _add_thinking_option(generate)
    _add_dtype_option(generate)
    _add_expert_cache_option(generate)
    _add_sparsity_option(generate)
    _add_speculative_options(generate)
    generate.add_argument(
        "--stream", action="store_true", help="print the text token by token as it is generated"
    )
    generate.add_argument(
        "--compile",
        action="store_true",
        help="compile the decode step (torch.compile): faster tokens after a compile of tens "
        "of seconds at the first one, so it pays off for long generations only",
    )
    _add_quality_options(generate)
    add_hint_options(generate)
    _add_skip_options(generate)
    _add_parallel_options(generate, "generate")
    generate.set_defaults(run=_generate)

    chat = commands.add_parser(
        "chat",
        help="interactive chat that keeps the conversation",
        description="Chat with the model: each stdin line is a user turn and the reply streams "
        "as it is generated. '/reset' clears the conversation, '/exit' or end of input quits. "
        f"Works with a pipe on stdin. {SAMPLING_HELP}",
    )
    _add_model_option(chat)
    chat.add_argument("--system", metavar="TEXT", help="a system message opening the conversation")
    _add_sampling_options(chat, max_tokens=1024)
    _add_thinking_option(chat)
    _add_dtype_option(chat)
    _add_expert_cache_option(chat)
    chat.set_defaults(run=_chat)

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
    _add_model_argument(
        info,
        f"HF model directory, its config.json, a .gguf file, or {', '.join(shipped_configs())}",
    )
    info.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    info.add_argument(
        "--context",
        type=_positive_int,
        default=DEFAULT_CONTEXT_LEN,
        help=f"tokens of KV cache the fit plan reserves (default {DEFAULT_CONTEXT_LEN})",
    )
    info.add_argument(
        "--hit-rate",
        type=_fraction,
        help="expert cache hit rate under offload (default: the cached share of the experts)",
    )
    info.add_argument(
        "--disk-gbps",
        type=_positive_float,
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
        help="fit the cost model if this machine has none cached (about a minute)",
    )
    hw.set_defaults(run=_hw)

    ppl = commands.add_parser(
        "ppl",
        help="perplexity of a text file",
        description="Score the tokens of FILE with a sliding window (each token once, with up to "
        "WINDOW - STRIDE tokens of context) and print the perplexity, the number of tokens scored "
        "and the seconds spent scoring (model loading excluded).",
    )
    _add_model_argument(ppl)
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
    _add_dtype_option(ppl)
    _add_sparsity_option(ppl)
    _add_skip_options(ppl)
    ppl.set_defaults(run=_ppl)

    quantize = commands.add_parser(
        "quantize",
        help="write a quantized checkpoint that zcode loads directly",
        description="Quantize MODEL's linear layers (one format everywhere, a precision plan, or "
        "the planner's plan for a bits budget) and write OUT: safetensors with the packed "
        "weights and the plan as metadata, quantization.json, config.json and the tokenizer. "
        "GPTQ calibrates on Python standard-library source text (zcode.calibration).",
    )
    _add_model_argument(quantize)
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
    _add_model_argument(profile)
    profile.add_argument("--out", required=True, metavar="OUT.json", help="report to write")
    profile.add_argument(
        "--tokens",
        type=int,
        default=512,
        metavar="N",
        help="calibration tokens, one sequence (default: %(default)s)",
    )
    profile.add_argument(
        "--formats",
        default="int8,int4-g32,int4-g128,w8a8,w4a8",
        metavar="F1,F2",
        help="weight formats to measure (default: %(default)s)",
    )
    _add_dtype_option(profile, default="float32")
    profile.set_defaults(run=_profile)

    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server",
        description="Serve MODEL over HTTP with OpenAI's API (/v1/completions, "
        "/v1/chat/completions, /v1/models) plus /tokenize, /detokenize, /tokenizer_info, "
        "/health, /version and Prometheus /metrics. SIGTERM stops admission (new requests get "
        "503), lets in-flight requests finish for up to --shutdown-timeout seconds, aborts the "
        "rest and exits 0. Under torchrun with --tensor-parallel-size N, rank 0 serves and the "
        "other ranks follow its forward passes; a rank that dies or hangs fails the requests "
        "and the server exits 1.",
    )
    _add_model_argument(serve)
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; 0.0.0.0 exposes the server to the network "
        "(default: %(default)s)",
    )
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    serve.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health, /metrics and "
        "/version (default: none)",
    )
    serve.add_argument(
        "--protect-metrics",
        action="store_true",
        help="with --api-key, require the key on /metrics and /version too",
    )
    serve.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template file used instead of the checkpoint's",
    )
    serve.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model name clients send and /v1/models lists (default: MODEL as given, or "
        "SmolLM2-135M-Instruct)",
    )
    serve.add_argument(
        "--max-model-len",
        type=int,
        metavar="N",
        help="context length: prompt plus generated tokens (default: the model's)",
    )
    serve.add_argument(
        "--max-num-seqs",
        type=int,
        default=64,
        metavar="N",
        help="most requests decoded together; the rest wait (default: %(default)s)",
    )
    serve.add_argument(
        "--kv-cache-mib",
        type=int,
        default=1024,
        metavar="MIB",
        help="memory for the KV cache, which bounds the tokens held by all requests at once "
        "(default: %(default)s)",
    )
    serve.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="do not reuse the KV cache of prompt prefixes shared between requests",
    )
    serve.add_argument(
        "--per-request-depth",
        action="store_true",
        help="keep the KV cache as pages per layer and KV head, so a request's skip_layers and "
        "skip_kv_heads fields skip those and hold no KV for them",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        default=1 << 20,
        metavar="N",
        help="larger request bodies get 413 (default: %(default)s)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="after SIGTERM, how long in-flight requests may run before they are aborted "
        "(default: %(default)s)",
    )
    _add_dtype_option(serve)
    _add_expert_cache_option(serve)
    _add_sparsity_option(serve)
    _add_speculative_options(serve)
    _add_parallel_options(serve, "serve")
    serve.set_defaults(run=_serve)

    calibrate = commands.add_parser(
        "calibrate",
        help="calibrate dynamic sparsity: FFN thresholds, layer and head importance, latency",
        description="Run MODEL over calibration text (Python standard-library sources) and write "
        "a sparsity artifact that generate/ppl/serve load with --sparsity: per-layer FFN "
        "activation thresholds (TEAL), each candidate level's perplexity on a separate "
        "calibration slice, layer and KV-head importance, and a decode latency fit.",
    )
    _add_model_argument(calibrate)
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
    calibrate.set_defaults(run=_calibrate)

    add_plan_command(commands, _add_plan_model_options)
    return parser


def _add_plan_model_options(parser: argparse.ArgumentParser) -> None:
    _add_model_argument(parser)
    _add_dtype_option(parser)
    _add_sparsity_option(parser)
    _add_quality_options(parser)
    parser.set_defaults(run=_plan)


def _plan(args: argparse.Namespace) -> None:
    from zcode.cli_plan import run_plan

    profile = _quality_profile(args)
    llm = load_llm(
        args.model,
        args.dtype,
        float_weights=profile is not None,
        **({"per_request_depth": True} if args.per_request_depth else {}),
        **_sparsity_args(args),
    )
    if profile is not None:
        from zcode.quant.variants import attach_variants

        attach_variants(llm, profile, args.budget, args.variant_cap)
    run_plan(args, llm)


def _add_model_argument(
    parser: argparse.ArgumentParser, what: str = "HF model directory or .gguf file"
) -> None:
    parser.add_argument("model", metavar="MODEL", nargs="?", help=f"{what} ({DEFAULT_MODEL_HELP})")


def _add_model_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", metavar="PATH", help=f"HF model directory or .gguf file ({DEFAULT_MODEL_HELP})"
    )


def _add_sampling_options(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=max_tokens,
        metavar="N",
        help="most tokens to generate per reply (default: %(default)s)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        metavar="T",
        help="sampling temperature; 0 is greedy (default: %(default)s)",
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=40,
        metavar="K",
        help="sample among the K most likely tokens; 0 disables (default: %(default)s)",
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=0.95,
        metavar="P",
        help="sample among the most likely tokens whose probabilities sum to P; 1 disables "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--min-p",
        type=float,
        default=0.05,
        metavar="P",
        help="drop tokens less likely than P times the most likely one; 0 disables "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        metavar="R",
        help="penalise tokens already in the prompt or the output: R > 1 discourages "
        "repeats, 1 disables (default: %(default)s)",
    )
    parser.add_argument(
        "--seed", type=int, help="random seed, for reproducible sampling (default: random)"
    )
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="STR",
        help="stop before this string; repeat the option for several",
    )


def _add_thinking_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--thinking",
        action=argparse.BooleanOptionalAction,
        help="turn the chat template's reasoning mode on or off, for templates that have one "
        "(default: the template's own default)",
    )


def _add_dtype_option(parser: argparse.ArgumentParser, default: str = "auto") -> None:
    choices = ["auto", "float32", "bfloat16"] if default == "auto" else ["float32", "bfloat16"]
    parser.add_argument(
        "--dtype",
        choices=choices,
        default=default,
        help="dtype the weights are computed in; auto runs them as the file stores them (a GGUF "
        "file's quantized blocks, memory-mapped), float32 where --sparsity or --profile rewrites "
        "them (default: %(default)s)",
    )


def _add_expert_cache_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--expert-cache-gb",
        metavar="SIZE",
        help="MoE models loaded with --dtype auto: keep at most SIZE of routed experts in RAM, "
        "in GB (e.g. 12) or as a percentage of the experts' bytes (e.g. 25%%); the rest stay "
        "memory-mapped and are read from disk when routed to (default: no limit)",
    )
    parser.add_argument(
        "--no-expert-prefetch",
        dest="expert_prefetch",
        action="store_false",
        help="with --expert-cache-gb: do not read the next MoE layer's predicted experts ahead",
    )


def _expert_cache_args(args: argparse.Namespace) -> dict:
    size = args.expert_cache_gb
    if size is None:
        return {}
    prefetch = {} if args.expert_prefetch else {"expert_cache_prefetch": False}
    try:
        if size.endswith("%"):
            fraction = float(size[:-1]) / 100
            if 0 <= fraction <= 1:
                return {"expert_cache_fraction": fraction, **prefetch}
        elif 0 <= float(size) < math.inf:
            return {"expert_cache_gb": float(size), **prefetch}
    except ValueError:
        pass
    raise ValidationError(
        f"--expert-cache-gb takes GB >= 0 (e.g. 12) or a percentage up to 100%, got {size!r}"
    )


def _add_sparsity_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sparsity",
        metavar="ARTIFACT",
        help="run with dynamic FFN sparsity from a 'zcode calibrate' artifact: the level that "
        "skips the most FFN work within 1%% calibration perplexity (default: dense)",
    )


def _add_skip_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--skip-layers",
        metavar="I,J,...",
        help="decoder layers the requests skip, keeping no KV for them (per-request depth)",
    )
    parser.add_argument(
        "--skip-kv-heads",
        metavar="L:G,...",
        help="(layer:KV head) pairs the requests skip, keeping no KV for them",
    )


def _add_speculative_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative",
        choices=SPECULATIVE_METHODS,
        help="speculative decoding: drafts verified by the model in one forward, outputs "
        "unchanged; ngram: prompt lookup, skip_layers: the model without some layers drafts, "
        "mtp: the checkpoint's MTP layer (GLM-4.5+ / GLM-5 HF checkpoints)",
    )
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        metavar="K",
        help="with --speculative: tokens drafted per step (default: 3)",
    )
    parser.add_argument(
        "--draft-skip-layers",
        metavar="LAYERS",
        help='with --speculative skip_layers: the layers the draft skips, e.g. "3,5,7" '
        "(default: every other inner layer)",
    )


def _speculative_args(args: argparse.Namespace) -> dict:
    """The engine arguments of --speculative and its options (none if it is not given)."""
    if args.speculative is None:
        if args.num_draft_tokens is not None or args.draft_skip_layers is not None:
            raise ValidationError("--num-draft-tokens and --draft-skip-layers need --speculative")
        return {}
    engine_args = {"speculative": args.speculative}
    if args.num_draft_tokens is not None:
        if args.num_draft_tokens < 1:
            raise ValidationError(
                f"--num-draft-tokens must be at least 1, got {args.num_draft_tokens}"
            )
        engine_args["num_draft_tokens"] = args.num_draft_tokens
    if args.draft_skip_layers is not None:
        if args.speculative != "skip_layers":
            raise ValidationError("--draft-skip-layers needs --speculative skip_layers")
        try:
            engine_args["draft_skip_layers"] = tuple(
                int(i) for i in args.draft_skip_layers.split(",")
            )
        except ValueError:
            raise ValidationError(
                f'--draft-skip-layers takes layer numbers like "3,5,7", got '
                f"{args.draft_skip_layers!r}"
            ) from None
    return engine_args


def _sparsity_args(args: argparse.Namespace) -> dict:
    if not args.sparsity:
        return {}
    if not Path(args.sparsity).is_file():  # before the model loads
        raise ValidationError(f"{args.sparsity}: no such sparsity artifact (see zcode calibrate)")
    return {"sparsity": args.sparsity}


def _add_quality_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile",
        metavar="PROFILE",
        help="'zcode profile' JSON: quantize to the --budget plan and keep int8 and unquantized "
        "variants of the most sensitive modules under --variant-cap, the precision levels the "
        "planner chooses among",
    )
    parser.add_argument("--budget", help="the base plan's budget, e.g. 4.5bits (--profile)")
    parser.add_argument(
        "--variant-cap", default="64MB", help="memory for the variants (default: %(default)s)"
    )


def _quality_profile(args: argparse.Namespace) -> dict | None:
    """The profile the precision variants are built from, checked before the model loads."""
    if args.profile is None:
        return None
    if args.budget is None:
        raise ValidationError("--profile needs --budget (e.g. 4.5bits): the base plan's budget")
    if args.sparsity:
        raise ValidationError(
            "--profile cannot be combined with --sparsity yet: sparse FFNs read float weights"
        )
    if not Path(args.profile).is_file():
        raise ValidationError(f"{args.profile}: no such profile (see zcode profile)")
    try:
        return json.loads(Path(args.profile).read_text())
    except json.JSONDecodeError as e:
        raise ValidationError(f"{args.profile}: not a profile JSON ({e})") from e


def load_llm(model: str | None, dtype: str, float_weights: bool = False, **engine_args) -> "LLM":
    """The one place a command loads a model. `float_weights`: the command rewrites weights (a
    precision plan, quality variants), so "auto" loads them as float32."""
    if float_weights and dtype == "auto":
        dtype = "float32"
    from zcode.llm import LLM

    return LLM(model, dtype=dtype, **engine_args)


def _add_parallel_options(parser: argparse.ArgumentParser, command: str) -> None:
    default = ParallelConfig()
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=default.tensor_parallel_size,
        metavar="N",
        help="split the model over N processes started by torchrun: "
        f"torchrun --nproc-per-node N -m zcode {command} ... (default: %(default)s)",
    )
    parser.add_argument(
        "--collective-timeout-s",
        type=float,
        default=default.collective_timeout_s,
        metavar="SECONDS",
        help="with --tensor-parallel-size: how long a forward pass waits for the other "
        "processes before failing (a hung process); a dead one fails it at once "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--expert-parallel",
        action="store_true",
        help="MoE models: give each of the --tensor-parallel-size processes a range of whole "
        "experts instead of a slice of every expert (vLLM's --enable-expert-parallel)",
    )
    parser.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=default.pipeline_parallel_size,
        metavar="N",
        help="run the layers as N stages of consecutive layers, one per torchrun process, each "
        "holding only its layers' weights and KV cache (for slow links between processes; "
        "not with --tensor-parallel-size) (default: %(default)s)",
    )


def _parallel_args(args: argparse.Namespace) -> dict:
    parallel = ParallelConfig(
        tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel=args.expert_parallel,
        pipeline_parallel_size=args.pipeline_parallel_size,
        collective_timeout_s=args.collective_timeout_s,
    )
    return {"parallel": parallel} if parallel.is_distributed else {}


def _sampling_params(args: argparse.Namespace) -> "SamplingParams":
    from zcode.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
    )


def _generate(args: argparse.Namespace) -> None:
    params = _sampling_params(args)  # before loading, so a bad value fails at once
    if args.thinking is not None and not args.chat:
        raise ValidationError("--thinking/--no-thinking apply to the chat template: add --chat")
    skips = _skips(args)
    hints = hint_args(args)
    if args.stream and hints:
        raise ValidationError("--stream cannot be combined with planning hints yet")
    profile = _quality_profile(args)
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    # Only a non-default option is passed on, so the default call matches the other commands'.
    llm = load_llm(
        args.model,
        args.dtype,
        float_weights=profile is not None,
        **({"compile": True} if args.compile else {}),
        **({"per_request_depth": True} if skips else {}),
        **_expert_cache_args(args),
        **_sparsity_args(args),
        **_parallel_args(args),
        **_speculative_args(args),
    )
    prompt = [{"role": "user", "content": text}] if args.chat else text
    if profile is not None:
        from zcode.quant.variants import attach_variants

        attach_variants(llm, profile, args.budget, args.variant_cap)
    if args.stream:
        for out in llm.stream(prompt, params, args.thinking, **skips):
            _write(out.delta_text)
        _write("\n")
    else:
        out = llm.generate(prompt, params, args.thinking, **hints, **skips)[0]
        if out.plan is not None:  # the plan that ran (hints), speculative decoding counts
            print(json.dumps(out.plan.to_dict()), file=sys.stderr)
        print(out.text)


def _skips(args: argparse.Namespace) -> dict:
    """--skip-layers "13,14" and --skip-kv-heads "5:2,6:1" as generate() takes them."""
    skips = {}
    try:
        if args.skip_layers:
            skips["skip_layers"] = [int(i) for i in args.skip_layers.split(",")]
        if args.skip_kv_heads:
            pairs = [pair.split(":") for pair in args.skip_kv_heads.split(",")]
            skips["skip_kv_heads"] = [(int(i), int(g)) for i, g in pairs]
    except ValueError:
        raise ValidationError(
            "--skip-layers takes layer numbers (13,14) and --skip-kv-heads layer:head pairs "
            "(5:2,6:1)"
        ) from None
    return skips


def _chat(args: argparse.Namespace) -> None:
    params = _sampling_params(args)
    llm = load_llm(args.model, args.dtype, **_expert_cache_args(args))
    if not getattr(llm.tokenizer, "chat_template", None):
        raise ValidationError("this model has no chat template: use 'zcode generate'")
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())

        print("/reset clears the conversation; /exit or Ctrl-D quits; Ctrl-C stops a reply")
    opening = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(opening)
    while (line := _read_turn("> " if interactive else "")) is not None:
        if line == "/exit":
            break
        if line == "/reset":
            messages = list(opening)
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        try:
            with _CtrlCStopsReply() as ctrl_c:
                for out in llm.stream(messages, params, args.thinking):
                    _write(out.delta_text)
                    reply.append(out.delta_text)
                    if ctrl_c.pressed:
                        break  # closing the stream aborts the request
        except ValidationError as e:  # e.g. the conversation outgrew the context
            messages.pop()
            print(f"zcode: error: {e} (/reset starts a new conversation)", file=sys.stderr)
            continue
        _write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})


def _read_turn(prompt: str) -> str | None:
    """The user's next line, stripped; None at end of input. Ctrl-C at the prompt clears the
    line, as in a shell, and keeps the conversation."""
    while True:
        try:
            return input(prompt).strip()
        except EOFError:
            if prompt:
                print()  # the shell prompt starts on a line of its own
            return None
        except KeyboardInterrupt:
            print()


class _CtrlCStopsReply:
    """While a reply streams, Ctrl-C sets `pressed` instead of raising: the stream stops after
    the step in flight (never inside one, which would leave the engine half-updated), the words
    so far stay in the conversation, and the prompt comes back."""

    def __enter__(self) -> "_CtrlCStopsReply":
        self.pressed = False
        self._previous = signal.signal(signal.SIGINT, self._press)
        return self

    def _press(self, signum, frame) -> None:
        self.pressed = True

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {text!r}")
    return int(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, not {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, not {text!r}")
    return value


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

    info = probe(refresh=args.refresh)
    # The fit is cached under the machine and kernels version (cost_key), not the bare fingerprint.
    cost = CostModel.load_or_fit(info) if args.fit_cost else CostModel.cached(info)
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
    text = _read_text(args.file)
    plan = _read_plan(args.plan) if args.plan else None
    skips = _skips(args)
    llm = load_llm(
        args.model,
        args.dtype,
        float_weights=plan is not None,
        **({"per_request_depth": True} if skips else {}),
        **_sparsity_args(args),
    )
    if plan is not None:
        _apply_plan(llm, plan)
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


def _read_plan(path: str) -> dict[str, str]:
    from zcode.quant.artifact import read_plan

    try:
        return read_plan(path)
    except ValueError as e:
        raise ValidationError(str(e)) from e


def _apply_plan(llm: "LLM", plan: dict[str, str], **options) -> None:
    from zcode.quant import apply_precision

    try:
        apply_precision(llm.model, plan, **options)
    except ValueError as e:  # an unknown module or format, a protected module
        raise ValidationError(f"precision plan: {e}") from e


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
    plan = _read_plan(args.plan) if args.plan else None
    if args.budget:
        plan = _plan_for_budget(args.budget, args.profile)
    llm = load_llm(args.model, "float32")
    if args.format:
        plan = {name: args.format for name in quantizable_modules(llm.model)}
    hessians = None
    if args.method == "gptq":
        if llm.tokenizer is None:
            raise ValidationError("GPTQ calibrates on text: this checkpoint has no tokenizer")
        tokens = corpus_tokens(llm.tokenizer, "calibration", args.calibration_tokens)
        hessians = collect_hessians(llm, tokens, [n for n, f in plan.items() if f != "fp32"])
    _apply_plan(llm, plan, method=args.method, hessians=hessians, hadamard=args.hadamard)
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
    text = _read_text(profile_path)
    try:
        profile = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValidationError(f"{profile_path}: not JSON: {e}") from e
    if not isinstance(profile, dict) or not isinstance(profile.get("modules"), dict):
        raise ValidationError(f"{profile_path}: not a sensitivity profile (no 'modules')")
    return plan_for_budget(profile, budget)  # PlanError, a ValidationError, for a bad budget


def _profile(args: argparse.Namespace) -> None:
    from zcode.calibration import corpus_tokens
    from zcode.quant import FORMATS
    from zcode.quant.report import draw_heatmap
    from zcode.quant.sensitivity import profile_sensitivity

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if not formats or unknown:
        raise ValidationError(
            f"--formats: unknown {', '.join(unknown) or 'empty list'}; known: {', '.join(FORMATS)}"
        )
    if args.tokens < 2:
        raise ValidationError(f"--tokens must be at least 2, got {args.tokens}")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise ValidationError(f"--out {out}: directory {out.parent} does not exist")
    llm = load_llm(args.model, args.dtype)
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


def _serve(args: argparse.Namespace) -> None:
    from zcode.server import run_server  # FastAPI and uvicorn load for this command only

    for name in ("max_num_seqs", "kv_cache_mib", "max_request_bytes"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise ValidationError(f"{flag} must be at least 1, got {getattr(args, name)}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValidationError(f"--max-model-len must be at least 2, got {args.max_model_len}")
    if not 0 <= args.port <= 65535:
        raise ValidationError(f"--port must be between 0 and 65535, got {args.port}")
    if args.shutdown_timeout < 0:
        raise ValidationError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    engine_args = dict(
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_cache_bytes=args.kv_cache_mib << 20,
    )
    if args.no_prefix_caching:
        engine_args["enable_prefix_caching"] = False
    if args.per_request_depth:
        engine_args["per_request_depth"] = True
    engine_args.update(_expert_cache_args(args))
    engine_args.update(_sparsity_args(args))
    engine_args.update(_speculative_args(args))
    engine_args.update(_parallel_args(args))
    chat_template = None
    if args.chat_template is not None:
        try:
            chat_template = Path(args.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValidationError(f"--chat-template {args.chat_template}: {e}") from None
    run_server(
        args.model,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout_s=args.shutdown_timeout,
        engine_args=engine_args,
        protect_metrics=args.protect_metrics,
        chat_template=chat_template,
    )


def _calibrate(args: argparse.Namespace) -> None:
    from zcode.sparsity.artifact import default_path
    from zcode.sparsity.calibrate import calibrate

    if args.tokens < 512:
        raise ValidationError(f"--tokens must be at least 512, got {args.tokens}")
    llm = load_llm(args.model, "float32", enable_prefix_caching=False)
    if llm.tokenizer is None:
        raise ValidationError("calibration reads text: this checkpoint has no tokenizer")
    try:
        artifact = calibrate(llm, num_tokens=args.tokens)
    except ValueError as e:
        raise ValidationError(str(e)) from e
    out = Path(args.out) if args.out else default_path(llm.model)
    artifact.save(out)
    for level in artifact.levels:
        print(
            f"ffn in {level.sparsity_in:.2f} mid {level.sparsity_mid:.2f}  "
            f"flops skipped {level.flops_skipped:.1%}  calibration ppl x{level.ppl_ratio:.4f}"
        )
    print(f"wrote {out}")


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValidationError(f"{path}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ValidationError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (CheckpointError, ValidationError) as e:
        print(f"zcode: error: {e}", file=sys.stderr)
        sys.exit(2)  # argparse's status for a usage error: one status for every user mistake
    except RankFailure as e:  # another torchrun rank died or hung
        print(f"zcode: error: {e}", file=sys.stderr)
        sys.exit(1)
    except NotImplementedError as e:  # an option this model or build does not support yet
        print(f"zcode: error: not supported yet: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        # The reader (`| head`) went away: silence the flush Python retries at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


if __name__ == "__main__":
    main()
