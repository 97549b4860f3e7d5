"""Serving benchmark: `zcode serve` against llama.cpp's server under concurrent streams, one run.

Both servers load the same file, the embedded SmolLM2-135M-Instruct Q4_1 GGUF, and run as
subprocesses on free loopback ports: ZCode with its defaults (fp32 weights, continuous
batching), llama.cpp through `llama_cpp.server` (bench/llama_cpp_server.py, which works around
the AMX fault of this machine kind) with 2 threads. llama-cpp-python's server has one llama
context and serves one request at a time behind a lock (no parallel slots); it is run with
interrupt_requests off, so queued requests wait instead of cutting the running stream short.

    .venv/bin/python bench/bench_serving.py [--repeats 2] [--quick] [--levels 1,4,16,64]
        [--engines zcode,llama.cpp]

Load. At each concurrency level C, C client tasks stream /v1/completions requests (greedy,
max_tokens new tokens, every prompt unique so no prefix is reused across requests) until
max(2C, 8) requests are done; both servers generate exactly max_tokens tokens (ZCode with
ignore_eos, llama.cpp with min_tokens). Output tok/s = output tokens / wall time from the first
request sent to the last finished. TTFT is the time from sending a request to its first chunk
with text, so it includes queueing; ITL is the gap between consecutive text chunks (one chunk
per token for both servers, except where a token ends inside a UTF-8 character). Output tokens
come from usage (ZCode's stream_options.include_usage), else from finish_reason "length".
Levels alternate engines within each repeat, so load from other jobs hits them alike.
"""

import argparse
import asyncio
import importlib.metadata
import importlib.util
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import openai
from table_format import print_rows

NUM_THREADS = 2
RESULTS_DIR = Path(__file__).parent / "results"
RESULTS_PATH = RESULTS_DIR / "serving.json"
ENGINES = ("zcode", "llama.cpp")
LEVELS = (1, 4, 16, 64)
QUICK_LEVELS = (1, 4)
ACCEPTANCE_LEVEL, ACCEPTANCE_TARGET = 16, 2.0
TOPICS = (
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a steam engine works, step by step.",
    "Describe a walk through a busy market in a coastal town at dawn.",
    "Write a detailed guide to planting a vegetable garden in spring.",
    "Tell the history of the printing press and how it changed Europe.",
    "Describe how a compiler turns source code into machine code.",
    "Write a letter from a traveller crossing a desert with a caravan.",
    "Explain why the sky is blue and why sunsets are red.",
)


@dataclass(frozen=True)
class RequestRecord:
    error: str | None
    num_output_tokens: int
    token_source: str  # "usage", "length" (finish_reason at max_tokens) or "chunks"
    finish_reason: str | None
    ttft_s: float | None
    itl_s: list[float]
    latency_s: float


@dataclass(frozen=True)
class LevelRun:
    engine: str
    concurrency: int
    repeat: int
    wall_s: float
    records: list[RequestRecord]

    @property
    def output_tok_s(self) -> float:
        return sum(r.num_output_tokens for r in self.records) / self.wall_s


class ServerProcess:
    """One server subprocess in a session of its own; stop() ends its whole process group."""

    def __init__(self, name: str, argv: list[str], port: int, log_path: Path, env: dict) -> None:
        self.name, self.port, self.log_path = name, port, log_path
        self.base_url = f"http://127.0.0.1:{port}"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def wait_ready(self, timeout_s: float) -> str:
        """Polls /v1/models until it answers; returns the served model's id."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=5) as resp:
                    return json.loads(resp.read())["data"][0]["id"]
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def cpu_seconds(self) -> float:
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def log_tail(self, num_lines: int = 30) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                continue


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_llama_cpp_server() -> str:
    """llama-cpp-python's server extra, installed on demand; returns the mode it serves in."""
    needed = ("sse_starlette", "starlette_context", "pydantic_settings")
    if any(importlib.util.find_spec(m) is None for m in needed):
        version = importlib.metadata.version("llama_cpp_python")
        print(f"installing llama-cpp-python[server]=={version} (the server's dependencies)")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", f"llama-cpp-python[server]=={version}"],
            check=True,
        )
    from llama_cpp.server.settings import ModelSettings

    slots = [f for f in ("n_parallel", "n_seq_max", "parallel") if f in ModelSettings.model_fields]
    return f"parallel slots ({slots[0]})" if slots else "sequential server (one request at a time)"


def start_server(name: str, model_path: Path, max_num_seqs: int) -> ServerProcess:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(NUM_THREADS))
    if name == "zcode":
        argv = [str(Path(sys.executable).with_name("zcode")), "serve", str(model_path)]
        argv += ["--port", str(port), "--max-num-seqs", str(max_num_seqs)]
        argv += ["--shutdown-timeout", "5"]
    else:
        argv = [sys.executable, str(Path(__file__).with_name("llama_cpp_server.py"))]
        argv += ["--model", str(model_path), "--model_alias", "smollm2"]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048"]
        argv += ["--n_threads", str(NUM_THREADS), "--n_threads_batch", str(NUM_THREADS)]
        argv += ["--interrupt_requests", "false", "--verbose", "false"]
    log_path = RESULTS_DIR / f"serving_{name.replace('.', '_')}.log"
    return ServerProcess(name, argv, port, log_path, env)


def engine_extra_body(name: str, max_tokens: int) -> dict:
    if name == "zcode":
        return {"ignore_eos": True, "stream_options": {"include_usage": True}}
    return {"min_tokens": max_tokens, "repeat_penalty": 1.0, "top_k": 1}


async def one_request(
    client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int, extra_body: dict
) -> RequestRecord:
    start = time.perf_counter()
    text_times: list[float] = []
    usage_tokens = finish_reason = None
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        extra_body=extra_body,
    )
    async with stream:
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                usage_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.text:
                    text_times.append(now)
                finish_reason = choice.finish_reason or finish_reason
    end = time.perf_counter()
    if usage_tokens is not None:
        num_tokens, source = usage_tokens, "usage"
    elif finish_reason == "length":
        num_tokens, source = max_tokens, "length"
    else:
        num_tokens, source = len(text_times), "chunks"
    return RequestRecord(
        error=None,
        num_output_tokens=num_tokens,
        token_source=source,
        finish_reason=finish_reason,
        ttft_s=text_times[0] - start if text_times else None,
        itl_s=[b - a for a, b in zip(text_times, text_times[1:], strict=False)],
        latency_s=end - start,
    )


async def run_level(
    client: openai.AsyncOpenAI,
    engine: str,
    model: str,
    concurrency: int,
    num_requests: int,
    max_tokens: int,
    timeout_s: float,
    prompts: "PromptSource",
    repeat: int,
) -> LevelRun:
    """`concurrency` tasks each send one request after another until num_requests are done."""
    todo = [prompts.next() for _ in range(num_requests)]
    records: list[RequestRecord] = []
    extra_body = engine_extra_body(engine, max_tokens)

    async def worker() -> None:
        while todo:
            prompt = todo.pop()
            start = time.perf_counter()
            try:
                record = await asyncio.wait_for(
                    one_request(client, model, prompt, max_tokens, extra_body), timeout_s
                )
            except Exception as e:  # a failed request is counted and reported, not fatal
                error = "timeout" if isinstance(e, TimeoutError) else repr(e)
                latency = time.perf_counter() - start
                record = RequestRecord(error, 0, "none", None, None, [], latency)
            records.append(record)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return LevelRun(engine, concurrency, repeat, time.perf_counter() - start, records)


class PromptSource:
    """Every prompt starts with a number never used before, so no prefix is shared."""

    def __init__(self) -> None:
        self.count = 0

    def next(self) -> str:
        self.count += 1
        return f"Request {self.count}. {TOPICS[self.count % len(TOPICS)]}\n\n"


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(runs: list[LevelRun]) -> dict:
    """Throughput per repeat; latencies pooled over the repeats' requests."""
    records = [r for run in runs for r in run.records]
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [gap for r in ok for gap in r.itl_s]
    tok_s = [run.output_tok_s for run in runs]
    return {
        "num_requests": len(runs[0].records),
        "num_failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "finish_reasons": sorted({str(r.finish_reason) for r in ok}),
        "token_sources": sorted({r.token_source for r in ok}),
        "output_tokens_per_request": sorted({r.num_output_tokens for r in ok}),
        "output_tok_s": {"min": min(tok_s), "median": statistics.median(tok_s)},
        "samples_output_tok_s": tok_s,
        "wall_s": [run.wall_s for run in runs],
        "ttft_ms": {"p50": _ms(percentile(ttft, 0.5)), "p99": _ms(percentile(ttft, 0.99))},
        "itl_ms": {"p50": _ms(percentile(itl, 0.5)), "p99": _ms(percentile(itl, 0.99))},
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _fmt(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def print_table(results: dict[str, dict[int, dict]], levels: tuple[int, ...]) -> None:
    headers = (
        "engine",
        "C",
        "req",
        "output tok/s min/med",
        "TTFT p50/p99 ms",
        "ITL p50/p99 ms",
        "vs llama.cpp tok/s",
    )
    rows = []
    for concurrency in levels:
        for engine, by_level in results.items():
            s = by_level.get(concurrency)
            if s is None:
                continue
            req = str(s["num_requests"])
            if s["num_failed"]:
                req += f" ({s['num_failed']} failed)"
            ratio = s.get("ratio_vs_llama_cpp")
            rows.append(
                (
                    engine,
                    str(concurrency),
                    req,
                    f"{s['output_tok_s']['min']:.1f}/{s['output_tok_s']['median']:.1f}",
                    f"{_fmt(s['ttft_ms']['p50'])}/{_fmt(s['ttft_ms']['p99'])}",
                    f"{_fmt(s['itl_ms']['p50'], 1)}/{_fmt(s['itl_ms']['p99'], 1)}",
                    "-" if ratio is None else f"{ratio:.2f}x",
                )
            )
    print_rows(headers, rows)


async def measure(
    servers: dict[str, tuple[ServerProcess, str]], args: argparse.Namespace
) -> dict[str, list[LevelRun]]:
    prompts = PromptSource()
    clients = {
        name: openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=args.timeout
        )
        for name, (server, _) in servers.items()
    }
    runs: dict[str, list[LevelRun]] = {name: [] for name in servers}
    try:
        for name, (_, model) in servers.items():  # warm-up: first requests, first batch shapes
            for concurrency in (1, 4):
                await run_level(
                    clients[name], name, model, concurrency, 4, 8, args.timeout, prompts, -1
                )
        order = list(servers)
        for repeat in range(args.repeats):
            for concurrency in args.levels:
                for name in order:
                    run = await run_level(
                        clients[name],
                        name,
                        servers[name][1],
                        concurrency,
                        max(2 * concurrency, args.min_requests),
                        args.max_tokens,
                        args.timeout,
                        prompts,
                        repeat,
                    )
                    runs[name].append(run)
                    failed = sum(r.error is not None for r in run.records)
                    print(
                        f"repeat {repeat + 1}/{args.repeats} {name} C={concurrency}: "
                        f"{run.output_tok_s:.1f} tok/s, {len(run.records)} requests in "
                        f"{run.wall_s:.1f} s" + (f", {failed} failed" if failed else ""),
                        flush=True,
                    )
            order.reverse()  # neither engine always goes first
    finally:
        for client in clients.values():
            await client.close()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="smoke run: C in 1,4; 16 tokens")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--min-requests", type=int, default=8, help="requests per level, at least")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument(
        "--levels", default=",".join(map(str, LEVELS)), help="concurrency levels, comma-separated"
    )
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"subset of {ENGINES}")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    try:
        args.levels = tuple(int(c) for c in args.levels.split(","))
    except ValueError:
        parser.error(f"--levels must be comma-separated integers, got {args.levels!r}")
    if min(args.levels) < 1:
        parser.error("--levels must be at least 1")
    if args.quick:
        args.levels, args.repeats, args.max_tokens = QUICK_LEVELS, 1, 16
    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    unknown = sorted(set(names) - set(ENGINES))
    if unknown:
        parser.error(f"unknown engines {unknown}; choose from {ENGINES}")
    if args.repeats < 1 or args.max_tokens < 2 or args.min_requests < 1 or args.timeout <= 0:
        parser.error("--repeats, --min-requests >= 1, --max-tokens >= 2, --timeout > 0")

    from zcode.loader.checkpoint import resolve_model_path

    model_path = Path(resolve_model_path(None))
    # SIGTERM/SIGHUP unwind like Ctrl-C, so the finally below stops the servers.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda s, f: sys.exit(128 + s))

    load_start = os.getloadavg()
    print(f"model {model_path}; load average {load_start}")
    skipped, llama_cpp_mode = {}, None
    with ExitStack() as stack:
        servers: dict[str, tuple[ServerProcess, str]] = {}
        for name in names:
            start = time.perf_counter()
            try:
                if name == "llama.cpp":
                    llama_cpp_mode = ensure_llama_cpp_server()
                server = start_server(name, model_path, max(args.levels))
                stack.callback(server.stop)
                servers[name] = (server, server.wait_ready(300))
            except Exception as e:  # a peer that cannot start is reported, not fatal
                if name != "llama.cpp":
                    raise
                skipped[name] = repr(e)
                print(f"{name}: skipped ({e!r})")
                continue
            print(f"{name}: ready in {time.perf_counter() - start:.1f} s on {server.base_url}")
        idle_cores = _idle_cores({n: s for n, (s, _) in servers.items()}, 3.0)
        print(f"server CPU use while idle (cores): {idle_cores}")

        cpu_start = _cpu_seconds([s for s, _ in servers.values()])
        runs = asyncio.run(measure(servers, args))
        cpu_end = _cpu_seconds([s for s, _ in servers.values()])
    load_end = os.getloadavg()
    contention = _contention(cpu_start, cpu_end)

    results: dict[str, dict[int, dict]] = {}
    for name, engine_runs in runs.items():
        results[name] = {
            c: summarize([r for r in engine_runs if r.concurrency == c]) for c in args.levels
        }
    peer = results.get("llama.cpp")
    for by_level in results.values():
        for c, s in by_level.items():
            if peer is not None:
                s["ratio_vs_llama_cpp"] = (
                    s["output_tok_s"]["median"] / peer[c]["output_tok_s"]["median"]
                )

    print()
    print_table(results, args.levels)
    print(
        f"{args.max_tokens} new tokens per request, max(2C, {args.min_requests}) requests per "
        f"level, {args.repeats} repeat(s); tok/s min/median over repeats; latency percentiles "
        "pooled over repeats; ratio = median tok/s / llama.cpp's median tok/s at the same C."
    )
    if llama_cpp_mode is not None:
        print(f"llama.cpp: llama_cpp.server, {llama_cpp_mode}; its TTFT includes queueing.")
    acceptance = {}
    zc = results.get("zcode", {})
    if 1 in zc and ACCEPTANCE_LEVEL in zc:
        ratio = zc[ACCEPTANCE_LEVEL]["output_tok_s"]["median"] / zc[1]["output_tok_s"]["median"]
        acceptance = {
            "zcode_c16_over_c1": ratio,
            "target": ACCEPTANCE_TARGET,
            "pass": ratio >= ACCEPTANCE_TARGET,
        }
        print(
            f"acceptance: ZCode tok/s at C={ACCEPTANCE_LEVEL} / ZCode tok/s at C=1 = "
            f"{ratio:.2f}x (target >= {ACCEPTANCE_TARGET:.0f}x): "
            f"{'PASS' if acceptance['pass'] else 'FAIL'}"
        )
    print(
        f"load average start {load_start}, end {load_end}; other processes used "
        f"{contention['others_cores']:.2f} of {os.cpu_count()} cores on average while timed "
        f"(servers {contention['servers_cores']:.2f}, load generator "
        f"{contention['client_cores']:.2f})"
    )

    report = {
        "config": {
            "levels": list(args.levels),
            "repeats": args.repeats,
            "max_tokens": args.max_tokens,
            "min_requests": args.min_requests,
            "timeout_s": args.timeout,
            "quick": args.quick,
            "engines": names,
            "model": str(model_path),
            "threads": NUM_THREADS,
        },
        "machine": {
            "processor": _cpu_model() or platform.processor(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_start": load_start,
            "load_average_end": load_end,
            "server_idle_cores": idle_cores,
            **contention,
        },
        "llama_cpp_mode": llama_cpp_mode,
        "skipped": skipped,
        "results": {n: {str(c): s for c, s in by.items()} for n, by in results.items()},
        "acceptance": acceptance,
        "requests": {n: [asdict(run) for run in engine_runs] for n, engine_runs in runs.items()},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}")


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return ""


def _idle_cores(servers: dict[str, ServerProcess], seconds: float) -> dict[str, float]:
    # A server that spins while idle would take CPU from the other one's measurement.
    before = {n: s.cpu_seconds() for n, s in servers.items()}
    time.sleep(seconds)
    return {n: round((s.cpu_seconds() - before[n]) / seconds, 3) for n, s in servers.items()}


def _cpu_seconds(servers: list[ServerProcess]) -> tuple[float, float, float, float]:
    """(wall, busy CPU seconds of the machine, of the servers, of this process)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = sum(fields[:8]) - fields[3] - fields[4]  # all but idle and iowait
    own = os.times()
    return (
        time.perf_counter(),
        busy / os.sysconf("SC_CLK_TCK"),
        sum(s.cpu_seconds() for s in servers),
        own.user + own.system,
    )


def _contention(start: tuple, end: tuple) -> dict[str, float]:
    wall, busy, servers, own = (e - s for s, e in zip(start, end, strict=True))
    return {
        "others_cores": max(0.0, busy - servers - own) / wall,
        "servers_cores": servers / wall,
        "client_cores": own / wall,
    }


if __name__ == "__main__":
    main()
