"""`zcode info`'s fit planner: per llama.cpp file type (bf16, Q8_0, Q4_K_M, Q4_0), the memory a
model needs, whether it fits this machine's RAM, with or without expert offload, and the batch-1
decode tok/s predicted for this machine.

Offload: the routed experts stay in the memory-mapped file, the rest of the weights ("dense")
and the KV cache are resident, and the RAM left holds a cache of experts. A decoded token reads
top_k experts per MoE layer; at hit rate h, (1 - h) of those bytes come from disk. Without a
measured hit rate, h is the cache's share of the experts: what uniform routing gives.

Decode tok/s: the machine's fitted cost model (zcode.hardware.cost_model) on the plan that runs
each linear in its ggml type, as ZCode runs the file (fp32 activations and KV cache), plus disk
bytes / disk bandwidth when offloading. Where no cost model is fitted yet, the read-bandwidth
roofline (weight and KV bytes read per token / the probe's bandwidth), and the report says so.
"""

from dataclasses import dataclass

from torch import nn

from zcode.configs import DEFAULT_CONTEXT_LEN, DEFAULT_DISK_GBPS
from zcode.engine.kv_cache import kv_bytes_per_token
from zcode.hardware.cost_model import CostModel
from zcode.info_gguf import FILE_TYPES, FileTensor, file_tensors, gguf_tensor_types
from zcode.layers.moe import MoE

RAM_USABLE = 0.9  # of physical RAM: the OS, the engine and activations keep the rest
# Linears ZCode keeps in fp32 whatever the file holds (zcode/loader/gguf_weights.py).
FP32_LINEARS = ("kv_b_proj", "indexer.weights_proj")


@dataclass(frozen=True)
class FormatFit:
    file_type: str
    weight_bytes: int  # the file's tensors (no MTP layers)
    expert_bytes: int  # the routed experts: what offload leaves on disk
    kv_bytes: int  # fp32 KV cache of one sequence at the context length
    read_bytes_per_token: int  # weight bytes a decoded token reads
    fits: bool | None  # weights + KV in usable RAM; None: RAM unknown
    decode_tok_s: float | None  # all resident; None: nothing to predict with
    offload_fits: bool | None  # dense weights + KV in usable RAM; None: dense model or RAM unknown
    # the RAM dense weights and KV leave for experts, its hit rate, what misses read from disk
    expert_cache_bytes: int
    hit_rate: float
    disk_bytes_per_token: int
    offload_tok_s: float | None  # None where offload does not fit either


@dataclass(frozen=True)
class FitPlan:
    ram_bytes: int | None
    usable_ram_bytes: int | None
    context_len: int
    disk_gbps: float
    predictor: str  # "cost model", "bandwidth roofline" or "none"
    read_bandwidth_gbps: float | None
    formats: tuple[FormatFit, ...]


def plan_fit(
    net: nn.Module,
    ram_bytes: int | None,
    *,
    context_len: int = DEFAULT_CONTEXT_LEN,
    hit_rate: float | None = None,
    disk_gbps: float = DEFAULT_DISK_GBPS,
    cost: CostModel | None = None,
    read_bandwidth_gbps: float | None = None,
) -> FitPlan:
    """The fit of `net` (a model built on the meta device, fp32) at each file type."""
    if hit_rate is not None and not 0 <= hit_rate <= 1:
        raise ValueError(f"hit rate must be in [0, 1], not {hit_rate}")
    if context_len < 1 or disk_gbps <= 0:
        raise ValueError("context length and disk bandwidth must be positive")
    usable = int(ram_bytes * RAM_USABLE) if ram_bytes else None
    tensors = file_tensors(net)
    fraction = expert_fraction(net)
    kv_token = kv_bytes_per_token(net.attention_layers(), net_dtype(net))
    kv_bytes = kv_token * context_len
    predictor = "cost model" if cost else "bandwidth roofline" if read_bandwidth_gbps else "none"
    rows = []
    for file_type in FILE_TYPES:
        types = gguf_tensor_types(tensors, file_type, net)
        sizes = [t.nbytes(ggml_type) for t, ggml_type in zip(tensors, types)]
        weight_bytes = sum(sizes)
        expert_bytes = sum(n for t, n in zip(tensors, sizes) if "_exps." in t.name)
        read = bytes_read_per_token(((t.name, n, t.rows) for t, n in zip(tensors, sizes)), fraction)
        if cost is not None:
            plan = ggml_plan(tensors, types)
            decode_ms = cost.predict_decode_ms(net, plan, batch_size=1, context_len=context_len)
        elif read_bandwidth_gbps:
            decode_ms = (read + kv_bytes) / (read_bandwidth_gbps * 1e6)
        else:
            decode_ms = None
        dense_bytes = weight_bytes - expert_bytes
        cache = min(expert_bytes, max(0, usable - dense_bytes - kv_bytes)) if usable else 0
        h = hit_rate if hit_rate is not None else cache / expert_bytes if expert_bytes else 1.0
        disk = (1 - h) * expert_bytes * fraction
        offload_fits = dense_bytes + kv_bytes <= usable if usable and expert_bytes else None
        offload = decode_ms + disk / (disk_gbps * 1e6) if decode_ms and offload_fits else None
        rows.append(
            FormatFit(
                file_type=file_type,
                weight_bytes=weight_bytes,
                expert_bytes=expert_bytes,
                kv_bytes=kv_bytes,
                read_bytes_per_token=round(read),
                fits=weight_bytes + kv_bytes <= usable if usable else None,
                decode_tok_s=1e3 / decode_ms if decode_ms else None,
                offload_fits=offload_fits,
                expert_cache_bytes=cache,
                hit_rate=h,
                disk_bytes_per_token=round(disk),
                offload_tok_s=1e3 / offload if offload else None,
            )
        )
    return FitPlan(
        ram_bytes, usable, context_len, disk_gbps, predictor, read_bandwidth_gbps, tuple(rows)
    )


def bytes_read_per_token(names_bytes_rows, expert_fraction: float) -> float:
    """Weight bytes one decoded token reads from a file's tensors, given as (name, bytes, rows):
    one embedding row (where an output tensor exists), top_k / E of each stacked-experts tensor."""
    names_bytes_rows = list(names_bytes_rows)
    has_output = any(name == "output.weight" for name, _, _ in names_bytes_rows)
    total = 0.0
    for name, nbytes, rows in names_bytes_rows:
        if name == "token_embd.weight" and has_output:
            total += nbytes / rows
        else:
            total += nbytes * (expert_fraction if "_exps." in name else 1)
    return total


def ggml_plan(tensors: list[FileTensor], types: list[str]) -> dict[str, str]:
    """{linear module: format} as ZCode runs the file: its ggml type, or fp32 where the loader
    dequantizes (FP32_LINEARS)."""
    plan = {}
    for t, ggml_type in zip(tensors, types):
        for module in t.modules:
            fp32 = any(module.endswith(name) for name in FP32_LINEARS)
            plan[module] = "fp32" if fp32 else f"gguf-{ggml_type.lower()}"
    return plan


def expert_fraction(net: nn.Module) -> float:
    """top_k / routed experts: the share of a MoE layer's experts one token reads."""
    moe = [m for m in net.modules() if isinstance(m, MoE)]
    return moe[0].gate.top_k / moe[0].gate.num_experts if moe else 1.0


def net_dtype(net: nn.Module):
    return next(net.parameters()).dtype


def format_fit(fit: FitPlan, size) -> str:
    """The plan as a table; `size` formats bytes."""
    ram = (
        f"{size(fit.ram_bytes)} RAM ({size(fit.usable_ram_bytes)} usable)" if fit.ram_bytes else ""
    )
    if fit.predictor == "cost model":
        how = "decode predicted by this machine's fitted cost model"
    elif fit.predictor == "bandwidth roofline":
        how = (
            f"decode at the {fit.read_bandwidth_gbps:.1f} GB/s read-bandwidth roofline "
            "(no cost model fitted: zcode hw --fit-cost)"
        )
    else:
        how = "no decode prediction (no hardware probe)"
    moe = any(r.expert_bytes for r in fit.formats)
    header = f"{'file':<8}{'weights':>11}{'experts':>11}{'KV':>11}{'fits':>6}{'tok/s':>8}"
    if moe:
        header += (
            f"   offload: {'RAM':>10}{'fits':>6}{'cache':>11}{'hit':>6}{'disk/token':>12}"
            f"{'tok/s':>8}"
        )
    lines = ["", f"fit on this machine: {ram}, KV at {fit.context_len} tokens (float32), {how}"]
    lines.append(header)
    for r in fit.formats:
        offload = ""
        if r.offload_fits is not None:
            offload = f"   {'':9}{size(r.weight_bytes - r.expert_bytes + r.kv_bytes):>10}"
            offload += f"{_yes(r.offload_fits):>6}"
        if r.offload_fits:
            offload += (
                f"{size(r.expert_cache_bytes):>11}{r.hit_rate:>6.0%}"
                f"{size(r.disk_bytes_per_token):>12}{_rate(r.offload_tok_s):>8}"
            )
        lines.append(
            f"{r.file_type:<8}{size(r.weight_bytes):>11}{size(r.expert_bytes) if moe else '-':>11}"
            f"{size(r.kv_bytes):>11}{_yes(r.fits):>6}{_rate(r.decode_tok_s):>8}{offload}"
        )
    if moe:
        lines.append(
            f"offload: experts read from disk at {fit.disk_gbps:g} GB/s (--disk-gbps), the RAM "
            "left after dense weights and KV caches experts; hit rate = cached share (--hit-rate)"
        )
    return "\n".join(lines)


def _yes(flag: bool | None) -> str:
    return "?" if flag is None else "yes" if flag else "no"


def _rate(tok_s: float | None) -> str:
    return "-" if tok_s is None else f"{tok_s:.1f}" if tok_s >= 1 else f"{tok_s:.2f}"
