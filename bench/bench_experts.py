"""Fewer routed experts per token (the execution plan's experts dimension) on bench_glm_scale's
GLM-4.5-Air-shaped MoE: decode speed per count beside what the count does to the outputs.

For each count k in --counts (default: the router's top_k, then 3/4, 1/2 and 1/4 of it), on one
GGUF file of the model (--type, default q4_0; made and cached by bench_glm_scale):

- decode tok/s at batch 1 and at --batches, ZCode eager and compiled, min / median of --repeats,
  counts round-robin within each repeat; each count is the engine's default plan in turn (the
  plan executor sets the MoE layers' limit; compiled graphs are keyed by the plan);
- the cost model's predicted batch-1 tok/s for the plan (what the planner prices it at: eager
  coefficients), and measured eager / predicted;
- the outputs against k = top_k on --eval-tokens held-out stdlib tokens (512-token windows):
  perplexity ratio (what `zcode calibrate` stores for the planner), teacher-forced top-1
  agreement, and greedy agreement (share of the common prefix) over 5 prompts x --new-tokens.

The weights are random (routing made realistic by scripts/make_glm_synthetic.py's init): the
quality columns say how far the limited model moves from the full one, not a trained model's loss.

    .venv/bin/python bench/bench_experts.py [--type q4_0] [--counts 8 6 4 2] [--batches 4]
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from bench_core import SHORT_PROMPTS, ZCodeRunner, common_prefix
from bench_glm_scale import model_files
from table_format import print_rows

from zcode.calibration import corpus_tokens
from zcode.harness.plan import ExecutionPlan
from zcode.layers.moe import moe_layers
from zcode.ppl import windows
from zcode.sampling_params import SamplingParams

RESULTS_PATH = Path(__file__).parent / "results" / "experts.json"
WINDOW = 512


def use_count(llm, count: int | None) -> None:
    """Makes `count` routed experts per token (None: all) the plan of requests that name none,
    as LLM(sparsity=...) declares its default plan (the executor moves the model to it)."""
    extras = () if count is None else (("experts_per_token", str(count)),)
    plan = ExecutionPlan(name=f"{count} experts", extras=extras)
    executor = llm.engine.executor
    executor.default = plan
    executor.apply(plan)


def top1_and_nll(llm, tokens: list[int]) -> tuple[list[int], float, int]:
    """Teacher-forced top-1 ids of every scored position, and the summed nll of the text."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1, ignore_eos=True)
    spans = windows(len(tokens), WINDOW, WINDOW)
    outputs = llm.generate([tokens[b:e] for b, e, _ in spans], params)
    top1, nll, count = [], 0.0, 0
    for (begin, end, first), out in zip(spans, outputs):
        for position in range(first, end):
            entry = out.prompt_logprobs[position - begin]
            top1.append(max(entry, key=entry.get))
            nll -= entry[tokens[position]]
            count += 1
    return top1, nll, count


def quality(llm, counts, held_out: list[int], prompts, new_tokens: int) -> dict:
    """{count: ppl ratio, top-1 agreement, greedy agreement} against counts[0] (all experts)."""
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    out = {}
    for count in counts:
        use_count(llm, count)
        top1, nll, n = top1_and_nll(llm, held_out)
        generated = [o.token_ids for o in llm.generate(prompts, greedy)]
        out[count] = {"top1": top1, "nll": nll / n, "generated": generated}
    full = out[counts[0]]
    report = {}
    for count, q in out.items():
        same_top1 = sum(a == b for a, b in zip(q["top1"], full["top1"])) / len(full["top1"])
        prefix = [common_prefix(a, b) / len(b) for a, b in zip(q["generated"], full["generated"])]
        report[count] = {
            "ppl": float(torch.tensor(q["nll"]).exp()),
            "ppl_ratio": float(torch.tensor(q["nll"] - full["nll"]).exp()),
            "top1_agreement": same_top1,
            "greedy_agreement": statistics.mean(prefix),
        }
    use_count(llm, None)
    return report


def predicted_tok_s(llm, count: int | None) -> float | None:
    cost = llm.planner().cost
    if cost is None:
        return None
    extras = () if count is None else (("experts_per_token", str(count)),)
    return 1e3 / cost.predict_decode_ms(llm.model, ExecutionPlan(extras=extras), context_len=64)


def measure(runners: dict, counts, prompt: list[int], batches: dict, args) -> dict:
    samples = {(name, count, b): [] for name in runners for count in counts for b in [1, *batches]}
    for runner in runners.values():  # warm-up: each count's graphs at each batch size
        for count in counts:
            use_count(runner.llm, count)
            runner.run([prompt], 3)
            for prompts in batches.values():
                runner.run(prompts, 3)
    for repeat in range(args.repeats):
        for name, runner in runners.items():
            for count in counts:
                use_count(runner.llm, count)
                for b, prompts in [(1, [prompt]), *batches.items()]:
                    t = runner.run(prompts, args.new_tokens)
                    samples[(name, count, b)].append(b * (args.new_tokens - 1) / t.decode_s)
                print(f"  repeat {repeat + 1} {name} k={count}: "
                      + ", ".join(f"b{b} {samples[(name, count, b)][-1]:.1f}"
                                  for b in [1, *batches]) + " tok/s")  # fmt: skip
    return {
        f"{name}|{count}|{b}": {"min": min(v), "median": statistics.median(v), "samples": v}
        for (name, count, b), v in samples.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="glm45-air")
    parser.add_argument("--params", type=float, default=1.3e9)
    parser.add_argument("--vocab", type=int, help="vocabulary (default: SmolLM2's + GLM's)")
    parser.add_argument("--type", default="q4_0", help="GGUF file type of the model")
    parser.add_argument("--counts", type=int, nargs="*", help="default: top_k, 3/4, 1/2, 1/4")
    parser.add_argument("--batches", type=int, nargs="*", default=[4])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--eval-tokens", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = model_files(args.shape, int(args.params), args.vocab, [args.type])[args.type]
    runners = {"zcode": ZCodeRunner("auto", model=path)}
    runners["zcode compiled"] = ZCodeRunner("auto", True, path)
    llm = runners["zcode"].llm
    top_k = moe_layers(llm.model)[0].gate.top_k
    counts = args.counts or sorted({top_k, *(max(1, round(top_k * s)) for s in (0.75, 0.5, 0.25))},
                                   reverse=True)  # fmt: skip
    if counts[0] != top_k:
        sys.exit(f"--counts must start with the router's top_k ({top_k}): the quality baseline")
    tokenizer = llm.tokenizer
    held_out = corpus_tokens(tokenizer, "heldout", args.eval_tokens)
    prompts = [tokenizer.encode(p) for p in SHORT_PROMPTS[:5]]
    batches = {b: [tokenizer.encode(f"{i}. {SHORT_PROMPTS[i % 5]}") for i in range(b)]
               for b in args.batches}  # fmt: skip
    print(f"{path.name}: top_k {top_k}, counts {counts}, {args.threads} threads")
    print("quality against all experts ...")
    qualities = quality(llm, counts, held_out, prompts, args.new_tokens)
    predicted = {count: predicted_tok_s(llm, count) for count in counts}
    speed = measure(runners, counts, tokenizer.encode(SHORT_PROMPTS[0]), batches, args)
    results = {"file": str(path), "threads": args.threads, "counts": counts, "speed": speed,
               "quality": qualities, "predicted_tok_s": predicted}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    headers = ["experts/token", "engine", *(f"decode b{b} tok/s min / median" for b in
               [1, *batches]), "vs all experts (b1 median)", "predicted b1", "measured / pred",
               "ppl ratio", "top-1 agree", "greedy agree"]  # fmt: skip
    rows = []
    for count in counts:
        for name in runners:
            cells = [speed[f"{name}|{count}|{b}"] for b in [1, *batches]]
            base = speed[f"{name}|{counts[0]}|1"]["median"]
            q, p = qualities[count], predicted[count]
            eager = name == "zcode" and p
            vs_predicted = f"{cells[0]['median'] / p:.2f}" if eager else ""
            rows.append((str(count), name, *(f"{c['min']:.1f} / {c['median']:.1f}" for c in cells),
                         f"{cells[0]['median'] / base:.2f}x",
                         f"{p:.1f}" if eager else "", vs_predicted,
                         f"{q['ppl_ratio']:.4f}", f"{q['top1_agreement']:.3f}",
                         f"{q['greedy_agreement']:.3f}"))  # fmt: skip
    print_rows(headers, rows)
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
