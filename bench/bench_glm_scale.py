"""A GLM-4.5-Air- or GLM-5-shaped MoE at scale: ZCode against llama.cpp on the same GGUF file.

The model is scripts/make_glm_synthetic.py's --shape (glm45-air, default, or glm5: MLA + DSA +
MoE) at --params (default 1.3B; glm45-air: ~64 experts of which 8 routed + 1 shared, hidden
1024, SmolLM2's tokenizer), made once and cached under ~/.cache/zcode/bench/glm-scale/. For
each file type (bf16, Q4_0 by default) and thread count (1 and 2), both engines load the same
file and run, round-robin within each repeat:

- batch-1 decode: --new-tokens greedy tokens after a short prompt (or after --decode-after
  tokens of context), tok/s;
- prefill: one --prompt-len-token prompt, tok/s;
- --batches 4 16: ZCode's decode of that many sequences at once (distinct prompts), tok/s over
  all of them. llama-cpp-python's API holds one sequence (B sequences run one after another,
  its batch-1 speed), so llama.cpp runs at batch 1 only;

with --compile, ZCode's compiled decode as a third engine (its graphs compiled in the warm-up),

reported as min / median over --repeats (>= 3 for figures), beside the decode tok/s `zcode info`'s
fit planner predicts for that file type on this machine (its fitted cost model, else the
read-bandwidth roofline; the column says which) at the decode's mean context (its prompt and
half its new tokens) and the measured / predicted ratio: for the eager engine at the thread count
the cost model was fitted at (the hardware probe's).

    .venv/bin/python bench/bench_glm_scale.py [--shape glm5] [--params 1.3B] [--types bf16 q4_0] \
        [--threads 1 2] [--compile] [--batches 4 16]
    .venv/bin/python bench/bench_glm_scale.py --params 3M --vocab 256 --repeats 1 --new-tokens 8 \\
        --prompt-len 32 --threads 1      # smoke run on a tiny model
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import bench_core
import torch
from bench_core import SHORT_PROMPTS, LlamaCppRunner, ZCodeRunner
from table_format import print_rows

from zcode.hardware.probe import read_bandwidth_gbps

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # scripts/, run as a script
from scripts import make_glm_synthetic as synthetic  # noqa: E402

CACHE_DIR = Path.home() / ".cache" / "zcode" / "bench" / "glm-scale"
RESULTS_PATH = Path(__file__).parent / "results" / "glm_scale.json"
SHORT_PROMPT = "Write a short poem about the sea."


def model_files(shape: str, params: int, vocab: int | None, types: list[str]) -> dict[str, Path]:
    """The cached checkpoint of this shape and `params` and its GGUF files, made where missing."""
    hf_dir = CACHE_DIR / f"{shape}-{params}-v{vocab or 'smollm2'}" / "hf"
    if not (hf_dir / "config.json").is_file():
        print(f"making {hf_dir} ...")
        synthetic.make_checkpoint(shape, params, hf_dir, vocab)
    paths = {t: hf_dir.parent / f"hf-{t}.gguf" for t in types}
    if missing := [t for t, p in paths.items() if not p.is_file()]:
        print(f"making {', '.join(missing)} GGUF files ...")
        synthetic.make_gguf_files(hf_dir, missing)
    return {"hf": hf_dir, **paths}


def predicted_tok_s(hf_dir: Path, context_len: int) -> tuple[dict[str, float], str, int, float]:
    """{file type: eager decode tok/s} from `zcode info`'s fit planner, what predicted it, the
    threads it predicts for (the cost model's steps were timed at the probe's) and the read
    bandwidth they were timed at (0: not recorded)."""
    from zcode.hardware import probe
    from zcode.hardware.cost_model import CostModel
    from zcode.info import FitOptions, model_info

    hardware = probe()
    options = FitOptions(
        context_len=context_len,
        cost=CostModel.cached(hardware),
        read_bandwidth_gbps=hardware.read_bandwidth_gbps,
    )
    fit = model_info(hf_dir, options).fit
    fit_gbps = (options.cost and options.cost.fit_read_gbps) or 0.0
    predicted = {r.file_type: r.decode_tok_s for r in fit.formats}
    return predicted, fit.predictor, hardware.num_threads, fit_gbps


def measure(runners: dict, long_prompt: list[int], decode_prompt: list[int], batches, args) -> dict:
    """{engine: {kind: min, median, samples}}, kinds prefill, decode and decode bB (ZCode);
    batches: {B: B prompts}."""
    kinds = {name: ["prefill", "decode"] for name in runners}
    for name in runners:
        if name.startswith("zcode"):
            kinds[name] += [f"decode b{b}" for b in batches]
    samples = {name: {kind: [] for kind in kinds[name]} for name in runners}
    for name, runner in runners.items():  # warm-up: compiled graphs for each batch size too
        start = time.perf_counter()
        runner.run([long_prompt[:16]], 2)
        for prompts in batches.values() if name.startswith("zcode") else ():
            runner.run(prompts, 3)
        print(f"  {name} warm-up {time.perf_counter() - start:.1f} s")
    for repeat in range(args.repeats):
        for name, runner in runners.items():
            t = runner.run([long_prompt], 1)
            samples[name]["prefill"].append(len(long_prompt) / t.ttft_s)
            t = runner.run([decode_prompt], args.new_tokens)
            samples[name]["decode"].append((args.new_tokens - 1) / t.decode_s)
            for b, prompts in batches.items() if name.startswith("zcode") else ():
                t = runner.run(prompts, args.new_tokens)
                samples[name][f"decode b{b}"].append(b * (args.new_tokens - 1) / t.decode_s)
            latest = ", ".join(f"{k} {v[-1]:.1f}" for k, v in samples[name].items())
            print(f"  repeat {repeat + 1} {name}: {latest} tok/s")
    return {
        name: {k: {"min": min(v), "median": statistics.median(v), "samples": v}
               for k, v in kinds.items()}
        for name, kinds in samples.items()
    }  # fmt: skip


def run(args) -> dict:
    files = model_files(args.shape, args.params, args.vocab, args.types)
    results = {"shape": args.shape, "params": args.params, "runs": []}
    results["read_gbps"] = [read_bandwidth_gbps()]
    predicted = None
    for file_type in args.types:
        for threads in args.threads:
            torch.set_num_threads(threads)
            bench_core.NUM_THREADS = threads  # LlamaCppRunner reads it when constructed
            longest = max(args.prompt_len, args.decode_after)
            runners = {"zcode": ZCodeRunner("auto", model=files[file_type], max_prompt_len=longest)}
            if args.compile:
                runners["zcode compiled"] = ZCodeRunner(
                    "auto", True, files[file_type], max_prompt_len=longest
                )
            context_len = max(2048, longest + args.new_tokens + 16)
            runners["llama.cpp"] = LlamaCppRunner(files[file_type], context_len=context_len)
            tokenizer = runners["zcode"].llm.tokenizer
            ids = tokenizer.encode(SHORT_PROMPT * 200, add_special_tokens=False)
            while len(ids) < longest:
                ids += ids
            long_prompt = ids[: args.prompt_len]
            decode_prompt = (
                ids[: args.decode_after]
                if args.decode_after
                else tokenizer.encode(SHORT_PROMPT, add_special_tokens=False)
            )
            if predicted is None:  # at the decode's mean context
                mean_context = len(decode_prompt) + args.new_tokens // 2
                predicted, predictor, fit_threads, fit_gbps = predicted_tok_s(
                    files["hf"], mean_context
                )
                # The host's bandwidth moves: the prediction holds at the fit's, the runs see
                # what is now.
                results |= {"predictor": predictor, "fit_read_gbps": fit_gbps}
            batches = {
                b: [
                    tokenizer.encode(f"{i}. {SHORT_PROMPTS[i % len(SHORT_PROMPTS)]}")
                    for i in range(b)
                ]
                for b in args.batches
            }
            print(f"\n{file_type}, {threads} thread(s)")
            speed = measure(runners, long_prompt, decode_prompt, batches, args)
            results["runs"].append(
                {"file_type": file_type, "threads": threads, "speed": speed,
                 "predicted_decode_tok_s": predicted[file_type] if threads == fit_threads
                 else None}
            )  # fmt: skip
            del runners
    results["read_gbps"].append(read_bandwidth_gbps())
    return results


def print_table(results: dict) -> None:
    headers = ["file", "threads", "engine", "decode tok/s min / median",
               "prefill tok/s min / median", f"predicted decode ({results['predictor']})",
               "measured / predicted (median)"]  # fmt: skip
    kinds = {k for r in results["runs"] for k in r["speed"]["zcode"]} - {"decode", "prefill"}
    batch_kinds = sorted(kinds, key=lambda k: int(k[len("decode b") :]))
    headers[4:4] = [f"{k} tok/s min / median" for k in batch_kinds]
    rows = []
    for run_ in results["runs"]:
        prediction = run_["predicted_decode_tok_s"]
        for engine, speed in run_["speed"].items():
            d, p = speed["decode"], speed["prefill"]
            is_ours = engine == "zcode" and prediction  # the eager engine at the fit's threads
            batched = [f"{speed[k]['min']:.1f} / {speed[k]['median']:.1f}" if k in speed else "-"
                       for k in batch_kinds]  # fmt: skip
            rows.append(
                (run_["file_type"], str(run_["threads"]), engine,
                 f"{d['min']:.1f} / {d['median']:.1f}", *batched,
                 f"{p['min']:.1f} / {p['median']:.1f}",
                 f"{prediction:.1f}" if is_ours else "",
                 f"{d['median'] / prediction:.3g}" if is_ours else "")
            )  # fmt: skip
    print_rows(headers, rows)
    now = "-".join(f"{gbps:.1f}" for gbps in sorted(results["read_gbps"]))
    fit = results["fit_read_gbps"]
    print(f"read bandwidth before / after the runs {now} GB/s; the cost model's steps were timed "
          f"at {f'{fit:.1f} GB/s' if fit else 'a bandwidth not recorded'}")  # fmt: skip
    for run_ in results["runs"]:
        speed = run_["speed"]
        for engine in (e for e in speed if e.startswith("zcode")):
            ratio = {k: speed[engine][k]["median"] / speed["llama.cpp"][k]["median"]
                     for k in ("decode", "prefill")}  # fmt: skip
            print(f"{run_['file_type']} x{run_['threads']}: {engine} / llama.cpp decode "
                  f"{ratio['decode']:.2f}x, prefill {ratio['prefill']:.2f}x (medians)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(synthetic.SHAPES), default="glm45-air")
    parser.add_argument(
        "--params", type=synthetic.parse_count, default=synthetic.parse_count("1.3B")
    )
    parser.add_argument("--vocab", type=int, help="vocabulary (default: SmolLM2's + GLM's)")
    parser.add_argument("--types", nargs="+", default=["bf16", "q4_0"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="ZCode's compiled decode too")
    parser.add_argument("--batches", type=int, nargs="*", default=[], help="ZCode decode batches")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument(
        "--decode-after",
        type=int,
        default=0,
        help="decode after that many tokens of the long prompt (default: a short prompt)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS_PATH, help="results JSON")
    args = parser.parse_args()
    results = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print()
    print_table(results)
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
