"""Cost model: a plan's decode and prefill time on this machine, from the work it does.

A step's time is predicted as a linear function of what the step reads and computes:

    t_ms = c_step + c_kv * kv_MB + c_attn * attn_GFLOP
         + sum over kernel kinds k of (a_k * weight_MB_k + o_k * calls_k + f_k * GFLOP_k)

where a kernel kind is how a linear layer runs (`dense-float32`, `dense-bfloat16`, or a weight
format family `bf16`, `int8`, `w8a8`, `int4`, `w4a8` through its fast kernel; a ggml block
format as the family of ggml.cpp kernels running it, `gguf_kind`), weight_MB_k the bytes of
weights of that kind read per step (QuantizedLinear.weight_bytes, or the parameter's bytes; a
MoE layer's routed experts by the expected share of them the step's tokens touch, routed
uniformly to the plan's experts per token), calls_k the number of linear calls and GFLOP_k
their arithmetic past the first row (for the float kinds, `gemv-GFLOP` where the call has few
enough rows for the float GEMV: a rate of its own, apart from a prefill's GEMM). A sparse
FFN (zcode.sparsity.SparseMLP, eager) is its own kind, `sparse-<rows>` (`sparse-float32`,
`sparse-int8`: the rows it reads): its row-skipping kernel reads the plan's `ffn_density` of
the FFN's rows, at a rate of its own (fitted at batch 1, where
a step reads one token's kept rows; a batch reads the union of its tokens', more than that). An
engine that keeps KV per head (`per_request_depth`: requests skip layers and KV heads through
their page tables) gathers each layer's pages per sequence: `kv-paged:calls` (attention layers
run), `kv-paged:rows` (those times the sequences) and `kv-paged:MB` (the KV read through them)
price that on top, in eager steps (the compiled fit has no such engine: its steps are priced as
flat KV's). An eager step pays `moe-fused:layers` per MoE layer whose experts run the float
fused expert op (moe_fused: fp32 / bf16 experts as safetensors load them): what that layer costs
past its bytes at the dense GEMV's rate.
Decode steps (a few tokens) and prefill steps (a long prompt) use separate coefficients, since
the int kernels change algorithm with the row count. The coefficients are fitted once per machine by
non-negative least squares on relative error against measured engine steps of several plans of
SmolLM2-135M and of two random models, a wide dense one and a GLM-4.5-shaped MoE (`fit_smollm2`),
each also as the GGUF files llama.cpp makes of it, and cached as JSON next to the hardware probe.

Compiled decode steps get coefficients of their own (`compiled_decode`, fitted apart on compiled
steps of 2 and 8 layers of SmolLM2 by `fit_compiled`, since a whole-model graph takes ~80 s to
build here): without Python between the ops, a step's fixed and per-call costs are a fraction of
an eager step's (SmolLM2 bf16 at batch 1: ~12 ms compiled against ~20 eager), so eager
coefficients would price a compiled engine's steps, and the drafts that pay there, wrongly. A
compiled step computes logits for every token it runs (`logits_rows`), not only each sequence's
last.

Public API:

    CostModel.load_or_fit(info: HardwareInfo | None = None, *, refresh: bool = False,
                          cache_dir: Path | None = None, compiled: bool = False) -> CostModel
    cost.predict_decode_ms(model, plan=None, *, batch_size=1, context_len=512,
                           compiled=False, kv_paged=False) -> float
        ms of one decode step of `batch_size` sequences at `context_len` tokens of context
        (= the per-token latency each sequence sees); `kv_paged`: KV kept per head
    cost.predict_step_ms(model, plan=None, *, num_tokens, num_seqs, context_len=512,
                         compiled=False, kv_paged=False) -> float
        ms of one decode step computing `num_tokens` tokens over `num_seqs` sequences (a step
        that verifies drafted tokens); `compiled`: the step is a compiled graph
        (zcode.engine.graph_cache), priced by the coefficients fitted on compiled steps
    cost.predict_prefill_ms(model, plan=None, *, prompt_len=256) -> float
        ms to prefill one prompt of `prompt_len` tokens (divide by prompt_len for ms/token)

`model` is the loaded nn.Module (its current linears: nn.Linear or QuantizedLinear); `plan` is an
ExecutionPlan or a {module name: format} dict, applied on top of it without touching the model
(formats as in zcode.quant.FORMATS, "fp32" = as loaded). Predicting for a kind the fit never saw
raises ValueError naming it.
"""

import dataclasses
import functools
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from scipy.optimize import nnls
from torch import nn

from zcode.engine.kv_cache import cache_dtype
from zcode.hardware.load import BUSY_LOAD_PER_CORE
from zcode.hardware.probe import HardwareInfo, default_cache_dir, fingerprint, probe
from zcode.harness.plan import ExecutionPlan
from zcode.quant.formats import FLOAT_GEMV_MAX_ROWS
from zcode.quant.gguf import ACTIVATION_BLOCK, FLOAT_TYPES, row_bytes
from zcode.quant.linear import QuantizedLinear, quantize_weight

logger = logging.getLogger(__name__)

# Bump when the features or the fit's settings change, so old fits are not read (2: decode
# steps of 16 sequences; 3: the "seqs" feature, verifying steps in the compiled fit; 4: sparse
# FFNs and head-paged KV; 5: "moe-fused:layers", steps of random wide and MoE models; 6: the
# ggml types as kinds of their own, `gguf_kind`).
_SCHEMA_VERSION = 6
DECODE, PREFILL = "decode", "prefill"
Plan = ExecutionPlan | Mapping[str, str] | None
_EXPERT_NAME = re.compile(r"^(.*\.experts)\.\d+\.")
_DENSE_FFN_LINEAR = re.compile(r"^model\.layers\.\d+\.mlp\.(gate|up|down)_proj$")

# Part of the cache key: bump when a kernel change makes fitted costs stale (2: C++ decode GEMV;
# 3: its software prefetch; 4: sibling linears in one GEMV call, no size asserts in graphs;
# 5: unmasked GEMV main loops, fused attention loops in compiled verifying steps; 6: the float
# GEMV 4 weight rows a step and up to 16 activation rows, verifying steps at batch 4 on it; 7:
# the sparse FFN's row kernel, 8 rows a pass; 8: its int8 rows, a kind of their own; 9: the float
# GEMV up to 32 rows, its arithmetic a feature of its own, `<kind>:gemv-GFLOP`; 10: the AVX-512
# decode attention kernel, in compiled steps too; 11: GGUF BF16 rows as vdpbf16ps tiles at any
# row count, MoE work split over threads by rows x bytes; 12: a GGUF decoder layer's attention,
# MLP and MoE halves one C++ call each at decode, eager steps ~1.3-2x faster; 13: an eager GGUF
# decode step's layers one C++ call, DecodeStack, ~7-20% faster again; 14: AVX2 kernels for the
# GGUF formats (rows and interleaved) and decode attention, 1.4-1.6x faster decode on AVX2 hosts;
# 15: bf16 / fp32 GEMV and fused MoE experts in AVX2 vectors (float_dot.h), bf16 2.5-5x and MoE
# bf16 ~7x faster there, bf16 GEMMs through fp32 on CPUs without bf16 arithmetic).
KERNELS_VERSION = 15
# Kinds whose few-row calls run the float GEMV (zcode.layers.linear): its rows past the first
# cost arithmetic at a rate of their own (the GEMV re-reads the weight for every 4 rows;
# SmolLM2's bf16 linears at 16 -> 32 rows ~2x the time), not F.linear's GEMM rate of a prefill.
FLOAT_GEMV_KINDS = ("dense-float32", "dense-bfloat16", "bf16")


# --- features --------------------------------------------------------------------------------


def kernel_kind(module: nn.Module, fmt: str | None = None) -> str:
    """How a linear runs: `dense-<dtype>` for nn.Linear, the format family for a packed one."""
    fmt = fmt or (module.format if isinstance(module, QuantizedLinear) else None)
    if fmt is None or fmt == "fp32":
        return f"dense-{str(module.weight.dtype).removeprefix('torch.')}"
    if fmt.startswith("gguf-"):
        return gguf_kind(fmt)
    return fmt.split("-g")[0]  # int4-g64 -> int4, w4a8-g128 -> w4a8


def module_format(module: nn.Module) -> str:
    """A linear's weight format: a QuantizedLinear's, "fp32" (as loaded) for nn.Linear."""
    return module.format if isinstance(module, QuantizedLinear) else "fp32"


# The kinds of the ggml types with C++ kernels (zcode/kernels/ggml.cpp), by the family of
# kernels running them: float rows (F32 / F16 / BF16), Q8_0, the 32-weight blocks of 4 and 5 bits
# (Q4_0, Q4_1, Q5_0, Q5_1) and the K-quants' 256-weight super-blocks (Q4_K, Q5_K, Q6_K). Each is
# fitted on steps of models whose linears are those of llama.cpp's files (bf16, Q8_0, Q4_0,
# Q4_K_M: zcode.hardware.cost_fit). With the Q4_0 blocks priced as ZCode's own W4A8 format,
# which does the same work on other kernels, the fit predicted a 1.3B GLM-4.5-shaped Q4_0 file's
# decode at 12.5 tok/s against 79 measured on an AVX2 host, where the W4A8 GEMV has no vector
# kernel and ggml.cpp's Q4_0 one streams at the DRAM rate.
GGUF_KINDS = ("gguf-float", "gguf-q8_0", "gguf-q4", "gguf-k")
_GGUF_KIND = {
    **{t: "gguf-float" for t in FLOAT_TYPES},
    **{t: "gguf-q4" for t, block in ACTIVATION_BLOCK.items() if block == 32},
    **{t: "gguf-k" for t, block in ACTIVATION_BLOCK.items() if block == 256},
    GGMLQuantizationType.Q8_0: "gguf-q8_0",  # 32-weight blocks too, of 8 bits
}


def gguf_kind(fmt: str) -> str:
    """The fitted kind of a ggml type's format ('gguf-q4_k' -> 'gguf-k'); a type ggml.cpp has no
    kernel for (it runs the reference path) is a kind of its own that no fit measures."""
    ggml_type = GGMLQuantizationType[fmt.removeprefix("gguf-").upper()]
    return _GGUF_KIND.get(ggml_type, fmt)


@functools.lru_cache(maxsize=64)
def format_weight_bytes(out_features: int, in_features: int, fmt: str) -> int:
    """Bytes a linear of this shape reads per call in `fmt` (exact: the format's own packing;
    a ggml format 'gguf-q4_k' as its GGUF blocks)."""
    if fmt.startswith("gguf-"):
        ggml_type = GGMLQuantizationType[fmt.removeprefix("gguf-").upper()]
        return out_features * row_bytes(ggml_type, in_features)
    return quantize_weight(torch.zeros(out_features, in_features), fmt).weight_bytes


def _plan_formats(plan: Plan) -> tuple[dict[str, str], ExecutionPlan]:
    if plan is None:
        return {}, ExecutionPlan()
    if isinstance(plan, ExecutionPlan):
        return dict(plan.precision), plan
    return dict(plan), ExecutionPlan()


def step_features(
    model: nn.Module,
    plan: Plan,
    num_tokens: int,
    context_len: int,
    num_seqs: int = 1,
    modules: Mapping[str, nn.Module] | None = None,
    logits_rows: int | None = None,
    compiled: bool = False,
    kv_paged: bool = False,
) -> dict[str, float]:
    """The work of one forward step of `num_tokens` new tokens over `num_seqs` sequences of
    `context_len` tokens of context each, as named features (MB, GFLOP, call counts).
    `modules`: {name: module} run instead of the model's own there (a precision variant's);
    `logits_rows`: the rows lm_head computes (default: the last token of each sequence);
    `compiled`: a compiled graph's step, whose SparseMLPs (at the dense level: sparse levels
    decode eagerly) multiply densely; `kv_paged`: the engine keeps KV per head."""
    formats, exec_plan = _plan_formats(plan)
    skipped = {f"model.layers.{i}." for i in exec_plan.skip_layers}
    float_fused = set()  # MoE layers run whose routed experts run moe_fused
    routed = _routed_experts(model, num_tokens, dict(exec_plan.extras).get("experts_per_token"))
    # Per sequence past the first (the first's is in "step"): work outside the linears that
    # each row brings (its sampling, bookkeeping), told apart from work per token by steps that
    # verify several tokens of one sequence.
    features: dict[str, float] = {"step": 1.0, "seqs": num_seqs - 1.0}

    def add(name: str, value: float) -> None:
        features[name] = features.get(name, 0.0) + value

    # A plan naming an FFN level runs every dense FFN as a SparseMLP (zcode.sparsity.apply),
    # reading the rows the plan names; without a level, a SparseMLP reads the rows it is set to.
    extras = dict(exec_plan.extras)
    plan_rows = extras.get("ffn_weights", "fp32") if "ffn_sparsity_in" in extras else None
    for name, module, rows in _linears(model, modules or {}):
        if plan_rows is not None and (rows is not None or _DENSE_FFN_LINEAR.match(name)):
            rows = plan_rows
        if name.endswith("mlp.gate"):
            continue  # the MoE router is a Parameter product, not counted among linears
        if any(name.startswith(prefix) for prefix in skipped):
            continue
        fmt = None if modules and name in modules else formats.get(name)
        if rows is not None and rows != "fp32":
            fmt = rows
        kind = kernel_kind(module, fmt)
        if rows is not None and not compiled:
            kind = "sparse-" + kind.removeprefix("dense-")
        n, k = module.out_features, module.in_features
        if fmt is not None and fmt != "fp32":
            num_bytes = format_weight_bytes(n, k, fmt)
        elif isinstance(module, QuantizedLinear):
            num_bytes = module.weight_bytes
        else:
            num_bytes = module.weight.numel() * module.weight.element_size()
        share = exec_plan.ffn_density if ".mlp." in name else 1.0
        rows = (logits_rows or num_seqs) if name == "lm_head" else num_tokens
        touched = calls = 1.0  # the share of steps reading the weights: a routed expert's is less
        if (match := _EXPERT_NAME.match(name)) and match.group(1) in routed:
            touched, rows, num_experts = routed[match.group(1)]
            # A layer's routed experts in one fused call (ggml_moe, moe_fused) cost a call per
            # projection, not one per expert; other formats run each expert's own module.
            fused = kind.startswith("dense-") or (fmt or module_format(module)).startswith("gguf-")
            calls = 1 / num_experts if fused else touched
            if kind.startswith("dense-"):
                float_fused.add(match.group(1))
        add(f"{kind}:MB", share * touched * num_bytes / 1e6)
        add(f"{kind}:calls", calls)
        # Arithmetic past the first row: one row's cost is in the bytes term (decode at batch 1
        # streams the weight once), so the two terms are not collinear at batch 1.
        rows_past_first = max(0.0, rows - touched - 1e-9)  # 1 - (1 - p) rounds off p
        gemv = kind in FLOAT_GEMV_KINDS and rows <= FLOAT_GEMV_MAX_ROWS
        add(f"{kind}:{'gemv-' if gemv else ''}GFLOP", share * 2 * rows_past_first * n * k / 1e9)

    # The float fused expert op once streamed its experts at ~27 GB/s where the dense GEMV read
    # 33 (random GLM-4.5-shaped MoEs, fp32): a cost per layer past its bytes, fitted on the MoE
    # model's steps (0.78 ms a layer in one fit, 0 in the next: the host's bandwidth moves).
    # GGUF experts (ggml_moe) showed none: the 1.3B and 6B GLM-shaped files' decode was
    # predicted within 7-14% without it and 1.5-1.8x slow with it. Eager steps: the compiled
    # fit has no MoE.
    if float_fused and not compiled:
        add("moe-fused:layers", len(float_fused))
    kv_bytes_per_token, attn_flops_per_pair = _attention_sizes(model, exec_plan.skip_layers)
    kv_mb = num_seqs * context_len * kv_bytes_per_token / 1e6
    add("kv:MB", kv_mb)
    add("attn:GFLOP", num_tokens * context_len * attn_flops_per_pair / 1e9)
    if kv_paged:
        layers_run = len(model.attention_layers()) - len(exec_plan.skip_layers)
        add("kv-paged:calls", layers_run)
        add("kv-paged:rows", layers_run * num_seqs)
        add("kv-paged:MB", kv_mb)
    return features


def _linears(model: nn.Module, modules: Mapping[str, nn.Module]):
    """(name, linear, rows) of every linear the model runs, `modules` in place of its own; a
    sparse FFN (zcode.sparsity.SparseMLP, whose weights are transposed rows, not linears) as its
    three dense linears, whose bytes the plan's ffn_density scales, with the format of the rows
    it reads ("fp32", "int8"; None for a linear no SparseMLP runs)."""
    from zcode.sparsity.sparse_mlp import SparseMLP

    replaced = set()  # modules[name] replaces the model's module and everything inside it
    for name, module in model.named_modules():
        parts = name.split(".")
        if replaced and any(".".join(parts[:i]) in replaced for i in range(1, len(parts))):
            continue
        if name in modules:
            module = modules[name]
            replaced.add(name)
        if isinstance(module, SparseMLP):
            rows = module.weight_format
            yield from ((f"{name}.{n}", linear, rows) for n, linear in _ffn_linears(module))
        elif isinstance(module, nn.Linear | QuantizedLinear):
            yield name, module, None


def _ffn_linears(mlp) -> list[tuple[str, nn.Linear]]:
    """Weightless stand-ins of a SparseMLP's gate, up and down projections: shapes and dtype."""
    hidden, inter = mlp.w_down_t.shape[1], mlp.intermediate_size
    dtype = mlp.w_down_t.dtype
    shapes = {
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    return [
        (n, nn.Linear(k, m, bias=False, device="meta", dtype=dtype)) for n, (k, m) in shapes.items()
    ]


def _routed_experts(
    model: nn.Module, num_tokens: int, experts_per_token: str | None = None
) -> dict[str, tuple[float, float, int]]:
    """{MoE layer's `experts` name: (expected share of its experts a step touches, expected
    rows per expert, experts)} for `num_tokens` tokens routed uniformly, each to top_k experts
    (or the plan's `experts_per_token`, when fewer)."""
    from zcode.layers.moe import MoE

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            k = module.gate.top_k
            if experts_per_token is not None:
                k = min(k, int(experts_per_token))
            p = k / module.gate.num_experts
            num_experts = module.gate.num_experts
            out[f"{name}.experts"] = (1 - (1 - p) ** num_tokens, num_tokens * p, num_experts)
    return out


def _attention_sizes(model: nn.Module, skip_layers: tuple[int, ...]) -> tuple[float, float]:
    """(KV cache bytes per token, attention FLOPs per query-key pair), summed over layers run."""
    kv_bytes, flops = 0.0, 0.0
    layers = model.attention_layers()
    dtype_bytes = cache_dtype(model).itemsize
    for i, layer in enumerate(layers):
        if i in skip_layers:
            continue
        for shape in layer.cache_spec().values():
            kv_bytes += float(np.prod(shape)) * dtype_bytes
        heads = getattr(layer, "num_heads", 1)
        head_dim = getattr(layer, "head_dim", None) or getattr(layer, "v_dim", 1)
        flops += 4 * heads * head_dim  # q.k and p.v
    return kv_bytes, flops


# --- fitting ---------------------------------------------------------------------------------


def fit_coefficients(
    rows: list[dict[str, float]],
    measured_ms: list[float],
    floors: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Non-negative least squares on relative error: each row is divided by its measured time,
    so a 5 ms step weighs as much as a 50 ms one. `floors`: {feature: least ms per unit}, each
    such coefficient fitted as its floor plus a non-negative rest. Returns {feature: ms per
    unit}."""
    if len(rows) != len(measured_ms) or not rows:
        raise ValueError("need one measured time per feature row, and at least one row")
    names = sorted({name for row in rows for name in row})
    x = np.array([[row.get(name, 0.0) for name in names] for row in rows])
    y = np.asarray(measured_ms, dtype=float)
    floor = np.array([(floors or {}).get(name, 0.0) for name in names])
    rest, _ = nnls(x / y[:, None], 1.0 - (x @ floor) / y)
    return dict(zip(names, (floor + rest).tolist()))


def weight_byte_floors(rows: list[dict[str, float]], read_gbps: float) -> dict[str, float]:
    """{<kind>:MB: ms per MB at the measured read bandwidth} for the weight kinds in `rows`: no
    kernel streams a weight faster than memory delivers it. The decode fit on SmolLM2 alone
    cannot tell a small model's per-call costs from its bytes and gave some kinds bytes for
    free (bf16 GGUF, w4a8), which mispredicted large models of those kinds by 2x. KV bytes get
    no floor: a short context's stay in cache."""
    ms_per_mb = 1.0 / read_gbps  # 1e6 bytes / (read_gbps * 1e9 bytes/s) in ms
    return {
        name: ms_per_mb
        for row in rows
        for name in row
        if name.endswith(":MB") and not name.startswith("kv")
    }


def predict(coefficients: Mapping[str, float], features: Mapping[str, float]) -> float:
    unknown = sorted(n for n, v in features.items() if v and n not in coefficients)
    if unknown:
        raise ValueError(
            f"the cost model was not fitted for {', '.join(unknown)}; refit with plans using it"
        )
    return sum(coefficients[name] * value for name, value in features.items() if value)


# --- the model -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostModel:
    decode: dict[str, float]  # feature -> ms per unit, decode steps
    prefill: dict[str, float]  # the same for prefill steps
    fingerprint: str  # the hardware this was fitted on
    fit_plans: tuple[str, ...] = ()  # names of the plans measured for the fit
    # Cores other processes kept busy while fitting, per logical core (zcode.hardware.load;
    # None: unknown): steps timed on a busy machine are slower than idle, and so is every
    # prediction.
    fit_load_per_core: float | None = None
    # Decode coefficients of compiled steps (`fit_compiled`); None: not fitted on this machine.
    compiled_decode: dict[str, float] | None = None
    # The read bandwidth (GB/s) measured before and after the eager fit's steps, the higher
    # (None: not measured): the steps' costs per byte hold at about that bandwidth, and a shared
    # host's moves (zcode.hardware.probe.read_bandwidth_gbps).
    fit_read_gbps: float | None = None

    @property
    def fitted_under_load(self) -> bool:
        return self.fit_load_per_core is not None and self.fit_load_per_core > BUSY_LOAD_PER_CORE

    @classmethod
    def load_or_fit(
        cls,
        info: HardwareInfo | None = None,
        *,
        refresh: bool = False,
        cache_dir: Path | None = None,
        compiled: bool = False,
    ) -> "CostModel":
        """This machine's fitted model from the cache, else fitted now (minutes) and
        cached. `info` defaults to the (cached) hardware probe. `compiled`: with coefficients
        of compiled steps too (fitted now, minutes more, if the cached model has none)."""
        from zcode.hardware.cost_fit import fit_compiled, fit_smollm2

        info = info or probe(cache_dir=cache_dir)
        key = cost_key(info)
        model = None if refresh else cls.cached(info, cache_dir)
        if model is None:
            model, _ = fit_smollm2(key, info.read_bandwidth_gbps)
            if model.fitted_under_load:
                logger.warning(stale_note(model))
            model.save(cache_path(key, cache_dir))
        if compiled and model.compiled_decode is None:
            model, _ = fit_compiled(model, info.read_bandwidth_gbps)
            model.save(cache_path(key, cache_dir))
        return model

    @classmethod
    def cached(
        cls, info: HardwareInfo | None = None, cache_dir: Path | None = None
    ) -> "CostModel | None":
        """This machine's fitted model if one is cached, else None; measures nothing (not even
        the hardware probe when `info` is None)."""
        key = cost_key(info)
        cached = cls.load(cache_path(key, cache_dir))
        return cached if cached is not None and cached.fingerprint == key else None

    def predict_decode_ms(
        self,
        model: nn.Module,
        plan: Plan = None,
        *,
        batch_size: int = 1,
        context_len: int = 512,
        modules: Mapping[str, nn.Module] | None = None,
        compiled: bool = False,
        kv_paged: bool = False,
    ) -> float:
        """`modules`: {name: module} predicted in place of the model's own (a precision
        variant's modules, without swapping them in); `compiled`: a compiled step;
        `kv_paged`: an engine keeping KV per head (per_request_depth)."""
        return self.predict_step_ms(
            model, plan, num_tokens=batch_size, num_seqs=batch_size, context_len=context_len,
            modules=modules, compiled=compiled, kv_paged=kv_paged,
        )  # fmt: skip

    def predict_step_ms(
        self,
        model: nn.Module,
        plan: Plan = None,
        *,
        num_tokens: int,
        num_seqs: int,
        context_len: int = 512,
        modules: Mapping[str, nn.Module] | None = None,
        compiled: bool = False,
        kv_paged: bool = False,
    ) -> float:
        """ms of one decode-like step computing `num_tokens` new tokens over `num_seqs`
        sequences (more tokens than sequences: a step verifying drafted tokens). `compiled`:
        one compiled graph, which computes logits for all `num_tokens` tokens."""
        step = functools.partial(
            step_features, model, plan, num_tokens, context_len, num_seqs, modules
        )  # fmt: skip
        if not compiled:
            return predict(self.decode, step(kv_paged=kv_paged))
        if self.compiled_decode is None:
            raise ValueError(
                "the cost model has no fit of compiled steps: zcode hw --fit-cost --compiled"
            )
        # The compiled fit has no engine keeping KV per head: its steps are priced as flat KV's.
        return predict(self.compiled_decode, step(logits_rows=num_tokens, compiled=True))

    def predict_prefill_ms(
        self, model: nn.Module, plan: Plan = None, *, prompt_len: int = 256
    ) -> float:
        return predict(self.prefill, step_features(model, plan, prompt_len, prompt_len))

    @classmethod
    def load(cls, path: Path) -> "CostModel | None":
        try:
            data = json.loads(path.read_text())
            if data.pop("schema") != _SCHEMA_VERSION:
                return None
            return cls(**{**data, "fit_plans": tuple(data["fit_plans"])})
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError) as e:
            logger.warning("ignoring unreadable cost model cache %s: %s", path, e)
            return None

    def save(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            blob = {"schema": _SCHEMA_VERSION, **dataclasses.asdict(self)}
            tmp.write_text(json.dumps(blob, indent=2) + "\n")
            os.replace(tmp, path)
        except OSError as e:
            logger.warning("could not write cost model cache %s: %s", path, e)


def format_cost(cost: CostModel | None) -> str:
    """One report line: the fitted decode cost as fixed ms per step, and per kernel kind the
    effective GB/s of its weight bytes and the us each call adds."""
    if cost is None:
        return "cost       not fitted (zcode hw --fit-cost, or bench/bench_cost_model.py)"
    line = f"cost       decode {_format_coefficients(cost.decode)}"
    line += f" (fit on {len(cost.fit_plans)} plans"
    line += f" at {cost.fit_read_gbps:.1f} GB/s read)" if cost.fit_read_gbps else ")"
    if cost.compiled_decode is None:
        line += "\n           compiled decode not fitted (zcode hw --fit-cost --compiled)"
    else:
        line += f"\n           compiled decode {_format_coefficients(cost.compiled_decode)}"
    return line + (f"\n           {stale_note(cost)}" if cost.fitted_under_load else "")


def _format_coefficients(c: Mapping[str, float]) -> str:
    kinds = sorted({name.split(":")[0] for name in c if name.endswith(":MB")} - {"kv", "kv-paged"})

    def rate(name: str) -> str:
        ms_per_mb = c.get(name, 0.0)
        return f"{1 / ms_per_mb:.1f} GB/s" if ms_per_mb > 0 else "bytes free"

    parts = [f"{c.get('step', 0.0):.2f} ms/step", f"KV {rate('kv:MB')}"]
    for kind in kinds:
        parts.append(
            f"{kind} {rate(kind + ':MB')} + {1e3 * c.get(kind + ':calls', 0.0):.0f} us/call"
        )
    return "; ".join(parts)


def stale_note(cost: CostModel) -> str:
    """What to do about a fit measured on a busy machine."""
    return (
        f"the cost model was fitted while other processes kept {cost.fit_load_per_core:.0%} of "
        "the cores busy, so it "
        "predicts slower than idle: refit on an idle machine (`zcode hw --fit-cost --refresh`)"
    )


def cost_key(info: HardwareInfo | None = None) -> str:
    """The key a fitted model is cached under: the machine and the kernels it measured (`info`
    None: this machine, from its static facts, without probing)."""
    return f"{fingerprint(info)}-kernels{KERNELS_VERSION}"


def cache_path(key: str, cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / f"cost-model-{key}.json"
