"""Speculative decoding on SmolLM2-135M: decode tok/s with drafts against plain decoding in the
same run, and the acceptance behind it.

    .venv/bin/python bench/bench_spec.py [--quick] [--dtype bfloat16] [--batches 1,4,16]
        [--num-new 64] [--repeats 3] [--num-draft-tokens 3] [--methods ngram,quantized,...]
        [--workloads continuation,"code editing"] [--compile] [--draft-format FMT]

Workloads, from the held-out split of zcode.calibration (stdlib sources no calibration saw): (a)
continuation: windows of held-out source, continued; (b) code editing: a held-out function
followed by an instruction to repeat it with one name changed, and the new header, so the answer
mostly copies the prompt (where prompt lookup pays). Methods: plain decoding, `ngram` (prompt
lookup), `skip_layers` (the model without every other inner layer drafts) and `quantized` (the
model with int8 or --draft-format weights drafts), each with every request drafting
--num-draft-tokens per step (draft policy "fixed") and with the adaptive policy, which drafts
per request and step what pays by measured acceptance and the cost model ("drafts/step": drafted
tokens per request and decode step, where it turns speculation down or off). Engines run
round-robin within each repeat, after one untimed run each (graphs compiled, kernels tuned).
With --compile, decode steps, verifying steps and self-drafts run compiled graphs. Each cell is
min / median of --repeats runs of decode tok/s (first token to last, greedy, batch B); ZCode's
outputs are checked equal to plain decoding's (column "same"); "compiles timed" counts graphs
built inside the timed runs (0: the warm-up built every shape the runs took). llama.cpp (its GGUF
file, Q4_1) with and without prompt lookup decoding (llama-cpp-python's LlamaPromptLookupDecoding)
runs at batch 1 when llama_cpp is installed. Writes bench/results/spec.json.
"""

import argparse
import ast
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from table_format import print_rows  # noqa: E402

from zcode import LLM, SamplingParams  # noqa: E402
from zcode.calibration import corpus_text  # noqa: E402
from zcode.engine.llm_engine import LLMEngine  # noqa: E402
from zcode.hardware.cost_model import CostModel  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "spec.json"
# (name, EngineConfig.speculative, EngineConfig.draft_policy)
METHODS = (
    ("plain", None, "fixed"),
    ("ngram", "ngram", "fixed"),
    ("ngram adaptive", "ngram", "adaptive"),
    ("skip_layers", "skip_layers", "fixed"),
    ("skip_layers adaptive", "skip_layers", "adaptive"),
    ("quantized", "quantized", "fixed"),
    ("quantized adaptive", "quantized", "adaptive"),
)
PROMPT_TOKENS = 192


def continuation_prompts(tokenizer, count: int) -> list[list[int]]:
    ids = tokenizer.encode(corpus_text("heldout"))
    return [ids[i * 997 : i * 997 + PROMPT_TOKENS] for i in range(count)]


def editing_prompts(tokenizer, count: int) -> list[list[int]]:
    """A held-out function, then its header with the function renamed: reproduce the body."""
    source = corpus_text("heldout")
    functions = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef) and 8 <= node.end_lineno - node.lineno <= 30
    ]
    lines = source.splitlines()
    prompts = []
    for node in functions[:count]:
        body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
        body = body[body.index("def ") :]
        new_name = node.name + "_v2"
        header = body.splitlines()[0].replace(node.name, new_name, 1)
        text = f"{body}\n\n\n# The same function, renamed to {new_name}:\n{header}\n"
        prompts.append(tokenizer.encode(text))
    return prompts


def decode_run(
    engine: LLMEngine, prompts: list[list[int]], num_new: int, num_draft_tokens: int | None = None
) -> tuple[float, list, int]:
    """Decode tok/s (first token to last), the outputs, and the decode steps taken;
    `num_draft_tokens`: every request drafts that many (None: as the engine's policy says)."""
    params = SamplingParams(
        temperature=0, max_tokens=num_new, ignore_eos=True, num_draft_tokens=num_draft_tokens
    )
    seqs = [engine.add_request(p, params) for p in prompts]
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    tokens_per_s = len(prompts) * (num_new - 1) / (time.perf_counter() - start)
    return tokens_per_s, [s.output_token_ids for s in seqs], steps


def progress(line: str) -> None:
    """What the bench is doing before its cells print (a cold compiled run warms up for long)."""
    print(line, file=sys.stderr, flush=True)


def warm_up(engine: LLMEngine, prompts: list[list[int]], args) -> None:
    """Untimed: compiles graphs, tunes kernels. A compiled adaptive engine verifies at any width
    up to 1 + --num-draft-tokens, as its policy picks, and at every batch bucket below the
    batch (requests that drafted more finish first, and the rest run as a smaller batch): those
    graphs are compiled first, each bucket's requests drafting none, 1 and then the most (short
    runs; the acceptance totals its policy learns from are left as they were), else a timed run
    could be the one that compiles."""
    if engine.draft_policy is not None and engine.config.compile:
        totals = dict(engine.spec_totals)
        buckets = [b for b in engine.runner.graphs.buckets if b < len(prompts)]
        for size in [*buckets, len(prompts)]:
            for num_drafts in sorted({0, 1, args.num_draft_tokens}):
                decode_run(engine, prompts[:size], 8, num_draft_tokens=num_drafts)
        engine.spec_totals.update(totals)
    decode_run(engine, prompts, args.num_new)


def zcode_cells(llm: LLM, workloads: dict, batches: list[int], args) -> list[dict]:
    """Every method's engine on the same prompts, round-robin within each repeat."""
    adaptive = any(policy == "adaptive" and name in args.methods for name, _, policy in METHODS)
    # The adaptive policy's cost model (fitted once per machine, ~8 min; its compiled steps
    # ~8 min more)
    if adaptive:
        progress("the adaptive policy's cost model: loaded, or fitted once on this machine")
    cost = CostModel.load_or_fit(compiled=args.compile) if adaptive else None
    engines = {}
    for name, method, policy in METHODS:
        if name != "plain" and name not in args.methods:
            continue
        config = dataclasses.replace(
            llm.config,
            speculative=method,
            num_draft_tokens=args.num_draft_tokens,
            draft_policy=policy,
            enable_prefix_caching=False,  # repeats reuse their prompts
            compile=args.compile,
            draft_format=args.draft_format if method == "quantized" else None,
        )
        engines[name] = LLMEngine(llm.model, llm.tokenizer, config, cost_model=cost)
    cells = []
    for workload, prompts in workloads.items():
        for batch in batches:
            runs = {name: [] for name in engines}
            for name, engine in engines.items():
                progress(f"{workload} batch {batch}: warming up {name}")
                warm_up(engine, prompts[:batch], args)
                if args.compile:
                    progress(f"  {engine.num_compiles} graphs compiled so far")
            # The cell's counts are differences: the adaptive policy learns the engine's
            # acceptance from these totals (its prior for new requests), as a server's does.
            before = {name: dict(engine.spec_totals) for name, engine in engines.items()}
            compiles = {name: engine.num_compiles for name, engine in engines.items()}
            for _ in range(args.repeats):
                for name, engine in engines.items():
                    runs[name].append(decode_run(engine, prompts[:batch], args.num_new))
            for name, engine in engines.items():
                totals = {k: v - before[name][k] for k, v in engine.spec_totals.items()}
                steps = sum(r[2] for r in runs[name])
                cells.append(
                    {
                        "method": name,
                        "workload": workload,
                        "batch": batch,
                        "tok_s": [r[0] for r in runs[name]],
                        "outputs": runs[name][0][1],
                        "acceptance": totals["num_accepted_tokens"] / totals["num_draft_tokens"]
                        if totals["num_draft_tokens"]
                        else None,
                        # drafted tokens per request and step: where the policy drafts less
                        "drafts_per_step": totals["num_draft_tokens"] / (batch * steps),
                        # graphs built inside the timed runs, which then timed a compile: 0
                        # where the warm-up built every shape the policy went on to pick
                        "timed_compiles": engine.num_compiles - compiles[name],
                    }
                )
            medians = {name: statistics.median(r[0] for r in runs[name]) for name in engines}
            print(f"{workload} batch {batch}: median tok/s {medians}", flush=True)
    return cells


def llama_cpp_cells(workloads: dict, args) -> list[dict]:
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        print("llama.cpp: llama_cpp not installed (pip install llama-cpp-python); skipped")
        return []
    from zcode.loader.checkpoint import resolve_model_path

    cells = []
    for draft in (None, LlamaPromptLookupDecoding(num_pred_tokens=args.num_draft_tokens)):
        llm = Llama(str(resolve_model_path(None)), n_ctx=2048, draft_model=draft, verbose=False)
        for workload, prompts in workloads.items():
            speeds = []
            for _ in range(args.repeats):
                llm.reset()
                start, count = None, 0
                for _token in llm.generate(prompts[0], top_k=1, temp=0.0, repeat_penalty=1.0):
                    count += 1
                    start = start or time.perf_counter()
                    if count == args.num_new:
                        break
                speeds.append((count - 1) / (time.perf_counter() - start))
            method = "llama.cpp " + ("lookup" if draft else "plain")
            cells.append({"method": method, "workload": workload, "batch": 1, "tok_s": speeds})
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 1, 16 tokens, 3 repeats")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--num-new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    names = [name for name, _, _ in METHODS[1:]]
    parser.add_argument(
        "--methods", default=",".join(names), help=f"besides plain, some of: {', '.join(names)}"
    )
    parser.add_argument("--workloads", default="continuation,code editing")
    parser.add_argument("--draft-format", help="the quantized draft's format (default int8)")
    parser.add_argument(
        "--compile", action="store_true", help="compiled decode, drafts and verifying steps"
    )
    args = parser.parse_args()
    args.methods = args.methods.split(",")
    unknown = set(args.methods) - set(names)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; known: {', '.join(names)}")
    batches = [1] if args.quick else [int(b) for b in args.batches.split(",")]
    if args.quick:
        args.num_new = 16
    llm = LLM(None, dtype=args.dtype)
    count = max(batches)
    makers = {"continuation": continuation_prompts, "code editing": editing_prompts}
    workloads = {
        name: make(llm.tokenizer, count)
        for name, make in makers.items()
        if name in args.workloads.split(",")
    }
    cells = zcode_cells(llm, workloads, batches, args)
    if 1 in batches:  # llama.cpp's peers decode one sequence, beside ZCode's batch-1 cells
        cells += llama_cpp_cells(workloads, args)
    else:
        print("llama.cpp: its peers decode one sequence; without --batches 1, skipped")
    plain = {(c["workload"], c["batch"]): c for c in cells if c["method"] == "plain"}
    rows = []
    for c in cells:
        base = plain[(c["workload"], c["batch"])]
        same = "-" if "outputs" not in c else "yes" if c["outputs"] == base["outputs"] else "NO"
        ratio = statistics.median(c["tok_s"]) / statistics.median(base["tok_s"])
        acceptance = c.get("acceptance")
        rows.append(
            (
                c["method"],
                c["workload"],
                str(c["batch"]),
                f"{min(c['tok_s']):.1f} / {statistics.median(c['tok_s']):.1f}",
                f"{ratio:.2f}x",
                "-" if acceptance is None else f"{acceptance:.2f}",
                f"{c['drafts_per_step']:.2f}" if "drafts_per_step" in c else "-",
                same,
                str(c.get("timed_compiles", "-")),
            )
        )
    headers = ["method", "workload", "batch", "tok/s min / median", "vs plain", "accept"]
    headers += ["drafts/step", "same", "compiles timed"]
    mode = "compiled" if args.compile else "eager"
    print(f"SmolLM2-135M {args.dtype} {mode}, {args.num_new} new tokens, {args.repeats} repeats")
    print_rows(headers, rows)
    RESULTS.parent.mkdir(exist_ok=True)
    for c in cells:
        c.pop("outputs", None)
    RESULTS.write_text(json.dumps({"args": vars(args), "cells": cells}, indent=1))


if __name__ == "__main__":
    main()
