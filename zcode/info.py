"""What a model needs before any weight is read: size, KV cache per token, memory per precision,
and (zcode/info_fit.py) how it fits this machine in each llama.cpp file type.

The model is built on the meta device from its config alone, so a GLM-5-sized config (~744B
parameters) is counted in seconds with no memory, and a directory holding only config.json works.
The published configs of GLM-4.5-Air and GLM-5 ship in zcode/configs/ and are named by their
directory: `zcode info glm-4.5-air`.
"""

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from zcode.configs import CONFIGS_DIR, DEFAULT_CONTEXT_LEN, DEFAULT_DISK_GBPS, shipped_configs
from zcode.engine.kv_cache import kv_bytes_per_token
from zcode.hardware.cost_model import CostModel
from zcode.info_fit import (
    FitPlan,
    bytes_read_per_token,
    format_fit,
    plan_fit,
)
from zcode.layers.moe import MoE
from zcode.loader.checkpoint import CheckpointError, build_model, read_config, resolve_model_path
from zcode.loader.gguf_config import MODEL_TYPES as GGUF_MODEL_TYPES

# Quantized formats store 2-D weights in groups of 32 with one fp16 scale per group (llama.cpp's
# Q8_0 / Q4_0: 8.5 and 4.5 bits per weight); norms and biases stay bf16.
QUANT_GROUP_SIZE = 32
SCALE_BYTES = 2
WEIGHT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "int8": 1.0, "int4": 0.5}
# The KV cache is kept in the activation dtype: fp32 models cache fp32, everything else bf16.
KV_DTYPE_OF = {"float32": "float32", "bfloat16": "bfloat16", "int8": "bfloat16", "int4": "bfloat16"}
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class FitOptions:
    """What the fit planner needs beyond the config (zcode/info_fit.py)."""

    context_len: int = DEFAULT_CONTEXT_LEN
    hit_rate: float | None = None
    disk_gbps: float = DEFAULT_DISK_GBPS
    cost: CostModel | None = None
    read_bandwidth_gbps: float | None = None


@dataclass(frozen=True)
class MemoryRow:
    precision: str  # of the weights
    weight_bytes: int
    kv_dtype: str
    kv_bytes: int  # one sequence at max_model_len

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


@dataclass(frozen=True)
class ModelInfo:
    path: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    vocab_size: int
    max_model_len: int
    num_params: int
    num_active_params: int  # per token: all but the routed experts a token does not visit
    num_experts: int | None  # routed experts per MoE layer; None for dense models
    num_experts_per_tok: int | None
    num_mtp_layers: int  # next-token-prediction layers the checkpoint ships beside the model
    kv_bytes_per_token: dict[str, int]  # by KV dtype
    memory: tuple[MemoryRow, ...]
    machine_memory_bytes: int | None
    # A GGUF file as stored (run as is by default): tensors and bytes per ggml type, and the
    # weight bytes one decoded token reads (routed experts at top_k / experts, one embedding row).
    stored_types: dict[str, dict[str, int]] | None = None
    stored_bytes_per_token: int | None = None
    fit: FitPlan | None = None

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["memory"] = [
            dict(dataclasses.asdict(r), total_bytes=r.total_bytes) for r in self.memory
        ]
        return out


def model_info(model: str | Path | None = None, fit: FitOptions | None = None) -> ModelInfo:
    """Facts about `model` (HF directory, its config.json, a .gguf, a shipped config's name; None:
    the embedded default) read from its config only; with `fit`, the fit planner's table too."""
    if isinstance(model, str) and model in shipped_configs():
        model = CONFIGS_DIR / model / "config.json"
    elif isinstance(model, str) and not Path(model).expanduser().exists():
        raise CheckpointError(
            f"{model}: no such model file or directory, nor a shipped config "
            f"({', '.join(shipped_configs())})"
        )
    path = resolve_model_path(model)
    config = read_config(path)
    try:
        net = build_model(config, device="meta")
    except ValueError as e:  # an unsupported model_type, or a shape the layers refuse
        raise CheckpointError(f"{path}: {e}") from e
    params = list(net.parameters())  # tied weights appear once
    num_params = sum(p.numel() for p in params)
    moe_layers = [m for m in net.modules() if isinstance(m, MoE)]
    # A token visits top_k of the routed experts; everything else (embedding, attention, shared
    # expert, router, head) runs for every token.
    skipped = sum(
        sum(p.numel() for p in m.experts.parameters()) * (1 - m.gate.top_k / m.gate.num_experts)
        for m in moe_layers
    )
    kv_per_token = {
        name: kv_bytes_per_token(net.attention_layers(), dtype) for name, dtype in KV_DTYPES.items()
    }
    max_model_len = config.max_position_embeddings
    expert_fraction = moe_layers[0].gate.top_k / moe_layers[0].gate.num_experts if moe_layers else 1
    stored = _gguf_storage(path, expert_fraction) if path.suffix == ".gguf" else (None, None)
    stored_row = ()
    if stored[0] is not None:  # run as stored: the file's bytes, fp32 activations and KV
        stored_bytes = sum(row["bytes"] for row in stored[0].values())
        kv_stored = kv_per_token["float32"] * max_model_len
        stored_row = (MemoryRow("stored", stored_bytes, "float32", kv_stored),)
    return ModelInfo(
        path=str(path),
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        vocab_size=config.vocab_size,
        max_model_len=max_model_len,
        num_params=num_params,
        num_active_params=num_params - round(skipped),
        num_experts=moe_layers[0].gate.num_experts if moe_layers else None,
        num_experts_per_tok=moe_layers[0].gate.top_k if moe_layers else None,
        num_mtp_layers=getattr(config, "num_nextn_predict_layers", None) or 0,
        kv_bytes_per_token=kv_per_token,
        memory=stored_row
        + tuple(
            MemoryRow(
                precision,
                _weight_bytes(params, precision),
                KV_DTYPE_OF[precision],
                kv_per_token[KV_DTYPE_OF[precision]] * max_model_len,
            )
            for precision in WEIGHT_BYTES
        ),
        machine_memory_bytes=_machine_memory(),
        stored_types=stored[0],
        stored_bytes_per_token=stored[1],
        fit=_plan_fit(net, fit) if fit is not None else None,
    )


def _plan_fit(net: torch.nn.Module, options: FitOptions) -> FitPlan | None:
    if net.config.model_type not in GGUF_MODEL_TYPES.values():  # no GGUF names to plan with
        return None
    fields = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    fields["context_len"] = min(options.context_len, net.config.max_position_embeddings)
    return plan_fit(net, _machine_memory(), **fields)


def _gguf_storage(path: Path, expert_fraction: float) -> tuple[dict, int]:
    """({ggml type: {"tensors", "bytes"}}, weight bytes read per decoded token) of a GGUF file."""
    from zcode.loader.gguf_file import read_gguf
    from zcode.quant.gguf import type_name

    tensors = read_gguf(path).tensors
    types: dict[str, dict[str, int]] = {}
    for t in tensors:
        row = types.setdefault(type_name(t.ggml_type), {"tensors": 0, "bytes": 0})
        row["tensors"] += 1
        row["bytes"] += t.nbytes
    per_token = bytes_read_per_token(
        ((t.name, t.nbytes, t.shape[0]) for t in tensors), expert_fraction
    )
    return dict(sorted(types.items(), key=lambda kv: -kv[1]["bytes"])), round(per_token)


def _weight_bytes(params: list[torch.nn.Parameter], precision: str) -> int:
    if precision in KV_DTYPES:
        return int(sum(p.numel() for p in params) * WEIGHT_BYTES[precision])
    total = 0.0
    for p in params:
        if p.dim() < 2:
            total += p.numel() * WEIGHT_BYTES["bfloat16"]
            continue
        rows, cols = p.numel() // p.shape[-1], p.shape[-1]
        num_groups = rows * math.ceil(cols / QUANT_GROUP_SIZE)
        total += p.numel() * WEIGHT_BYTES[precision] + num_groups * SCALE_BYTES
    return int(total)


def _machine_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def format_info(info: ModelInfo) -> str:
    kv = ", ".join(f"{_size(n)} ({dtype})" for dtype, n in info.kv_bytes_per_token.items())
    params = _count(info.num_params)
    if info.num_experts is not None:
        params += (
            f" total, ~{_count(info.num_active_params)} active per token "
            f"({info.num_experts_per_tok} of {info.num_experts} routed experts)"
        )
    lines = [
        f"model          {info.path}",
        f"architecture   {info.model_type}",
        f"layers         {info.num_layers}",
        f"hidden size    {info.hidden_size}",
        f"heads          {info.num_attention_heads} query, {info.num_kv_heads} key/value",
        f"vocabulary     {info.vocab_size}",
        f"max context    {info.max_model_len} tokens",
        f"parameters     {params}",
        f"KV cache       {kv} per token",
    ]
    if info.num_mtp_layers:
        lines.append(f"MTP layers     {info.num_mtp_layers} (not counted above)")
    if info.stored_types is not None:
        stored = ", ".join(
            f"{name} {_size(row['bytes'])} in {row['tensors']}"
            for name, row in info.stored_types.items()
        )
        lines.append(f"stored as      {stored} tensors")
        lines.append(
            f"reads          {_size(info.stored_bytes_per_token)} of weights per decoded token "
            "(run as stored, the default --dtype auto)"
        )
    ram = info.machine_memory_bytes
    fits_header = f"fits in {_size(ram)} RAM" if ram else ""
    kv_header = f"KV @ {info.max_model_len} tokens"
    lines += ["", f"{'precision':<10}{'weights':>12}{kv_header:>26}{'total':>12}  {fits_header}"]
    for row in info.memory:
        fits = ("yes" if row.total_bytes <= ram else "no") if ram else ""
        kv_cell = f"{_size(row.kv_bytes)} ({row.kv_dtype})"
        lines.append(
            f"{row.precision:<10}{_size(row.weight_bytes):>12}{kv_cell:>26}"
            f"{_size(row.total_bytes):>12}  {fits}"
        )
    lines.append(
        f"KV: one sequence at the max context. int8/int4: one fp16 scale per {QUANT_GROUP_SIZE} "
        "weights, norms in bf16."
    )
    if info.fit is not None:
        lines.append(format_fit(info.fit, _size))
    return "\n".join(lines)


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _size(num_bytes: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if num_bytes >= 1 << shift:
            return f"{num_bytes / (1 << shift):.1f} {unit}"
    return f"{num_bytes} B"
