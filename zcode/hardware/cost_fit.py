"""Measuring the cost model's ground truth: engine step times of SmolLM2-135M under several plans.

`fit_smollm2` measures FIT_PLANS at FIT_SETTINGS (the sparse FFN's SPARSE_FIT_PLANS at batch 1,
WIDE_FIT_PLANS: the same formats on a wide random model, and MOE_FIT_PLANS on a random
GLM-4.5-shaped MoE: RANDOM_MODELS; each model also as llama.cpp's GGUF files of it,
`gguf_file_linears`) and fits the coefficients, `fit_compiled` those of compiled
decode steps (COMPILED_FIT_PLANS on a few layers of the model, at two depths);
`check_smollm2` measures CHECK_PLANS, which the fit never saw (other formats, other mixes, other
batch sizes and context lengths), and returns predicted against measured for each. Step times
are best-of: decode the fastest of several timed engine steps after a warm-up step, prefill the
fastest of a few one-step prefills (other processes only ever make a step slower, so the
minimum is the estimate of the idle machine's time that the model predicts).
"""

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from gguf import GGMLQuantizationType
from torch import nn

from zcode.hardware.cost_model import (
    DECODE,
    PREFILL,
    CostModel,
    fit_coefficients,
    predict,
    step_features,
    weight_byte_floors,
)
from zcode.hardware.load import BUSY_LOAD_PER_CORE, measure_other_load
from zcode.hardware.probe import read_bandwidth_gbps
from zcode.harness.plan import ExecutionPlan
from zcode.harness.planner import ffn_read_fraction
from zcode.info_gguf import FILE_TYPES
from zcode.quant.gguf import GgufWeight, interleaving_pays
from zcode.quant.linear import QuantizedLinear
from zcode.spec.drafter import Drafter

logger = logging.getLogger(__name__)

Formats = Callable[[list[str]], dict[str, str]]


def _uniform(fmt: str, head: bool = True) -> Formats:
    return lambda names: {n: fmt for n in names if head or n != "lm_head"}


def _by_part(attn: str, mlp: str, head: str) -> Formats:
    def formats(names: list[str]) -> dict[str, str]:
        return {n: head if n == "lm_head" else attn if ".self_attn." in n else mlp for n in names}

    return formats


@dataclass(frozen=True)
class PlanSpec:
    name: str
    dtype: str  # the model's load dtype
    formats: Formats  # quantizable module names -> {module: format}
    category: str  # dense, int8, int4, other: how the check reports errors
    # Every FFN a SparseMLP at this (input, intermediate) sparsity, its thresholds the
    # quantiles of the fit's own prompts' activations; None: the FFNs as loaded.
    ffn_level: tuple[float, float] | None = None
    ffn_weights: str = "fp32"  # the rows those SparseMLPs read (zcode.sparsity.WEIGHT_FORMATS)
    kv_paged: bool = False  # an engine keeping KV per head (per_request_depth)
    model: str = "smollm2"  # or a key of RANDOM_MODELS
    # The linears as a llama.cpp file of this type (zcode.info_gguf.FILE_TYPES) holds them, on
    # ggml.cpp's kernels (`gguf_file_linears`; `formats` unused); None: `formats`.
    file_type: str | None = None


# fmt: off
FIT_PLANS = (
    PlanSpec("fp32", "float32", _uniform("fp32"), "dense"),
    PlanSpec("bf16-model", "bfloat16", _uniform("fp32"), "dense"),
    PlanSpec("int8", "float32", _uniform("int8"), "int8"),
    PlanSpec("int8-body", "float32", _uniform("int8", head=False), "int8"),
    PlanSpec("int4-g32", "float32", _uniform("int4-g32"), "int4"),
    PlanSpec("int4-g32-body", "float32", _uniform("int4-g32", head=False), "int4"),
    PlanSpec("bf16", "float32", _uniform("bf16"), "other"),
    PlanSpec("w8a8", "float32", _uniform("w8a8"), "other"),
    PlanSpec("w4a8", "float32", _uniform("w4a8"), "other"),
    PlanSpec("attn-int8/mlp-int4/head-bf16", "float32", _by_part("int8", "int4-g32", "bf16"),
             "other"),
    PlanSpec("fp32-kv-paged", "float32", _uniform("fp32"), "dense", kv_paged=True),
    *(PlanSpec(f"gguf-{file_type}", "float32", _uniform("fp32"), "gguf", file_type=file_type)
      for file_type in FILE_TYPES),
)
# The sparse FFN kernel at two densities (every row; 0.43 of them) on fp32 and on int8 rows,
# timed at batch 1 only: a batch reads the union of its tokens' kept rows, which the plan's
# density does not say.
SPARSE_FIT_PLANS = tuple(
    PlanSpec(f"sparse-ffn-{name}{suffix}", "float32", _uniform("fp32"), "sparse", level, rows)
    for name, level in (("every-row", (0.0, 0.0)), ("0.5/0.7", (0.5, 0.7)))
    for rows, suffix in (("fp32", ""), ("int8", "-int8-rows"))
)
# Random models of SmolLM2's vocabulary (seeded weights). "wide": Llama-shaped, 2 layers of
# hidden 2048 and FFN 8192 (222M parameters, 0.44 GB in bf16), whose decode steps are mostly
# weight bytes. On SmolLM2 alone a step's fixed costs (~20 ms eager: 30 layers of small linears)
# grow with its bytes plan by plan, and the fit put them on the bytes: bf16 at 14 GB/s and nothing
# on the step, which priced the decode of a 6B MoE (2.1 GB read per token) at 2.1-2.6x its
# measured time. "moe": GLM-4.5-shaped, 1 dense and 3 MoE layers of 32 experts (8 routed + 1
# shared) at hidden 1024, whose steps run a router and the fused expert op in each MoE layer
# (`moe:layers`): without them the fit priced a 300M GLM-4.5-shaped model's fp32 steps 9-34%
# under their measured times. Its heads are GLM-4.5-Air's 12 query heads per KV head of 128, and
# one of its settings decodes after 2048 positions: SmolLM2's 3 per KV head of 64 at up to 512
# positions alone priced attention by a rate per GFLOP that put a 1.3B GLM-4.5-shaped file's
# eager step at 4096 positions at 43 ms against 22.8 measured.
RANDOM_MODELS = {
    "wide": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 2,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
    },
    "moe": {
        "model_type": "glm4_moe",
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "moe_intermediate_size": 512,
        "num_hidden_layers": 4,
        "first_k_dense_replace": 1,
        "n_routed_experts": 32,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "num_attention_heads": 24,
        "num_key_value_heads": 2,
        "head_dim": 128,
    },
}
WIDE_FIT_PLANS = tuple(
    dataclasses.replace(p, name=f"wide-{p.name}", model="wide")
    for p in FIT_PLANS
    if not p.kv_paged
)
# The MoE's experts as they load from safetensors (fp32 or bf16 Linears, the fused expert op)
# and from GGUF files (ggml_moe).
MOE_FIT_PLANS = tuple(
    dataclasses.replace(p, name=f"moe-{p.name}", model="moe")
    for p in FIT_PLANS
    if p.name in ("fp32", "bf16-model") or p.file_type is not None
)
CHECK_PLANS = (
    PlanSpec("fp32", "float32", _uniform("fp32"), "dense"),
    PlanSpec("bf16-model", "bfloat16", _uniform("fp32"), "dense"),
    PlanSpec("attn-fp32/mlp-int8/head-fp32", "float32", _by_part("fp32", "int8", "fp32"), "int8"),
    PlanSpec("attn-int8/mlp-int8/head-bf16", "float32", _by_part("int8", "int8", "bf16"), "int8"),
    PlanSpec("int4-g64", "float32", _uniform("int4-g64"), "int4"),
    PlanSpec("int4-g128", "float32", _uniform("int4-g128"), "int4"),
    PlanSpec("attn-int4/mlp-int4/head-int8", "float32", _by_part("int4-g64", "int4-g128", "int8"),
             "int4"),
)
# (mode, batch size, context or prompt length, tokens per sequence). Decode at 16 sequences: a
# speculative step verifies B x (1 + k) tokens, and with only 1- and 4-token steps the fit priced
# the rows past the first near zero, so drafting looked free at batch 4 (bench_spec: 0.73x, never
# turned off). And at 48 sequences: rows past the float GEMV's 32, whose GEMM arithmetic (a
# batch of 16 verifying 2 drafts each) a decode step has no other measure of
# (zcode.hardware.cost_model: FLOAT_GEMV_KINDS).
FIT_SETTINGS = ((DECODE, 1, 64, 1), (DECODE, 1, 512, 1), (DECODE, 4, 256, 1),
                (DECODE, 16, 128, 1), (DECODE, 48, 128, 1), (PREFILL, 1, 64, 1),
                (PREFILL, 1, 256, 1))
SPARSE_FIT_SETTINGS = ((DECODE, 1, 64, 1), (DECODE, 1, 512, 1))
WIDE_FIT_SETTINGS = ((DECODE, 1, 64, 1), (DECODE, 4, 64, 1))
MOE_FIT_SETTINGS = ((DECODE, 1, 64, 1), (DECODE, 1, 2048, 1), (DECODE, 4, 64, 1),
                    (PREFILL, 1, 64, 1))
CHECK_SETTINGS = ((DECODE, 1, 1000, 1), (DECODE, 2, 128, 1), (PREFILL, 1, 160, 1))
# fmt: on
# Compiled steps: one plan per kernel kind, on the first 2 and 8 decoder layers of SmolLM2
# (embeddings and lm_head whole). The features count per linear, so a few layers identify the same
# coefficients, and a graph of 8 layers builds in ~20 s here against ~80 s for all 30 (three graphs
# an engine: batch buckets 1, 4 and 16). Two depths, because at one depth every plan makes as
# many linear calls per step as every other, and the fit cannot tell a cost per call from a cost
# per step (a fit at 6 layers alone put no cost on the step and priced a 30-layer W4A8 step at
# 8.2 ms, against 6.7 from two depths and 6.3-7.4 measured). And steps verifying 3 drafts per
# sequence (graphs of width 4) at batch 1 and 4: with one token per sequence in every step, a
# cost per token and a cost per sequence cannot be told apart either, and the fit priced that
# step at batch 1 at 1.7 plain steps of the full model against 1.04 measured, so the draft
# policy refused drafts that paid.
COMPILED_FIT_DEPTHS = (2, 8)
# The four GGUF kinds from two files: SmolLM2's Q4_K_M (Q4_K and Q6_K rows, Q5_0 and Q8_0 where
# its 576-wide rows are not whole 256-blocks) and bf16; all four files took the compiled fit
# past 54 min here.
_ONE_PER_KIND = ("fp32", "bf16-model", "int8", "int4-g32", "bf16", "w8a8", "w4a8")
_ONE_PER_KIND += ("gguf-q4_k_m", "gguf-bf16")
COMPILED_FIT_PLANS = tuple(p for p in FIT_PLANS if p.name in _ONE_PER_KIND)
COMPILED_FIT_SETTINGS = (
    *(s for s in FIT_SETTINGS if s[0] == DECODE),
    (DECODE, 1, 256, 4),
    (DECODE, 4, 256, 4),
)
NUM_ROUNDS = 2
# Room for the largest setting (16 x 136 or 1 x 1008 tokens of SmolLM2, 46 KB each in fp32), not the
# engine's default 1 GiB: one engine per dtype and every plan's quantized copy stay resident.
KV_CACHE_BYTES = 128 << 20
NUM_DECODE_STEPS = 6
NUM_PREFILL_REPEATS = 2


@dataclass(frozen=True)
class Measurement:
    plan: PlanSpec
    mode: str
    batch_size: int
    context_len: int
    width: int  # tokens per sequence: 1 + the drafts a verifying step checks
    features: dict[str, float]  # of the plan given as data on the unquantized model
    measured_ms: float


def fit_smollm2(
    fingerprint: str, read_gbps: float | None = None
) -> tuple[CostModel, list[Measurement]]:
    """Measures FIT_PLANS at FIT_SETTINGS (SPARSE_FIT_PLANS at SPARSE_FIT_SETTINGS,
    WIDE_FIT_PLANS at WIDE_FIT_SETTINGS, MOE_FIT_PLANS at MOE_FIT_SETTINGS) on this machine and
    fits a CostModel to them; returns it with the measurements it was fitted to. `read_gbps`: the
    measured read bandwidth, the floor of the cost per byte of the kinds no wide step measured."""
    bandwidth_before = read_bandwidth_gbps()
    measurements, other_load = measure_other_load(
        lambda: (
            measure_plans(FIT_PLANS, FIT_SETTINGS)
            + measure_plans(SPARSE_FIT_PLANS, SPARSE_FIT_SETTINGS)
            + measure_plans(WIDE_FIT_PLANS, WIDE_FIT_SETTINGS)
            + measure_plans(MOE_FIT_PLANS, MOE_FIT_SETTINGS)
        )
    )
    fit_read_gbps = max(bandwidth_before, read_bandwidth_gbps())
    coefficients = {
        mode: _fit([m for m in measurements if m.mode == mode], read_gbps)
        for mode in (DECODE, PREFILL)
    }
    cost = CostModel(
        coefficients[DECODE],
        coefficients[PREFILL],
        fingerprint,
        tuple(p.name for p in FIT_PLANS + SPARSE_FIT_PLANS + WIDE_FIT_PLANS + MOE_FIT_PLANS),
        None if other_load is None else other_load / (os.cpu_count() or 1),
        fit_read_gbps=fit_read_gbps,
    )
    return cost, measurements


def _fit(measurements: list[Measurement], read_gbps: float | None) -> dict[str, float]:
    """Floors only where no wide-model step measured the kind: those steps, mostly bytes, pin
    its cost per byte, and the probe's bandwidth moves with what the host's other tenants do
    (30 to 58 GB/s within an hour here), so as a floor it overpriced every kind at times (dense
    bf16 streamed 39 GB/s while the probe read 30)."""
    rows = [m.features for m in measurements]
    wide = {name for m in measurements if m.plan.model == "wide" for name in m.features}
    floors = None
    if read_gbps is not None:
        floors = {k: v for k, v in weight_byte_floors(rows, read_gbps).items() if k not in wide}
    return fit_coefficients(rows, [m.measured_ms for m in measurements], floors)


def fit_compiled(
    cost: CostModel,
    read_gbps: float | None = None,
    plans: tuple[PlanSpec, ...] = COMPILED_FIT_PLANS,
    settings=COMPILED_FIT_SETTINGS,
) -> tuple[CostModel, list[Measurement]]:
    """`cost` with decode coefficients of compiled steps fitted to `plans` measured compiled at
    `settings` on this machine (weight bytes no faster than `read_gbps`); and the
    measurements."""
    measurements, other_load = measure_other_load(
        lambda: measure_plans(plans, settings, compiled=True)
    )
    if other_load is not None and other_load / (os.cpu_count() or 1) > BUSY_LOAD_PER_CORE:
        logger.warning(
            "compiled steps were timed while other processes kept %.1f cores busy: the fit "
            "predicts slower than idle (refit: zcode hw --fit-cost --compiled --refresh)",
            other_load,
        )
    return dataclasses.replace(cost, compiled_decode=_fit(measurements, read_gbps)), measurements


def check_smollm2(
    cost: CostModel, plans: tuple[PlanSpec, ...] = CHECK_PLANS, settings=CHECK_SETTINGS
) -> list[tuple[Measurement, float]]:
    """(measurement, predicted ms) for each held-out plan and setting."""
    out = []
    for m in measure_plans(plans, settings):
        out.append((m, predict(cost.decode if m.mode == DECODE else cost.prefill, m.features)))
    return out


def measure_plans(
    plans: tuple[PlanSpec, ...],
    settings: tuple[tuple[str, int, int, int], ...],
    num_rounds: int = NUM_ROUNDS,
    compiled: bool = False,
) -> list[Measurement]:
    """Each plan at each setting, best of `num_rounds` rounds. A round visits every plan in
    turn (its quantized modules or SparseMLPs swapped in, then the originals back), so load
    from other processes spreads over all plans instead of spoiling the one measured while it
    lasted.
    `compiled`: every plan an engine of its own with compiled decode steps at each of
    COMPILED_FIT_DEPTHS (graphs are built in each setting's untimed first step)."""
    from zcode import LLM
    from zcode.quant import apply_precision, quantizable_modules
    from zcode.quant.variants import swap, swapped

    if compiled:
        prepared = [
            (spec, *_compiled_engine(spec, settings, depth))
            for spec in plans
            for depth in COMPILED_FIT_DEPTHS
        ]
    else:
        if any(width > 1 for *_, width in settings):  # the LLMs' engines have no drafter
            raise NotImplementedError("verifying steps are measured compiled only")
        llms = {
            (dtype, paged, name): _random_llm(name, dtype)
            if name != "smollm2"
            else LLM(
                None,
                dtype=dtype,
                enable_prefix_caching=False,
                kv_cache_bytes=KV_CACHE_BYTES,
                per_request_depth=paged,
            )
            for dtype, paged, name in dict.fromkeys((p.dtype, p.kv_paged, p.model) for p in plans)
        }
        prepared = []  # (spec, engine, {name: module swapped in}, {setting: features})
        for spec in plans:
            llm = llms[spec.dtype, spec.kv_paged, spec.model]
            model = llm.model
            if spec.file_type is not None:
                swapped_in = gguf_file_linears(model, spec.file_type)
                features = functools.partial(step_features, model, _formats(swapped_in))
                rows = {s: _features(features, *s) for s in settings}
            elif spec.ffn_level is not None:
                swapped_in = _sparse_ffns(llm, spec.ffn_level, spec.ffn_weights)
                plan = ExecutionPlan(ffn_density=ffn_read_fraction(*spec.ffn_level))
                features = functools.partial(step_features, model, plan, modules=swapped_in)
                rows = {s: _features(features, *s) for s in settings}
            else:
                formats = spec.formats(quantizable_modules(model))
                features = functools.partial(step_features, model, formats)
                rows = {s: _features(features, *s, kv_paged=spec.kv_paged) for s in settings}
                originals = dict(model.named_modules())
                swapped_in = apply_precision(model, formats)
                swap(model, {name: originals[name] for name in swapped_in})
            prepared.append((spec, llm.engine, swapped_in, rows))
    best: dict[tuple[int, tuple[str, int, int, int]], float] = {}
    for _ in range(num_rounds):
        for i, (_, engine, quantized, rows) in enumerate(prepared):
            with swapped(engine.model, quantized):
                _measure_decode(engine, 1, 16)  # warm-up: first calls pick kernels
                for setting in rows:
                    mode, b, n, width = setting
                    ms = (
                        _measure_decode(engine, b, n, width)
                        if mode == DECODE
                        else _measure_prefill(engine, n)
                    )
                    best[i, setting] = min(ms, best.get((i, setting), float("inf")))
    return [
        Measurement(spec, *setting, features, best[i, setting])
        for i, (spec, _, _, rows) in enumerate(prepared)
        for setting, features in rows.items()
    ]


def gguf_file_linears(model: nn.Module, file_type: str) -> dict[str, QuantizedLinear]:
    """{name: module} for each linear of `model` that a llama.cpp `file_type` file of it holds
    (zcode.info_gguf: the tensor's ggml type, as `zcode info` plans it), as ZCode loads that file:
    a QuantizedLinear of a GgufWeight on ggml.cpp's kernels, interleaved where that pays here, a
    MoE layer's routed experts of a projection the views of one stacked tensor. The blocks are of
    random weights (GgufWeight.random: the time of a step does not depend on them); the model's
    biases are kept. The linears ZCode keeps in fp32 and MoE routers are left out."""
    from zcode.info_fit import ggml_plan
    from zcode.info_gguf import file_tensors, gguf_tensor_types

    tensors = file_tensors(model)
    plan = ggml_plan(tensors, gguf_tensor_types(tensors, file_type, model))
    generator = torch.Generator().manual_seed(0)
    out = {}
    for t in tensors:
        names = [n for n in t.modules if plan[n] != "fp32"]
        linears = [model.get_submodule(n) for n in names]
        if not names or not isinstance(linears[0], nn.Linear):  # a MoE's router: a Parameter
            continue
        rows = linears[0].out_features
        fmt = plan[names[0]]
        ggml_type = GGMLQuantizationType[fmt.removeprefix("gguf-").upper()]
        weight = GgufWeight.random(ggml_type, rows * len(names), t.cols, generator)
        if interleaving_pays(ggml_type, rows):
            weight = weight.interleaved_copy()
        for i, (name, linear) in enumerate(zip(names, linears)):
            packed = weight.rows(i * rows, (i + 1) * rows)
            out[name] = QuantizedLinear(packed, linear.bias, fmt)
    return out


def _formats(modules: dict[str, QuantizedLinear]) -> dict[str, str]:
    return {name: module.format for name, module in modules.items()}


def _random_llm(name: str, dtype: str) -> SimpleNamespace:
    """RANDOM_MODELS[name] with seeded random weights in `dtype` (a MoE's routers too: zeros
    would route every token to the same experts) and SmolLM2's tokenizer: its `model` and an
    `engine` serving it, as an LLM has."""
    from transformers import AutoConfig

    from zcode.config import EngineConfig
    from zcode.engine.llm_engine import LLMEngine
    from zcode.layers.moe import MoE
    from zcode.loader.checkpoint import build_model, resolve_model_path
    from zcode.loader.gguf_file import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(resolve_model_path(None))
    fields = dict(RANDOM_MODELS[name])
    config = AutoConfig.for_model(
        fields.pop("model_type"), vocab_size=len(tokenizer), tie_word_embeddings=True, **fields
    )
    torch.manual_seed(0)
    model = build_model(config, device="cpu")
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        torch.nn.init.normal_(moe.gate.weight, std=config.hidden_size**-0.5)
    model = model.to(getattr(torch, dtype)).eval()
    engine_config = EngineConfig(
        dtype=dtype, enable_prefix_caching=False, kv_cache_bytes=KV_CACHE_BYTES
    )
    return SimpleNamespace(model=model, engine=LLMEngine(model, tokenizer, engine_config))


def _compiled_engine(spec: PlanSpec, settings, num_layers: int) -> tuple:
    """(engine compiling decode steps of the plan's first `num_layers` layers, {}: no modules
    to swap in, {setting: features}). Its drafter fills every slot (_FillingDrafter), so a
    setting of width w times steps verifying w - 1 drafts per sequence."""
    from zcode import LLM
    from zcode.quant import apply_precision, quantizable_modules
    from zcode.quant.variants import swap

    llm = LLM(None, dtype=spec.dtype, enable_prefix_caching=False, kv_cache_bytes=KV_CACHE_BYTES)
    model = llm.model
    model.model.layers = model.model.layers[:num_layers]
    if spec.file_type is not None:
        swapped_in = gguf_file_linears(model, spec.file_type)
        formats = _formats(swapped_in)
    else:
        formats = spec.formats(quantizable_modules(model))
    features = functools.partial(step_features, model, formats, compiled=True)
    rows = {setting: _features(features, *setting, logits_per_token=True) for setting in settings}
    if spec.file_type is not None:
        swap(model, swapped_in)
    else:
        apply_precision(model, formats)
    max_width = max(width for *_, width in settings)
    config = dataclasses.replace(llm.config, compile=True)
    return verifying_engine(model, llm.tokenizer, config, max_width - 1), {}, rows


def verifying_engine(model: nn.Module, tokenizer, config, max_drafts: int):
    """An LLMEngine whose requests may each verify up to `max_drafts` drafts a step, all slots
    filled at no cost (_FillingDrafter), as `_measure_decode` times steps of a given width."""
    from zcode.engine.llm_engine import LLMEngine

    if not max_drafts:
        return LLMEngine(model, tokenizer, config)
    config = dataclasses.replace(
        config, speculative="ngram", num_draft_tokens=max_drafts, draft_policy="fixed"
    )
    engine = LLMEngine(model, tokenizer, config)
    engine.drafter = _FillingDrafter()
    return engine


class _FillingDrafter(Drafter):
    """Drafts the last token again in every slot: free, and a verifying step of every width."""

    def propose(self, seqs, max_num_tokens):
        return [[seq.token_ids[-1]] * n for seq, n in zip(seqs, max_num_tokens)]


def _features(
    features: Callable[..., dict[str, float]],
    mode: str,
    batch_size: int,
    length: int,
    width: int,
    logits_per_token: bool = False,
    kv_paged: bool = False,
) -> dict[str, float]:
    """A setting's features by `features` (step_features with the model and plan bound).
    `logits_per_token`: lm_head runs over every token of a decode step (a compiled graph's),
    else over the last of each sequence."""
    if mode == DECODE:
        num_tokens = batch_size * width
        logits_rows = num_tokens if logits_per_token else batch_size
        return features(
            num_tokens, length, num_seqs=batch_size, logits_rows=logits_rows, kv_paged=kv_paged
        )
    return features(length, length, kv_paged=kv_paged)


def _sparse_ffns(llm, level: tuple[float, float], rows: str = "fp32") -> dict[str, nn.Module]:
    """{name: SparseMLP} for every FFN of `llm`'s model at `level` (sparsity of the FFN's
    inputs, of its intermediate activations) reading `rows`, thresholds from the activations of
    the prompts the fit decodes (so that decode keeps about the level's share of rows)."""
    from zcode import SamplingParams
    from zcode.sparsity.sparse_mlp import SparseMLP
    from zcode.sparsity.thresholds import ActivationRecorder

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    with ActivationRecorder(llm.model) as acts:
        for seed in range(4):
            llm.generate(_prompt(llm.engine, 128, seed), params)
    table = acts.table(levels=level)
    sparse = {
        f"model.layers.{i}.mlp": SparseMLP(mlp, *table.at(row, *level), table.score)
        for row, (i, mlp) in enumerate(sorted(acts.mlps.items()))
    }
    for mlp in sparse.values():
        mlp.set_weight_format(rows)
    return sparse


def _prompt(engine, length: int, seed: int) -> list[int]:
    """Token ids spread over the vocabulary of the engine's model, past its first 100."""
    vocab_size = engine.model.config.vocab_size
    return [(seed * 7919 + j * 104729) % (vocab_size - 100) + 100 for j in range(length)]


def _measure_decode(engine, batch_size: int, context_len: int, width: int = 1) -> float:
    """Best-of ms of one decode step of `batch_size` sequences at ~`context_len` context, each
    verifying `width` - 1 drafts (the engine's drafter fills every slot)."""
    from zcode import SamplingParams

    params = SamplingParams(
        max_tokens=(NUM_DECODE_STEPS + 2) * width,
        temperature=0,
        ignore_eos=True,
        num_draft_tokens=width - 1 if engine.drafter is not None else None,
    )
    seqs = [engine.add_request(_prompt(engine, context_len, i), params) for i in range(batch_size)]
    try:
        engine.step()  # the prefill
        engine.step()  # the first decode step pays for allocations of the new shapes
        times = []
        for _ in range(NUM_DECODE_STEPS):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
    finally:
        for seq in seqs:
            engine.abort(seq.request_id)
    return 1e3 * min(times)


def _measure_prefill(engine, prompt_len: int) -> float:
    """Best-of ms of prefilling one prompt of `prompt_len` tokens in one step."""
    from zcode import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times = []
    for i in range(NUM_PREFILL_REPEATS):
        seq = engine.add_request(_prompt(engine, prompt_len, i), params)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        engine.abort(seq.request_id)
    return 1e3 * min(times)
