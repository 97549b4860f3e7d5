"""Batch-1 decode speed of ZCode's weight formats against llama.cpp on SmolLM2-135M, one run,
each against the memory-bandwidth roofline for its own bytes per token.

    .venv/bin/python bench/bench_quant_decode.py [--quick] [--repeats 5] [--new-tokens 64]
        [--engines zcode-bf16,zcode-int8,...,llama.cpp-Q8_0]

ZCode loads the embedded Q4_1 GGUF in bf16 and quantizes every quantizable linear (the tied
lm_head included; the embedding lookup keeps its weight) by round-to-nearest with
zcode.quant.apply_precision; its fast kernels run (bf16 and w4a8 at batch 1: the C++ GEMV of
zcode/kernels/gemv.cpp; w4a8 = int4-g32 weights times int8 activations quantized per token,
as llama.cpp's Q4_1 x Q8_1 dot product quantizes them per block of 32). llama.cpp
(llama-cpp-python) runs the Q4_1 file as is, and a Q8_0 file written here with the gguf
package: every Q4_1 tensor dequantized and requantized to Q8_0 (token_embd is Q8_0 in the
original already), metadata and tokenizer copied — so the Q8_0 weights are *requantized from
Q4_1*, not from the original bf16 model.

Timing follows bench/bench_core.py (whose runners are reused): decode tok/s = (N - 1) / (time
from the first to the last of N new tokens) after a short prompt, min and median of --repeats,
engines round-robin within each repeat. Roofline: bandwidth measured in the same run
(bench_core.measure_bandwidth, read-only streaming of 256 MiB) / bytes read per token (ZCode:
every linear's stored weight, packed + scales, and the norms; llama.cpp: every tensor of the
GGUF file, the tied token_embd once). Results go to bench/results/quant_decode.json.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # sibling bench modules, run as a script

from bench_core import (  # noqa: E402
    NUM_THREADS,
    LlamaCppRunner,
    ZCodeRunner,
    build_prompts,
    measure_bandwidth,
)
from bench_precision import bytes_per_token  # noqa: E402
from table_format import print_rows  # noqa: E402

from zcode.harness import ExecutionPlan  # noqa: E402
from zcode.loader.checkpoint import resolve_model_path  # noqa: E402
from zcode.quant import apply_precision, quantizable_modules  # noqa: E402

RESULTS_PATH = Path(__file__).parent / "results" / "quant_decode.json"
Q8_0_PATH = Path.home() / ".cache" / "zcode" / "bench" / "SmolLM2-135M-Instruct.Q8_0-from-Q4_1.gguf"
ENGINES = (
    "zcode-bf16",
    "zcode-int8",
    "zcode-int4-g32",
    "zcode-int4-g128",
    "zcode-w4a8",
    "zcode-w8a8",
    "zcode-bf16-compiled",
    "zcode-int8-compiled",
    "zcode-int4-g32-compiled",
    "zcode-w4a8-compiled",
    "zcode-w8a8-compiled",
    "llama.cpp-Q4_1",
    "llama.cpp-Q8_0",
)
BANDWIDTH_BYTES = 256 << 20


class ZCodeQuantRunner(ZCodeRunner):
    """bench_core's ZCode runner (bf16 model) with every quantizable linear in one format."""

    def __init__(self, fmt: str | None, compile: bool = False) -> None:
        super().__init__("bfloat16", compile)
        if fmt is not None:
            model = self.llm.model
            plan = {n: fmt for n in quantizable_modules(model)}
            apply_precision(model, plan)
            # Compiled decode graphs are cached by plan signature: declare the swap.
            self.llm.engine.runner.set_plan(ExecutionPlan(precision=tuple(sorted(plan.items()))))
            self.format = fmt + (" compiled decode" if compile else "")
        self.bytes_per_token = bytes_per_token(self.llm.model)


def write_q8_0(source: Path, target: Path) -> None:
    """A Q8_0 copy of a GGUF file: Q4_1 tensors dequantized and requantized, the rest as is."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, Keys
    from gguf.quants import dequantize, quantize

    reader = GGUFReader(str(source))
    arch = reader.fields[Keys.General.ARCHITECTURE].contents()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    writer = GGUFWriter(str(partial), arch)
    for field in reader.fields.values():
        if field.name == Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        value = field.contents()
        if field.name == Keys.General.FILE_TYPE:
            value = 7  # LLAMA_FTYPE_MOSTLY_Q8_0
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, val_type, sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.tensor_type == GGMLQuantizationType.Q4_1:
            weights = dequantize(tensor.data, tensor.tensor_type)  # [rows, cols] fp32
            data = quantize(weights, GGMLQuantizationType.Q8_0)
            writer.add_tensor(tensor.name, data, raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(
                tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(target)


def load(name: str, model_path: Path):
    if name == "llama.cpp-Q4_1":
        runner = LlamaCppRunner(model_path)
        runner.format = "Q4_1 (file)"
        return runner
    if name == "llama.cpp-Q8_0":
        if not Q8_0_PATH.is_file():
            write_q8_0(model_path, Q8_0_PATH)
        runner = LlamaCppRunner(Q8_0_PATH)
        runner.format = "Q8_0 (requantized from Q4_1)"
        return runner
    fmt = name.removeprefix("zcode-").removesuffix("-compiled")
    return ZCodeQuantRunner(None if fmt == "bf16" else fmt, compile=name.endswith("-compiled"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats of 16 tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--out", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.new_tokens = 2, 16
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        parser.error(f"unknown engines {sorted(unknown)}; known: {', '.join(ENGINES)}")
    torch.set_num_threads(NUM_THREADS)
    model_path = resolve_model_path(None)
    _, prompts = build_prompts(model_path, 16, 1)
    runners = {name: load(name, model_path) for name in engines}
    decode_s: dict[str, list[float]] = {name: [] for name in engines}
    outputs = {}
    bandwidths = []
    for _ in range(args.repeats):
        bandwidths.append(measure_bandwidth(BANDWIDTH_BYTES, tries=3))
        for name, runner in runners.items():  # round-robin: load hits every engine alike
            runner.run(prompts, 4)  # warm-up
            timing = runner.run(prompts, args.new_tokens)
            decode_s[name].append(timing.decode_s)
            outputs[name] = timing.token_ids[0]
    bandwidth = max(bandwidths)  # bytes/s, the best of the run
    rows, results = [], []
    reference = "llama.cpp-Q4_1" if "llama.cpp-Q4_1" in runners else None
    for name, runner in runners.items():
        best = (args.new_tokens - 1) / min(decode_s[name])
        median = (args.new_tokens - 1) / statistics.median(decode_s[name])
        roofline = bandwidth / runner.bytes_per_token
        result = {
            "engine": name,
            "format": runner.format,
            "bytes_per_token": runner.bytes_per_token,
            "decode_s": decode_s[name],
            "tok_s_best": best,
            "tok_s_median": median,
            "roofline_tok_s": roofline,
            "roofline_fraction_best": best / roofline,
            "tokens": outputs[name],
        }
        results.append(result)
    ref = next((r for r in results if r["engine"] == reference), None)
    for r in results:
        ratio = "-" if ref is None else f"{r['tok_s_median'] / ref['tok_s_median']:.2f}x"
        rows.append(
            (
                r["engine"],
                r["format"],
                f"{r['bytes_per_token'] / 1e6:.1f}",
                f"{r['tok_s_best']:.1f}",
                f"{r['tok_s_median']:.1f}",
                f"{r['roofline_tok_s']:.0f}",
                f"{100 * r['roofline_fraction_best']:.0f}%",
                ratio,
            )
        )
    print(
        f"batch 1, {args.new_tokens} new tokens, {args.repeats} repeats, {NUM_THREADS} threads, "
        f"bandwidth {bandwidth / 1e9:.1f} GB/s (best of {len(bandwidths)}, same run)"
    )
    print_rows(
        [
            "engine",
            "format",
            "MB/token",
            "tok/s best",
            "tok/s median",
            "roofline tok/s",
            "% roofline (best)",
            "vs llama.cpp Q4_1 (median)",
        ],
        rows,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                "threads": NUM_THREADS,
                "new_tokens": args.new_tokens,
                "repeats": args.repeats,
                "bandwidth_bytes_per_s": bandwidth,
                "results": results,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
