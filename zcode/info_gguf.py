"""The GGUF files llama.cpp would make of a model, from its config alone: for `zcode info`.

File types are llama.cpp's bf16 and Q8_0 (written by its converter) and Q4_K_M and Q4_0
(llama-quantize of the bf16 file). `file_tensors` lists the tensors such a file holds and
`gguf_tensor_types` the ggml type each gets, by llama.cpp's own rules: conversion/base.py's F32
tensors and its Q8_0 -> F16 fallback; llama-quant.cpp's llama_tensor_get_type for these two
mixes (Q6_K for output and for attn_v / ffn_down on the `use_more_bits` layers, Q8_0 attn_k /
attn_v for 8-expert models, the fallbacks for rows that are not whole blocks). Bytes come from
gguf's GGML_QUANT_SIZES."""

import re
from dataclasses import dataclass, replace

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, get_tensor_name_map
from gguf.constants import MODEL_ARCH_NAMES
from torch import nn

from zcode.layers.moe import MoE
from zcode.loader.gguf_config import MODEL_TYPES

FILE_TYPES = ("bf16", "q8_0", "q4_k_m", "q4_0")
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")
_LAYER = re.compile(r"^blk\.(\d+)\.")
_CATEGORIES = (  # llama-quant.cpp tensor_get_category, in its order
    ("attn_qkv.weight", "attn_qkv"),
    ("attn_kv_b.weight", "attn_kv_b"),
    ("attn_v.weight", "attn_v"),
    ("attn_k.weight", "attn_k"),
    ("attn_q.weight", "attn_q"),
    ("attn_output.weight", "attn_output"),
    ("ffn_up", "ffn_up"),
    ("ffn_gate", "ffn_gate"),
    ("ffn_down", "ffn_down"),
)
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # rows not whole 256-blocks


@dataclass(frozen=True)
class FileTensor:
    name: str  # GGUF name
    rows: int  # all rows (stacked experts, heads included)
    cols: int  # ne[0]: the row length blocks are cut from
    num_dims: int
    modules: tuple[str, ...]  # the model's linears it holds (none for norms, embedding, router)

    def nbytes(self, ggml_type: str) -> int:
        block_size, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
        return self.rows * self.cols // block_size * block_bytes


def file_tensors(net: nn.Module) -> list[FileTensor]:
    """The tensors llama.cpp's converter writes for this model (no MTP layers), in layer order."""
    config = net.config
    arch_name = next((a for a, t in MODEL_TYPES.items() if t == config.model_type), None)
    if arch_name is None:
        raise ValueError(f"no GGUF architecture for {config.model_type!r}")
    arch = next(a for a, name in MODEL_ARCH_NAMES.items() if name == arch_name)
    name_map = get_tensor_name_map(arch, config.num_hidden_layers)
    named = dict(net.named_parameters())
    named.update((n, b) for n, b in net.named_buffers() if n.endswith("e_score_correction_bias"))
    out: dict[str, FileTensor] = {}
    for hf_name, p in named.items():
        module = hf_name.rsplit(".", 1)[0]
        if match := _EXPERT.match(hf_name):  # experts.J.up_proj -> one [E, out, in] tensor
            merged = f"{match.group(1)}.{match.group(3)}"
            name = name_map.get_name(merged) + ".weight"
            t = out.get(name, FileTensor(name, 0, p.shape[1], 3, ()))
            out[name] = replace(t, rows=t.rows + p.shape[0], modules=t.modules + (module,))
        elif hf_name.endswith("e_score_correction_bias"):
            layer = re.search(r"layers\.(\d+)\.", hf_name).group(1)
            name = f"blk.{layer}.exp_probs_b.bias"
            out[name] = FileTensor(name, 1, p.numel(), 1, ())
        elif hf_name.endswith("kv_b_proj.weight"):  # the converter splits it per head
            stem = name_map.get_name(module).removesuffix("attn_kv_b")
            out.update((t.name, t) for t in _split_kv_b(stem, config, module))
        else:
            suffix = ".weight" if hf_name.endswith(".weight") else ".bias"
            stem = name_map.get_name(module)
            if stem is None:
                raise ValueError(f"no GGUF name for {hf_name!r}")
            name = stem + suffix
            if p.dim() == 2:
                linear = (module,)
                if module == "model.embed_tokens":  # a tied lm_head runs the embedding's tensor
                    head = getattr(getattr(net, "lm_head", None), "weight", None)
                    linear = ("lm_head",) if head is p else ()
                out[name] = FileTensor(name, p.shape[0], p.shape[1], 2, linear)
            else:
                out[name] = FileTensor(name, 1, p.numel(), 1, ())
    return list(out.values())


def _split_kv_b(stem: str, c, module: str) -> list[FileTensor]:
    heads = c.num_attention_heads
    return [  # attn_k_b [H, kv_lora_rank, nope] (transposed), attn_v_b [H, v_dim, kv_lora_rank]
        FileTensor(f"{stem}attn_k_b.weight", heads * c.kv_lora_rank, c.qk_nope_head_dim, 3, ()),
        FileTensor(f"{stem}attn_v_b.weight", heads * c.v_head_dim, c.kv_lora_rank, 3, (module,)),
    ]


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    return next((cat for key, cat in _CATEGORIES if key in name), "other")


def _converter_type(t: FileTensor, file_type: str) -> str:
    """The type llama.cpp's converter writes `t` as, for outtype bf16 or q8_0."""
    if (
        t.num_dims <= 1
        or t.name.endswith("_norm.weight")
        or not t.name.endswith(".weight")
        or "ffn_gate_inp" in t.name
        or "indexer.proj" in t.name
    ):
        return "F32"
    if file_type == "bf16":
        return "BF16"
    return "Q8_0" if t.cols % 32 == 0 else "F16"  # gguf.QuantError -> F16


def gguf_tensor_types(tensors: list[FileTensor], file_type: str, net: nn.Module) -> list[str]:
    """The ggml type of each tensor in a `file_type` file (bf16, q8_0, q4_0, q4_k_m)."""
    if file_type in ("bf16", "q8_0"):
        return [_converter_type(t, file_type) for t in tensors]
    if file_type not in ("q4_0", "q4_k_m"):
        raise ValueError(f"unknown file type {file_type!r}; known: {', '.join(FILE_TYPES)}")
    c = net.config
    k_m = file_type == "q4_k_m"
    default = "Q4_K" if k_m else "Q4_0"
    moe = [m for m in net.modules() if isinstance(m, MoE)]
    num_experts = moe[0].gate.num_experts if moe else 0
    num_layers = c.num_hidden_layers + (getattr(c, "num_nextn_predict_layers", 0) or 0)
    tied = not any(t.name == "output.weight" for t in tensors)
    attn_v = [t for t in tensors if _category(t.name) in ("attn_v", "attn_qkv", "attn_kv_b")]
    num_attn_v = len(attn_v) * num_layers // max(1, c.num_hidden_layers)  # + the MTP layers'

    def more_bits(i: int, n: int) -> bool:
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

    types = []
    for t in tensors:
        source = _converter_type(t, "bf16")
        quantizable = (
            t.num_dims >= 2
            and t.name.endswith("weight")
            and "_norm.weight" not in t.name
            and "ffn_gate_inp.weight" not in t.name
        )
        if not quantizable:
            types.append(source)
            continue
        new, cat = default, _category(t.name)
        if cat == "output" or (tied and cat == "token_embd"):
            block_size = GGML_QUANT_SIZES[GGMLQuantizationType[new]][0]
            new = "Q8_0" if t.cols % block_size else "Q6_K"
        elif cat in ("attn_v", "attn_qkv", "attn_kv_b"):
            if k_m and more_bits(attn_v.index(t), num_attn_v):
                new = "Q6_K"
            if num_experts == 8:
                new = "Q8_0"
        elif cat == "attn_k" and num_experts == 8:
            new = "Q8_0"
        elif cat == "ffn_down" and k_m:
            layer = int(_LAYER.match(t.name).group(1))
            if more_bits(layer, num_layers):
                new = "Q6_K"
        elif cat == "attn_output" and k_m and num_experts == 8:
            new = "Q5_K"
        if t.cols % GGML_QUANT_SIZES[GGMLQuantizationType[new]][0]:
            new = _FALLBACK.get(new, new)
            if t.cols % GGML_QUANT_SIZES[GGMLQuantizationType[new]][0]:
                new = "F16"
        types.append(new)
    return types
