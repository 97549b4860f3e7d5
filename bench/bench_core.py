"""Core benchmark: ZCode against HF transformers and llama.cpp on SmolLM2-135M, one run.

Every engine loads the same file, the embedded SmolLM2-135M-Instruct Q4_1 GGUF: ZCode and HF
dequantize it (fp32, and bf16 for ZCode), llama.cpp runs it as is. Decode speed is set against a
roofline from the memory bandwidth measured in the same run: bandwidth / bytes of weights read
per token.

    .venv/bin/python bench/bench_core.py [--repeats 3] [--quick] [--engines zcode-fp32,hf-fp32]

Timing. Each generation call records the wall time from the call to its first new token (TTFT:
the prefill plus one sample) and from the first to the last new token. Prefill tok/s is
prompt_len / TTFT for a prompt_len-token prompt and one new token. Decode runs N new tokens per
sequence after a short prompt; between the first and the last token there are exactly N - 1
forward passes of B tokens, so decode tok/s = B * (N - 1) / (t_last - t_first), free of prefill.
Engines run round-robin within each repeat so that load from other jobs hits them alike.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from table_format import print_rows

NUM_THREADS = 2
RESULTS_PATH = Path(__file__).parent / "results" / "core.json"
ENGINES = (
    "zcode-fp32",
    "zcode-bf16",
    "zcode-fp32-compiled",
    "zcode-bf16-compiled",
    "hf-fp32",
    "llama.cpp",
)
SHORT_PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain in one sentence what a KV cache is.",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the mountains,",
    "List three uses of a paperclip:",
    "Translate to German: The weather is nice today.",
    "Q: What is 17 times 23?\nA:",
)
LONG_TEXT = (
    "Large language models generate text one token at a time. Each step reads every weight of "
    "the network from memory, so on a CPU the speed of decoding is set by memory bandwidth, "
    "while processing the prompt is a matrix multiplication bound by arithmetic. "
)


@dataclass(frozen=True)
class Timing:
    ttft_s: float  # call -> first new token (summed over sequences run one after another)
    decode_s: float  # first -> last new token (summed likewise)
    token_ids: list[list[int]]


class ZCodeRunner:
    batch_mode = "batched"

    def __init__(
        self,
        dtype: str,
        compile: bool = False,
        model: Path | None = None,
        kv_cache_dtype: str = "auto",
        max_prompt_len: int = 2048,
    ) -> None:
        from zcode import LLM

        # Repeats reuse the same prompts: without this the prefix cache would skip their prefill.
        self.llm = LLM(
            model,
            dtype=dtype,
            enable_prefix_caching=False,
            compile=compile,
            kv_cache_dtype=kv_cache_dtype,
            max_num_batched_tokens=max(2048, max_prompt_len),  # a prompt's prefill in one step
        )
        self.format = dtype + (" compiled decode" if compile else "")
        self.bytes_per_token = _param_bytes(self.llm.model)

    def run(self, prompts: list[list[int]], num_new: int) -> Timing:
        from zcode import SamplingParams

        engine = self.llm.engine
        params = SamplingParams(max_tokens=num_new, temperature=0, ignore_eos=True)
        seqs = [engine.add_request(p, params) for p in prompts]
        start = time.perf_counter()
        engine.step()  # prefills every prompt (they fit max_num_batched_tokens) and samples
        first = time.perf_counter()
        if any(s.num_output_tokens != 1 for s in seqs):
            raise RuntimeError("the prefill took more than one step; raise max_num_batched_tokens")
        while engine.has_unfinished():
            engine.step()
        last = time.perf_counter()
        return Timing(first - start, last - first, [s.output_token_ids for s in seqs])


class HFRunner:
    batch_mode = "batched (left padding)"

    def __init__(self, path: Path, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype
        ).eval()
        self.format = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        self.pad_id = tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = tokenizer.eos_token_id
        self.bytes_per_token = _param_bytes(self.model)
        self.tied = (
            self.model.lm_head.weight.data_ptr() == self.model.model.embed_tokens.weight.data_ptr()
        )

    def run(self, prompts: list[list[int]], num_new: int) -> Timing:
        from transformers import LogitsProcessor, LogitsProcessorList

        class Stamps(LogitsProcessor):
            """Called once per forward pass, right after it: the first call ends the prefill."""

            def __init__(self) -> None:
                self.times: list[float] = []

            def __call__(self, input_ids, scores):
                self.times.append(time.perf_counter())
                return scores

        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.int64)
        attention_mask = torch.zeros_like(input_ids)
        for row, p in enumerate(prompts):
            input_ids[row, width - len(p) :] = torch.tensor(p)
            attention_mask[row, width - len(p) :] = 1
        stamps = Stamps()
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                min_new_tokens=num_new,
                max_new_tokens=num_new,
                pad_token_id=self.pad_id,
                logits_processor=LogitsProcessorList([stamps]),
            )
        last = time.perf_counter()
        first = stamps.times[0]
        return Timing(first - start, last - first, out[:, width:].tolist())


class LlamaCppRunner:
    # llama-cpp-python's high-level API holds one sequence: batch B is B generations in a row.
    batch_mode = "sequential"
    format = "Q4_1 (file)"

    def __init__(self, path: Path, logits_all: bool = False, context_len: int = 2048) -> None:
        llama_cpp = _import_llama_cpp()
        # ggml's AMX kernels fault (ldtilecfg: general protection) in this machine kind's VM,
        # which advertises AMX; without extra buffer types ggml runs its plain CPU kernels,
        # as it does on CPUs without AMX (Q4_1 has no repacked kernel either way).
        self.use_extra_bufts = not _cpu_has("amx_tile")
        default_params = llama_cpp.llama_cpp.llama_model_default_params

        def model_params():
            params = default_params()
            params.use_extra_bufts = self.use_extra_bufts
            return params

        llama_cpp.llama_cpp.llama_model_default_params = model_params
        try:
            self.llm = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=context_len,
                n_batch=512,
                n_threads=NUM_THREADS,
                n_threads_batch=NUM_THREADS,
                logits_all=logits_all,
                verbose=False,
            )
        finally:
            llama_cpp.llama_cpp.llama_model_default_params = default_params
        from gguf import GGUFReader

        # token_embd is read by the output layer too (tied): counted once, like the others.
        self.bytes_per_token = sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)

    def run(self, prompts: list[list[int]], num_new: int) -> Timing:
        ttft_s = decode_s = 0.0
        outputs = []
        for p in prompts:
            self.llm.reset()  # n_tokens = 0: no KV prefix reuse from the previous call
            tokens: list[int] = []
            start = time.perf_counter()
            for token in self.llm.generate(p, top_k=1, temp=0.0, repeat_penalty=1.0):
                tokens.append(token)
                if len(tokens) == 1:
                    first = time.perf_counter()
                if len(tokens) == num_new:
                    break
            last = time.perf_counter()
            ttft_s += first - start
            decode_s += last - first
            outputs.append(tokens)
        return Timing(ttft_s, decode_s, outputs)


def _import_llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        print("llama_cpp missing: pip install llama-cpp-python (a source build takes ~15 min)")
        subprocess.run([sys.executable, "-m", "pip", "install", "llama-cpp-python"], check=True)
        import llama_cpp
    return llama_cpp


def _param_bytes(model: torch.nn.Module) -> int:
    # parameters() yields a tied lm_head/embedding once; every weight is read once per step.
    return sum(p.numel() * p.element_size() for p in model.parameters())


def measure_bandwidth(num_bytes: int, tries: int) -> float:
    """Best read-only streaming rate in bytes/s: .sum() of an fp32 tensor far above L3."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    x.sum()  # fault the pages in
    best_s = min(_timed(x.sum) for _ in range(tries))
    return num_bytes / best_s


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def build_prompts(path: Path, prompt_len: int, batch: int) -> tuple[list[int], list[list[int]]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    long_ids: list[int] = []
    while len(long_ids) < prompt_len:
        long_ids += tokenizer.encode(LONG_TEXT, add_special_tokens=False)
    short = [tokenizer.encode(t, add_special_tokens=False) for t in SHORT_PROMPTS]
    return long_ids[:prompt_len], [short[i % len(short)] for i in range(batch)]


def load_engine(name: str, path: Path):
    if name == "zcode-fp32":
        return ZCodeRunner("float32")
    if name == "zcode-bf16":
        return ZCodeRunner("bfloat16")
    if name == "zcode-fp32-compiled":
        return ZCodeRunner("float32", compile=True)
    if name == "zcode-bf16-compiled":
        return ZCodeRunner("bfloat16", compile=True)
    if name == "hf-fp32":
        return HFRunner(path)
    return LlamaCppRunner(path)


def _stats(values: list[float]) -> dict[str, float]:
    # tok/s from the min time (the best) and from the median time
    return {"best": max(values), "median": statistics.median(values)}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _fmt_pair(s: dict[str, float] | None) -> str:
    return "n/a" if s is None else f"{s['best']:.1f}/{s['median']:.1f}"


def print_table(results: list[dict], bandwidth: float) -> None:
    headers = (
        "engine",
        "format",
        "MB/token",
        "prefill tok/s",
        "decode b1 tok/s",
        "decode b8 tok/s",
        "roofline b1",
        "roofline frac",
        "vs HF fp32 (b1/b8)",
    )
    rows = []
    for r in results:
        ratio = r.get("ratio_vs_hf_fp32")
        ratio_text = "n/a" if ratio is None else f"{ratio['b1']:.2f}x/{ratio['b8']:.2f}x"
        b8 = _fmt_pair(r["decode_b8"])
        if r["batch_mode"] == "sequential":
            b8 += " (8 seq)"
        rows.append(
            (
                r["engine"],
                r["format"],
                f"{r['bytes_per_token'] / 1e6:.0f}",
                _fmt_pair(r["prefill"]),
                _fmt_pair(r["decode_b1"]),
                b8,
                f"{r['roofline_b1_tok_s']:.1f}",
                f"{r['roofline_fraction_b1']:.0%}",
                ratio_text,
            )
        )
    print_rows(headers, rows)
    print(
        f"tok/s as best/median over repeats (best = from the min time). Roofline = "
        f"{bandwidth / 1e9:.1f} GB/s / bytes read per token (weights only; KV reads excluded). "
        "Roofline fraction and ratios use medians."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke run: few tokens, 1 repeat")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"subset of {ENGINES}")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.prompt_len, args.new_tokens = 1, 128, 16
    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    unknown = sorted(set(names) - set(ENGINES))
    if unknown:
        parser.error(f"unknown engines {unknown}; choose from {ENGINES}")
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 to time decoding")

    torch.set_num_threads(NUM_THREADS)
    from zcode.loader.checkpoint import resolve_model_path

    path = resolve_model_path(None)
    load_start = os.getloadavg()
    bw_tries = 2 if args.quick else 5
    bandwidth_start = measure_bandwidth(1 << 30, bw_tries)
    print(
        f"memory bandwidth (torch .sum of 1 GiB fp32, {NUM_THREADS} threads): "
        f"{bandwidth_start / 1e9:.1f} GB/s; load average {load_start}"
    )
    long_prompt, short_prompts = build_prompts(path, args.prompt_len, args.batch)

    engines, skipped = {}, {}
    for name in names:
        start = time.perf_counter()
        try:
            engines[name] = load_engine(name, path)
        except Exception as e:  # a peer that cannot load is reported, not fatal
            if name != "llama.cpp":
                raise
            skipped[name] = repr(e)
            print(f"{name}: skipped ({e!r})")
            continue
        engine = engines[name]
        engine.run([long_prompt], 1)  # warm-up, once per shape
        engine.run(short_prompts[:1], 4)
        engine.run(short_prompts, 4)
        print(f"{name}: loaded and warmed up in {time.perf_counter() - start:.1f} s")

    samples = {n: {"prefill": [], "decode_b1": [], "decode_b8": []} for n in engines}
    cpu_start = _cpu_seconds()
    outputs_b1: dict[str, list[int]] = {}
    for repeat in range(args.repeats):
        for name, engine in engines.items():
            t = engine.run([long_prompt], 1)
            samples[name]["prefill"].append(args.prompt_len / t.ttft_s)
            t = engine.run(short_prompts[:1], args.new_tokens)
            samples[name]["decode_b1"].append((args.new_tokens - 1) / t.decode_s)
            outputs_b1[name] = t.token_ids[0]
            t = engine.run(short_prompts, args.new_tokens)
            if any(len(ids) != args.new_tokens for ids in t.token_ids):
                raise RuntimeError(f"{name}: did not generate {args.new_tokens} tokens per prompt")
            samples[name]["decode_b8"].append(
                len(short_prompts) * (args.new_tokens - 1) / t.decode_s
            )
            s = samples[name]
            print(
                f"repeat {repeat + 1}/{args.repeats} {name}: prefill {s['prefill'][-1]:.1f}, "
                f"b1 {s['decode_b1'][-1]:.1f}, b{args.batch} {s['decode_b8'][-1]:.1f} tok/s"
            )

    others_cores = _others_cores(cpu_start, _cpu_seconds())
    bandwidth_end = measure_bandwidth(1 << 30, bw_tries)
    bandwidth = max(bandwidth_start, bandwidth_end)
    load_end = os.getloadavg()

    results = []
    for name, engine in engines.items():
        roofline = bandwidth / engine.bytes_per_token
        stats = {k: _stats(v) for k, v in samples[name].items()}
        results.append(
            {
                "engine": name,
                "format": engine.format,
                "batch_mode": engine.batch_mode,
                "bytes_per_token": engine.bytes_per_token,
                **stats,
                "samples_tok_s": samples[name],
                "roofline_b1_tok_s": roofline,
                "roofline_fraction_b1": stats["decode_b1"]["median"] / roofline,
                "roofline_fraction_b8": stats["decode_b8"]["median"] / (roofline * args.batch),
            }
        )
    hf = next((r for r in results if r["engine"] == "hf-fp32"), None)
    for r in results:
        if hf is not None:
            r["ratio_vs_hf_fp32"] = {
                k: r[f"decode_{k}"]["median"] / hf[f"decode_{k}"]["median"] for k in ("b1", "b8")
            } | {"prefill": r["prefill"]["median"] / hf["prefill"]["median"]}
    reference = outputs_b1.get("zcode-fp32")
    parity = (
        {name: common_prefix(ids, reference) for name, ids in outputs_b1.items()}
        if reference
        else {}
    )

    print()
    print_table(results, bandwidth)
    print(
        f"batch {args.batch} decode: {args.new_tokens} new tokens per prompt; llama.cpp's "
        "high-level API has no batching, so its b8 runs the 8 prompts one after another."
    )
    if parity:
        print(
            f"greedy b1 tokens matching zcode-fp32 (of {args.new_tokens}): {parity}; HF's "
            "min_new_tokens masks EOS, which ZCode's ignore_eos still samples, so HF parts at "
            "ZCode's first EOS; llama.cpp's Q4_1 x Q8_1 dot products part at near-ties."
        )
    # Per ZCode fp32 configuration: eager (the default) and compiled decode (LLM(compile=True)).
    acceptance = {}
    for r in results:
        if r["engine"] not in ("zcode-fp32", "zcode-fp32-compiled") or hf is None:
            continue
        ratio = r["ratio_vs_hf_fp32"]
        verdict = {
            "b1_ratio": ratio["b1"],
            "b1_pass": ratio["b1"] >= 1.5,
            "b8_ratio": ratio["b8"],
            "b8_pass": ratio["b8"] >= 1.0,
        }
        acceptance[r["engine"]] = verdict
        print(
            f"acceptance: {r['engine']} decode b1 {ratio['b1']:.2f}x HF fp32 (need >= 1.5x): "
            f"{'PASS' if verdict['b1_pass'] else 'FAIL'}; b{args.batch} {ratio['b8']:.2f}x "
            f"(need >= 1.0x): {'PASS' if verdict['b8_pass'] else 'FAIL'}"
        )
    print(
        f"bandwidth start/end {bandwidth_start / 1e9:.1f}/{bandwidth_end / 1e9:.1f} GB/s; "
        f"load average start {load_start}, end {load_end}; other processes used "
        f"{others_cores:.2f} of {os.cpu_count()} cores on average while engines were timed"
    )

    report = {
        "config": vars(args)
        | {"output": str(args.output), "model": str(path), "threads": NUM_THREADS},
        "machine": {
            "processor": _cpuinfo("model name") or platform.processor(),
            "cpus": os.cpu_count(),
            "flags_of_note": [
                f for f in ("avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if _cpu_has(f)
            ],
            "python": platform.python_version(),
            "torch": torch.__version__,
            "load_average_start": load_start,
            "load_average_end": load_end,
            "others_cores_while_timed": others_cores,
        },
        "bandwidth_bytes_per_s": {
            "start": bandwidth_start,
            "end": bandwidth_end,
            "used": bandwidth,
        },
        "engines": results,
        "skipped": skipped,
        "greedy_b1_prefix_match_vs_zcode_fp32": parity,
        "hf_lm_head_tied": getattr(engines.get("hf-fp32"), "tied", None),
        "llama_cpp_use_extra_bufts": getattr(engines.get("llama.cpp"), "use_extra_bufts", None),
        "acceptance": acceptance,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}")


def _cpu_seconds() -> tuple[float, float, float]:
    """(wall, busy CPU seconds of the whole machine, CPU seconds of this process)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = sum(fields[:8]) - fields[3] - fields[4]  # all but idle and iowait
    own = os.times()
    return time.perf_counter(), busy / os.sysconf("SC_CLK_TCK"), own.user + own.system


def _others_cores(start: tuple[float, float, float], end: tuple[float, float, float]) -> float:
    # Contention evidence: cores kept busy by other processes, averaged over the interval.
    wall, busy, own = (e - s for s, e in zip(start, end, strict=True))
    return max(0.0, busy - own) / wall


def _cpuinfo(key: str) -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_has(flag: str) -> bool:
    return flag in _cpuinfo("flags").split()


if __name__ == "__main__":
    main()
