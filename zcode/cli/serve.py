"""`zcode serve`: the OpenAI-compatible server, alone or as rank 0 under torchrun."""

import argparse
from pathlib import Path

from zcode.cli.options import (
    add_compile_option,
    add_dtype_option,
    add_expert_cache_option,
    add_kv_cache_dtype_option,
    add_model_argument,
    add_parallel_options,
    add_sparsity_option,
    add_speculative_options,
    compile_args,
    expert_cache_args,
    kv_cache_dtype_args,
    parallel_args,
    sparsity_args,
    speculative_args,
)
from zcode.errors import ValidationError


def add_commands(commands) -> None:
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
    add_model_argument(serve)
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
    add_dtype_option(serve)
    add_kv_cache_dtype_option(serve)
    add_compile_option(serve)
    add_expert_cache_option(serve)
    add_sparsity_option(serve)
    add_speculative_options(serve)
    add_parallel_options(serve, "serve")
    serve.set_defaults(run=_serve)


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
    engine_args.update(compile_args(args))
    engine_args.update(expert_cache_args(args))
    engine_args.update(kv_cache_dtype_args(args))
    engine_args.update(sparsity_args(args))
    engine_args.update(speculative_args(args))
    engine_args.update(parallel_args(args))
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
