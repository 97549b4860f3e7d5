"""Held-out perplexity of SmolLM2-135M under every uniform weight format and quantizer, against
the unquantized model in the same run.

    .venv/bin/python bench/bench_quantizers.py [--quick] [--tokens 2048] [--calibration 2048]
        [--out bench/results/quantizers.json]

Every quantizable linear (all q/k/v/o/gate/up/down projections and the tied lm_head; the
embedding lookup keeps its weight) gets the same format, by round-to-nearest (rtn) or GPTQ, with
or without a Hadamard rotation of the inputs (+had). GPTQ's Hessians come from
`corpus_tokens(tok, "calibration", N)` in windows of 512; perplexity is measured on
`corpus_tokens(tok, "heldout", N)` with window 512 and stride 256 — files the calibration never
saw. The "fp32" baseline is the embedded model as ZCode loads it (its Q4_1 GGUF dequantized to
fp32). bits/weight counts packed weights plus scales over the quantized linears.

Read the int4 rows with that in mind: the baseline's weights already sit on a Q4_1 grid (groups
of 32, asymmetric, 16 levels), which int4-g32 and w4a8 (g32) nearly reproduce by rounding to
nearest, so those rows flatter RTN; g64 and g128 groups straddle the original groups and show
the real 4-bit loss. A Hadamard rotation moves the weights off that grid, which is why it can
hurt the g32 rows here while it helps g128 and the 8-bit-activation rows.

Prints a table with the relative perplexity delta to fp32 and writes all rows as JSON (read by
the precision planner's bench). --quick runs only int8 and int4-g128 (rtn and gptq) on 1024
held-out tokens. Quality numbers are deterministic; only the seconds depend on the machine.
"""

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # table_format, run as a script

from table_format import print_rows  # noqa: E402

from zcode.calibration import corpus_tokens  # noqa: E402
from zcode.llm import LLM  # noqa: E402
from zcode.ppl import perplexity  # noqa: E402
from zcode.quant import apply_precision, quantizable_modules  # noqa: E402
from zcode.quant.activations import collect_hessians  # noqa: E402

WINDOW, STRIDE = 512, 256
INT4 = ("int4-g32", "int4-g64", "int4-g128")
# Most informative first (the JSON is rewritten after every row, so a cut-short run still
# reports): the acceptance rows, then the rotation where it should matter (8-bit activations),
# then the rest.
FULL = (
    [("int8", m, False) for m in ("rtn", "gptq")]
    + [(f, m, False) for f in INT4 for m in ("rtn", "gptq")]
    + [(f, "rtn", h) for f in ("w8a8", "w4a8") for h in (False, True)]
    + [("int4-g128", m, True) for m in ("rtn", "gptq")]
    + [(f, "gptq", h) for f in ("w8a8", "w4a8") for h in (False, True)]
    + [(f, m, True) for f in ("int4-g32", "int4-g64") for m in ("rtn", "gptq")]
)
QUICK = [(f, m, False) for f in ("int8", "int4-g128") for m in ("rtn", "gptq")]


@dataclass(frozen=True)
class Row:
    format: str
    method: str
    hadamard: bool
    perplexity: float
    delta_vs_fp32: float  # relative
    bits_per_weight: float
    quantize_seconds: float

    @property
    def label(self) -> str:
        return label(self.format, self.method, self.hadamard)


def label(fmt: str, method: str, hadamard: bool) -> str:
    return f"{fmt} {method}" + (" +had" if hadamard else "")


def measure(llm: LLM, heldout: list[int], fmt, method, hadamard, hessians, base) -> Row:
    names = quantizable_modules(llm.model)
    originals = {name: llm.model.get_submodule(name) for name in names}
    start = time.perf_counter()
    if fmt == "fp32":
        replaced = {}
    else:
        plan = {name: fmt for name in names}
        replaced = apply_precision(
            llm.model, plan, method=method, hessians=hessians, hadamard=hadamard
        )
    seconds = time.perf_counter() - start
    ppl = perplexity(llm, heldout, WINDOW, STRIDE).perplexity
    bits = sum(8 * getattr(m, "linear", m).weight_bytes for m in replaced.values())
    numel = sum(originals[n].weight.numel() for n in replaced)
    for name, module in originals.items():  # back to the float model for the next row
        parent, _, child = name.rpartition(".")
        setattr(llm.model.get_submodule(parent), child, module)
    return Row(
        fmt,
        method,
        hadamard,
        ppl,
        ppl / base - 1 if base else 0.0,
        bits / numel if numel else 32.0,
        seconds,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="int8 and int4-g128 only")
    parser.add_argument("--tokens", type=int, help="held-out tokens (default 2048, quick 1024)")
    parser.add_argument("--calibration", type=int, default=2048, help="calibration tokens")
    parser.add_argument("--out", default="bench/results/quantizers.json")
    parser.add_argument(
        "--configs",
        help="comma-separated labels to run, e.g. 'int8 gptq,int4-g128 rtn +had' (default: all)",
    )
    parser.add_argument(
        "--threads", type=int, help="torch threads (default: torch's; 1 fares better on a busy CPU)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    num_tokens = args.tokens or (1024 if args.quick else 2048)

    # No prefix caching: each row must compute its own KV, not reuse the previous precision's.
    llm = LLM(None, dtype="float32", enable_prefix_caching=False)
    heldout = corpus_tokens(llm.tokenizer, "heldout", num_tokens)
    calibration = corpus_tokens(llm.tokenizer, "calibration", args.calibration)
    configs = QUICK if args.quick else FULL
    if args.configs:
        wanted = [name.strip() for name in args.configs.split(",")]
        known = {label(*config): config for config in FULL + QUICK}
        unknown = [w for w in wanted if w not in known]
        if unknown:
            parser.error(f"unknown configs {unknown}; known: {', '.join(known)}")
        configs = [known[w] for w in wanted]
    hessians = None
    if any(method == "gptq" for _, method, _ in configs):
        hessians = collect_hessians(llm, calibration, quantizable_modules(llm.model))

    base_row = measure(llm, heldout, "fp32", "none", False, None, 0.0)
    rows = [base_row]
    for fmt, method, hadamard in configs:
        rows.append(measure(llm, heldout, fmt, method, hadamard, hessians, base_row.perplexity))
        row = rows[-1]
        print(f"{row.label}: ppl {row.perplexity:.4f} ({row.delta_vs_fp32:+.2%})", flush=True)
        write_json(args.out, rows, len(heldout), len(calibration), complete=False)
    write_json(args.out, rows, len(heldout), len(calibration), complete=True)

    print(
        f"\nSmolLM2-135M held-out perplexity: {len(heldout)} tokens, window {WINDOW}, "
        f"stride {STRIDE}; GPTQ calibrated on {len(calibration)} tokens\n"
    )
    print_rows(
        ["format / method", "bits/weight", "perplexity", "vs fp32", "quantize s"],
        [
            (
                "fp32" if r is base_row else r.label,
                f"{r.bits_per_weight:.2f}",
                f"{r.perplexity:.4f}",
                f"{r.delta_vs_fp32:+.2%}",
                f"{r.quantize_seconds:.1f}",
            )
            for r in rows
        ],
    )
    print(f"\nwrote {args.out}")


def write_json(path: str, rows: list[Row], num_heldout: int, num_calibration: int, complete: bool):
    report = {
        "model": "SmolLM2-135M-Instruct (embedded Q4_1 GGUF, dequantized to fp32)",
        "heldout_tokens": num_heldout,
        "calibration_tokens": num_calibration,
        "window": WINDOW,
        "stride": STRIDE,
        "modules": "every quantizable linear, lm_head included",
        "torch_threads": torch.get_num_threads(),
        "complete": complete,  # False while the run is still going (or was cut short)
        "rows": [asdict(r) | {"label": "fp32" if i == 0 else r.label} for i, r in enumerate(rows)],
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
