"""Hardware probe: what this machine is (cores, caches, ISA flags, CUDA devices) and what it
measurably does (memory bandwidth, peak matmul throughput per dtype), cached as JSON per machine.

Every static fact degrades to None when the OS does not expose it; only read bandwidth and fp32
throughput are guaranteed to exist.
"""

import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from zcode.hardware.load import BUSY_LOAD_PER_CORE, measure_other_load

logger = logging.getLogger(__name__)

# fmt: off
ISA_FLAGS_OF_INTEREST = (
    "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16",
    "amx_tile", "amx_bf16", "amx_int8",
)
# fmt: on
DEFAULT_BUFFER_BYTES = 256 << 20  # far past any L2 and most L3s: a stream from DRAM
DEFAULT_GEMM_SECONDS = 0.3
_SCHEMA_VERSION = 3  # bump when HardwareInfo's fields change, so old cache files are not read
_GEMM_SIZES = (1024, 2048)


@dataclass(frozen=True)
class CudaDevice:
    name: str
    total_memory_bytes: int
    num_sms: int
    capability: tuple[int, int]


@dataclass(frozen=True)
class HardwareInfo:
    cpu_model: str | None
    num_logical_cores: int
    num_physical_cores: int | None
    l1d_cache_bytes: int | None  # per core, as seen by cpu0
    l2_cache_bytes: int | None
    l3_cache_bytes: int | None
    isa_flags: tuple[str, ...] | None  # the present subset of ISA_FLAGS_OF_INTEREST; None: unknown
    torch_cpu_capability: str | None
    torch_version: str
    num_threads: int  # torch intra-op threads the measurements ran with
    total_memory_bytes: int | None
    read_bandwidth_gbps: float
    copy_bandwidth_gbps: float | None  # bytes read + bytes written, STREAM convention
    bandwidth_buffer_bytes: int
    fp32_gflops: float
    bf16_gflops: float | None
    int8_gops: float | None  # torch._int_mm; None where this torch build lacks it on CPU
    # Cores other processes kept busy while measuring (zcode.hardware.load); None: unknown.
    other_load_cores: float | None
    cuda_devices: tuple[CudaDevice, ...] | None


@dataclass(frozen=True)
class Measurements:
    read_bandwidth_gbps: float
    copy_bandwidth_gbps: float | None
    bandwidth_buffer_bytes: int
    fp32_gflops: float
    bf16_gflops: float | None
    int8_gops: float | None
    other_load_cores: float | None


def probe(
    refresh: bool = False,
    *,
    cache_dir: Path | None = None,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    gemm_seconds: float = DEFAULT_GEMM_SECONDS,
) -> HardwareInfo:
    """This machine's HardwareInfo, read from the cache unless `refresh` or no valid entry."""
    static = _static_facts()
    path = (cache_dir or default_cache_dir()) / f"hardware-{_cache_key(static)}.json"
    if not refresh and (cached := _load(path)) is not None:
        return cached
    total = static["total_memory_bytes"]
    if total is not None:  # the copy needs two buffers; leave the rest of memory alone
        buffer_bytes = min(buffer_bytes, total // 8)
    info = HardwareInfo(**static, **dataclasses.asdict(measure(buffer_bytes, gemm_seconds)))
    _store(path, info)
    return info


def fingerprint(info: HardwareInfo | None = None) -> str:
    """The key this machine's caches (probe, cost model, kernel autotune) are filed under; from
    the static facts alone (no measurement) when `info` is None."""
    return _cache_key(dataclasses.asdict(info) if info is not None else _static_facts())


def default_cache_dir() -> Path:
    """$ZCODE_CACHE_DIR, else $XDG_CACHE_HOME/zcode, else ~/.cache/zcode."""
    if explicit := os.environ.get("ZCODE_CACHE_DIR"):
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "zcode"


def format_report(info: HardwareInfo) -> str:
    flags = "unknown"
    if info.isa_flags is not None:
        absent = [f for f in ISA_FLAGS_OF_INTEREST if f not in info.isa_flags]
        flags = " ".join(info.isa_flags) or "none of interest"
        flags += f" (absent: {' '.join(absent)})" if absent else ""
    caches = ", ".join(
        f"{name} {_size(n)}"
        for name, n in (
            ("L1d", info.l1d_cache_bytes),
            ("L2", info.l2_cache_bytes),
            ("L3", info.l3_cache_bytes),
        )
    )
    copy = "" if info.copy_bandwidth_gbps is None else f", copy {info.copy_bandwidth_gbps:.1f}"
    cuda = "none"
    if info.cuda_devices:
        cuda = "; ".join(
            f"{d.name} ({_size(d.total_memory_bytes)}, {d.num_sms} SMs, "
            f"sm_{d.capability[0]}{d.capability[1]})"
            for d in info.cuda_devices
        )
    torch_row = f"{info.torch_version}, {info.num_threads} threads, capability " + (
        info.torch_cpu_capability or "unknown"
    )
    buffer = _size(info.bandwidth_buffer_bytes)
    if info.other_load_cores is not None and (
        info.other_load_cores > BUSY_LOAD_PER_CORE * info.num_logical_cores
    ):
        buffer += (
            f"; measured while other processes kept {info.other_load_cores:.1f} of "
            f"{info.num_logical_cores} cores busy, so lower than idle: `zcode hw --refresh` on "
            "an idle machine"
        )
    matmul = (
        f"fp32 {_rate(info.fp32_gflops)}, bf16 {_rate(info.bf16_gflops)} GFLOP/s, "
        f"int8 {_rate(info.int8_gops)} GOP/s"
    )
    rows = [
        ("cpu", info.cpu_model or "unknown"),
        ("cores", f"{info.num_logical_cores} logical, {info.num_physical_cores or '?'} physical"),
        ("caches", caches),
        ("isa flags", flags),
        ("memory", _size(info.total_memory_bytes)),
        ("torch", torch_row),
        ("bandwidth", f"read {info.read_bandwidth_gbps:.1f}{copy} GB/s ({buffer} buffer)"),
        ("matmul", matmul),
        ("cuda", cuda),
    ]
    return "\n".join(f"{name:<10} {value}" for name, value in rows)


# --- measurement -------------------------------------------------------------------------------


def measure(buffer_bytes: int, gemm_seconds: float) -> Measurements:
    """Best-of timings: other processes only ever make a run slower, never faster."""

    def rates() -> tuple:
        return (
            *_bandwidth(buffer_bytes),
            _gemm_rate(torch.float32, gemm_seconds),
            _optional(lambda: _gemm_rate(torch.bfloat16, gemm_seconds)),
            _optional(lambda: _gemm_rate(torch.int8, gemm_seconds)),
        )

    (read, copy, num_bytes, fp32, bf16, int8), other_load = measure_other_load(rates)
    return Measurements(
        read_bandwidth_gbps=read,
        copy_bandwidth_gbps=copy,
        bandwidth_buffer_bytes=num_bytes,
        fp32_gflops=fp32,
        bf16_gflops=bf16,
        int8_gops=int8,
        other_load_cores=other_load,
    )


def read_bandwidth_gbps(buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> float:
    """The read bandwidth now (GB/s, the probe's measure, ~1 s): on a shared host it moves with
    what the other tenants do (30 to 58 GB/s within an hour on this project's machines)."""
    return _bandwidth(buffer_bytes)[0]


def _bandwidth(buffer_bytes: int) -> tuple[float, float | None, int]:
    """(read GB/s, copy GB/s or None, bytes per buffer) streaming an fp32 buffer."""
    src = torch.ones(max(buffer_bytes // 4, 1024), dtype=torch.float32)
    read = src.nbytes / _best_time(src.sum, reps=5) / 1e9
    try:
        dst = torch.empty_like(src)
    except RuntimeError:  # no memory for a second buffer: report what was measured
        return read, None, src.nbytes
    copy = 2 * src.nbytes / _best_time(functools.partial(dst.copy_, src), reps=3) / 1e9
    return read, copy, src.nbytes


def _gemm_rate(dtype: torch.dtype, seconds: float) -> float:
    """Peak G op/s of an [n, n] @ [n, n] product, best-of within `seconds`. n = 1024 is
    compute-bound for vector units; matrix units (AMX) can still be overhead-bound there, so
    n = 2048 is tried too when the budget allows."""
    op = torch._int_mm if dtype == torch.int8 else torch.mm
    deadline = time.perf_counter() + seconds
    rate = 0.0
    for n in _GEMM_SIZES:
        fn = functools.partial(op, _random_matrix(n, dtype), _random_matrix(n, dtype))
        fn()  # first call pays for kernel selection and weight packing
        best = _time_once(fn)
        size_deadline = time.perf_counter() + (deadline - time.perf_counter()) / 2
        while time.perf_counter() < size_deadline:
            best = min(best, _time_once(fn))
        rate = max(rate, 2 * n**3 / best / 1e9)
        if 2 * 8 * best > deadline - time.perf_counter():  # the next size: 2 calls, 8x the work
            break
    return rate


def _random_matrix(n: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.int8:
        return torch.randint(-128, 128, (n, n), dtype=dtype)
    return torch.randn(n, n, dtype=dtype)


def _best_time(fn: Callable[[], object], reps: int) -> float:
    fn()
    return min(_time_once(fn) for _ in range(reps))


def _time_once(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _optional(fn: Callable[[], float]) -> float | None:
    try:
        return fn()
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        logger.info("hardware probe: %s", e)
        return None


# --- static facts ------------------------------------------------------------------------------


def _static_facts() -> dict[str, object]:
    cpuinfo = _read("/proc/cpuinfo")
    caches = _cache_sizes()
    return dict(
        cpu_model=_cpu_model(cpuinfo),
        num_logical_cores=os.cpu_count() or 1,
        num_physical_cores=_physical_cores(cpuinfo),
        l1d_cache_bytes=caches.get("L1d"),
        l2_cache_bytes=caches.get("L2"),
        l3_cache_bytes=caches.get("L3"),
        isa_flags=_isa_flags(cpuinfo),
        torch_cpu_capability=_optional_str(torch.backends.cpu.get_cpu_capability),
        torch_version=torch.__version__,
        num_threads=torch.get_num_threads(),
        total_memory_bytes=_total_memory(),
        cuda_devices=_cuda_devices(),
    )


def _cpuinfo_values(cpuinfo: str | None, key: str) -> list[str]:
    if cpuinfo is None:
        return []
    pairs = (line.partition(":") for line in cpuinfo.splitlines())
    return [value.strip() for name, _, value in pairs if name.strip() == key]


def _cpu_model(cpuinfo: str | None) -> str | None:
    names = _cpuinfo_values(cpuinfo, "model name") or _cpuinfo_values(cpuinfo, "Model")
    return names[0] if names else (platform.processor() or platform.machine() or None)


def _physical_cores(cpuinfo: str | None) -> int | None:
    cores = set(
        zip(
            _cpuinfo_values(cpuinfo, "physical id"),
            _cpuinfo_values(cpuinfo, "core id"),
            strict=False,
        )
    )
    if cores:
        return len(cores)
    topology = Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology")
    cores = {(_read(t / "physical_package_id"), _read(t / "core_id")) for t in topology}
    known = cores and all(None not in core for core in cores)
    return len(cores) if known else None


@functools.cache
def isa_flags() -> tuple[str, ...] | None:
    """The present subset of ISA_FLAGS_OF_INTEREST on this CPU (None: unknown), without probing."""
    return _isa_flags(_read("/proc/cpuinfo"))


def _isa_flags(cpuinfo: str | None) -> tuple[str, ...] | None:
    lines = _cpuinfo_values(cpuinfo, "flags") or _cpuinfo_values(cpuinfo, "Features")
    if not lines:
        return None
    present = set(lines[0].split())
    return tuple(f for f in ISA_FLAGS_OF_INTEREST if f in present)


def _cache_sizes() -> dict[str, int]:
    """{"L1d": bytes, "L2": ..., "L3": ...} for one cpu0 instance, from sysfs, else lscpu."""
    sizes: dict[str, int] = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index[0-9]*")):
        level, kind, size = (_read(index / f) for f in ("level", "type", "size"))
        if level is None or kind is None or not size or kind == "Instruction":
            continue
        name = f"L{level}d" if kind == "Data" else f"L{level}"
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        scale = units.get(size[-1], 1)
        digits = size[:-1] if size[-1] in units else size
        if digits.isdigit():
            sizes[name] = int(digits) * scale
    if sizes:
        return sizes
    try:
        out = subprocess.run(
            ["lscpu", "-C=NAME,ONE-SIZE", "-B"], capture_output=True, text=True, timeout=5
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    rows = (line.split() for line in out.splitlines()[1:])
    return {row[0]: int(row[1]) for row in rows if len(row) == 2 and row[1].isdigit()}


def _total_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _cuda_devices() -> tuple[CudaDevice, ...] | None:
    if not torch.cuda.is_available():
        return None
    devices = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        devices.append(
            CudaDevice(p.name, p.total_memory, p.multi_processor_count, (p.major, p.minor))
        )
    return tuple(devices)


def _optional_str(fn: Callable[[], str]) -> str | None:
    try:
        return fn()
    except (RuntimeError, AttributeError):
        return None


def _read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


# --- cache -------------------------------------------------------------------------------------


def _cache_key(static: dict[str, object]) -> str:
    # Thread count is part of the key: every measurement depends on it.
    keys = ("cpu_model", "num_logical_cores", "torch_version", "num_threads")
    parts = (_SCHEMA_VERSION, *(static[k] for k in keys))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def _load(path: Path) -> HardwareInfo | None:
    try:
        data = json.loads(path.read_text())
        cuda = data.pop("cuda_devices")
        if cuda is not None:
            cuda = tuple(CudaDevice(**{**d, "capability": tuple(d["capability"])}) for d in cuda)
        flags = data.pop("isa_flags")
        info = HardwareInfo(
            **data, cuda_devices=cuda, isa_flags=None if flags is None else tuple(flags)
        )
        if not (info.read_bandwidth_gbps > 0 and info.fp32_gflops > 0):
            raise ValueError("non-positive measurements")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        logger.warning("ignoring unreadable hardware cache %s: %s", path, e)
        return None
    return info


def _store(path: Path, info: HardwareInfo) -> None:
    """Write atomically, so a concurrent reader never sees half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(info), indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not write hardware cache %s: %s", path, e)


def _size(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "?"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if num_bytes >= 1 << shift:
            return f"{num_bytes / (1 << shift):.3g} {unit}"
    return f"{num_bytes} B"


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"
