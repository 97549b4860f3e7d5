"""Options and argument checks the commands share, and the one place a command loads a model.

Torch-free at import, like every module of the command line: `zcode --help` and a Ctrl-C during
start-up must not wait on torch.
"""

import argparse
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from zcode.config import DRAFT_POLICIES, KV_CACHE_DTYPES, SPECULATIVE_METHODS
from zcode.distributed.config import ParallelConfig
from zcode.errors import ValidationError

if TYPE_CHECKING:
    from zcode.llm import LLM
    from zcode.sampling_params import SamplingParams


DEFAULT_MODEL_HELP = "default: the embedded SmolLM2-135M-Instruct"
SAMPLING_HELP = (
    "Sampling defaults follow llama.cpp's llama-cli (temperature 0.8, top-k 40, top-p 0.95, "
    "min-p 0.05, no repetition penalty); --temperature 0 is greedy, as in vLLM."
)


def add_model_argument(
    parser: argparse.ArgumentParser, what: str = "HF model directory or .gguf file"
) -> None:
    parser.add_argument("model", metavar="MODEL", nargs="?", help=f"{what} ({DEFAULT_MODEL_HELP})")


def add_model_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", metavar="PATH", help=f"HF model directory or .gguf file ({DEFAULT_MODEL_HELP})"
    )


def add_sampling_options(parser: argparse.ArgumentParser, max_tokens: int) -> None:
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


def sampling_params(args: argparse.Namespace) -> "SamplingParams":
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


def add_thinking_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--thinking",
        action=argparse.BooleanOptionalAction,
        help="turn the chat template's reasoning mode on or off, for templates that have one "
        "(default: the template's own default)",
    )


def add_dtype_option(parser: argparse.ArgumentParser, default: str = "auto") -> None:
    choices = ["auto", "float32", "bfloat16"] if default == "auto" else ["float32", "bfloat16"]
    parser.add_argument(
        "--dtype",
        choices=choices,
        default=default,
        help="dtype the weights are computed in; auto runs them as the file stores them (a GGUF "
        "file's quantized blocks, memory-mapped), float32 where --sparsity rewrites them "
        "(default: %(default)s)",
    )


def add_kv_cache_dtype_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="dtype of the KV cache: auto keeps the dtype the model computes in (fp32 for GGUF "
        "files); bfloat16 or float16 hold and read half the bytes per token of context, as "
        "llama.cpp's default fp16 cache does (default: %(default)s)",
    )


def kv_cache_dtype_args(args: argparse.Namespace) -> dict:
    """The engine option, only when given (so the default call matches the other commands')."""
    return {} if args.kv_cache_dtype == "auto" else {"kv_cache_dtype": args.kv_cache_dtype}


def add_compile_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the decode step (torch.compile) per batch-size bucket: faster tokens after "
        "a compile of tens of seconds at each bucket's first step",
    )


def compile_args(args: argparse.Namespace) -> dict:
    """The engine option, only when given (so the default call matches the other commands')."""
    return {"compile": True} if args.compile else {}


def add_expert_cache_option(parser: argparse.ArgumentParser) -> None:
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


def expert_cache_args(args: argparse.Namespace) -> dict:
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


def add_sparsity_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sparsity",
        metavar="ARTIFACT",
        help="run with dynamic FFN sparsity from a 'zcode calibrate' artifact: the level that "
        "skips the most FFN work within 1%% calibration perplexity (default: dense)",
    )


def sparsity_args(args: argparse.Namespace) -> dict:
    if not args.sparsity:
        return {}
    if not Path(args.sparsity).is_file():  # before the model loads
        raise ValidationError(f"{args.sparsity}: no such sparsity artifact (see zcode calibrate)")
    return {"sparsity": args.sparsity}


def add_skip_options(parser: argparse.ArgumentParser) -> None:
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


def skip_args(args: argparse.Namespace) -> dict:
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


def add_speculative_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative",
        choices=SPECULATIVE_METHODS,
        help="speculative decoding: drafts verified by the model in one forward, outputs "
        "unchanged; ngram: prompt lookup, skip_layers: the model without some layers drafts, "
        "quantized: the model with int8 (--draft-format) weights drafts, mtp: the checkpoint's "
        "MTP layer (GLM-4.5+ / GLM-5 HF checkpoints)",
    )
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        metavar="K",
        help="with --speculative: tokens drafted per step at most (default: 3)",
    )
    parser.add_argument(
        "--draft-policy",
        choices=DRAFT_POLICIES,
        help="with --speculative: adaptive (default) drafts per request and step as many of "
        "those tokens as pay by measured acceptance and this machine's cost model (none where "
        "speculation does not pay); fixed always drafts them all",
    )
    parser.add_argument(
        "--draft-skip-layers",
        metavar="LAYERS",
        help='with --speculative skip_layers: the layers the draft skips, e.g. "3,5,7" '
        "(default: every other inner layer)",
    )
    parser.add_argument(
        "--draft-format",
        metavar="FORMAT",
        help="with --speculative quantized: the draft's weight format, e.g. int8 (default), "
        "int4-g32, w4a8",
    )


def speculative_args(args: argparse.Namespace) -> dict:
    """The engine arguments of --speculative and its options (none if it is not given)."""
    if args.speculative is None:
        given = (
            args.num_draft_tokens,
            args.draft_skip_layers,
            args.draft_format,
            args.draft_policy,
        )
        if any(option is not None for option in given):
            raise ValidationError(
                "--num-draft-tokens, --draft-policy, --draft-skip-layers and --draft-format need "
                "--speculative"
            )
        return {}
    engine_args = {"speculative": args.speculative}
    if args.draft_policy is not None:
        engine_args["draft_policy"] = args.draft_policy
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
    if args.draft_format is not None:
        if args.speculative != "quantized":
            raise ValidationError("--draft-format needs --speculative quantized")
        engine_args["draft_format"] = args.draft_format
    return engine_args


def add_quality_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--budget",
        help="precision levels from the --sparsity artifact's sensitivity profile: quantize the "
        "units outside the leveled FFNs (attention, lm_head) to the plan of least predicted KL "
        "within this budget, e.g. 4.5bits, and keep int8 and unquantized variants of the most "
        "sensitive under --variant-cap",
    )
    parser.add_argument(
        "--variant-cap", default="64MB", help="memory for the variants (default: %(default)s)"
    )


def check_quality_options(args: argparse.Namespace) -> None:
    """Before the model loads: --budget plans from the calibration artifact's profile."""
    if args.budget is not None and not args.sparsity:
        raise ValidationError(
            "--budget plans precision from a calibration artifact's sensitivity profile: add "
            "--sparsity ARTIFACT (written by zcode calibrate)"
        )


def attach_precision(llm: "LLM", args: argparse.Namespace) -> None:
    """The precision levels --budget asks for, from the artifact `llm` loaded."""
    if args.budget is None:
        return
    if llm.sparsity.sensitivity is None:
        raise ValidationError(
            f"{args.sparsity} has no sensitivity profile (written before calibration profiled "
            "precision): rerun zcode calibrate"
        )
    from zcode.quant.variants import attach_variants

    attach_variants(llm, llm.sparsity.sensitivity, args.budget, args.variant_cap)


def load_llm(model: str | None, dtype: str, float_weights: bool = False, **engine_args) -> "LLM":
    """The one place a command loads a model. `float_weights`: the command rewrites weights (a
    precision plan, quality variants), so "auto" loads them as float32. Commands call it as
    `options.load_llm`, so a test replaces it for all of them in one place."""
    if float_weights and dtype == "auto":
        dtype = "float32"
    from zcode.llm import LLM

    return LLM(model, dtype=dtype, **engine_args)


def add_parallel_options(parser: argparse.ArgumentParser, command: str) -> None:
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


def parallel_args(args: argparse.Namespace) -> dict:
    parallel = ParallelConfig(
        tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel=args.expert_parallel,
        pipeline_parallel_size=args.pipeline_parallel_size,
        collective_timeout_s=args.collective_timeout_s,
    )
    return {"parallel": parallel} if parallel.is_distributed else {}


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {text!r}")
    return int(text)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, not {text!r}")
    return value


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, not {text!r}")
    return value


def read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValidationError(f"{path}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ValidationError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e


def read_plan(path: str) -> dict[str, str]:
    from zcode.quant.artifact import read_plan

    try:
        return read_plan(path)
    except ValueError as e:
        raise ValidationError(str(e)) from e


def apply_plan(llm: "LLM", plan: dict[str, str], **options) -> None:
    from zcode.quant import apply_precision

    try:
        apply_precision(llm.model, plan, **options)
    except ValueError as e:  # an unknown module or format, a protected module
        raise ValidationError(f"precision plan: {e}") from e


def write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def add_formats_option(parser: argparse.ArgumentParser) -> None:
    """--formats: the weight formats a sensitivity profile measures (zcode profile, calibrate);
    the default is zcode.quant.sensitivity.DEFAULT_FORMATS, spelled out: the CLI parses its
    arguments without importing torch."""
    parser.add_argument(
        "--formats",
        default="int8,int4-g32,int4-g128,w8a8,w4a8",
        metavar="F1,F2",
        help="weight formats to profile each linear in (default: %(default)s)",
    )


def profile_formats(args: argparse.Namespace) -> list[str]:
    from zcode.quant import FORMATS

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if not formats or unknown:
        raise ValidationError(
            f"--formats: unknown {', '.join(unknown) or 'empty list'}; known: {', '.join(FORMATS)}"
        )
    return formats
