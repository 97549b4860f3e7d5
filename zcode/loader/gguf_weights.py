"""A GGUF file's tensors put into a model built on the meta device, as the file stores them.

Every 2-D linear weight becomes `QuantizedLinear(GgufWeight(view of the memory-mapped file))` in
place of the model's Linear, whatever its ggml type (F32 / F16 / BF16 too); the token embedding
becomes a `GgufEmbedding`, and a tied lm_head (no `output.weight`) a QuantizedLinear over the
embedding's GgufWeight. MoE experts stacked as `ffn_*_exps` [E, N, row_bytes] become one
zero-copy view per expert. Nothing holds an fp32 copy of a quantized weight, except these small
tensors, dequantized to fp32:

- 1-D tensors (norms, biases); the MoE router weight and its correction bias (`exp_probs_b`); the
  DSA indexer's `weights_proj`, which the model runs in fp32 as the reference does;
- GLM-DSA's `kv_b_proj`, which llama.cpp's converter splits into per-head `attn_k_b` (stored
  transposed, [H, kv_lora_rank, nope]) and `attn_v_b` [H, v_dim, kv_lora_rank]: reassembled as
  HF's [H * (nope + v), kv_lora_rank] (it is kv_lora_rank wide: ~1% of an MLA layer);
- llama's q/k rows, which llama.cpp's converter permutes for its interleaved RoPE: their rows are
  put back in HF order, a copy of the quantized bytes (not fp32).

The NextN (MTP) layer past num_hidden_layers goes to `net.mtp_weights` under HF names, read as
the decoder layers are (a GgufWeight per linear weight and expert, fp32 small tensors).
"""

import re
from math import prod
from pathlib import Path

import torch
from torch import nn

from zcode.errors import CheckpointError
from zcode.layers.linear import Linear
from zcode.loader import pages
from zcode.loader.gguf_config import MODEL_TYPES
from zcode.loader.gguf_file import GgufContents, GgufTensor
from zcode.loader.interleaved import interleaved_file
from zcode.quant.gguf import (
    INTERLEAVE_ROWS,
    GgufEmbedding,
    GgufWeight,
    dequantize_rows,
    format_name,
)
from zcode.quant.linear import QuantizedLinear

# Model modules kept as fp32 nn.Linear (dequantized): small, and run in fp32 by the reference.
_FP32_LINEARS = ("indexer.weights_proj",)
_FP32_PARAMS = ("indexer.weights_proj.weight", "e_score_correction_bias")
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)$")
_LAYER = re.compile(r"^blk\.(\d+)\.")


def load_gguf_weights(path: Path, net: nn.Module, contents: GgufContents) -> None:
    """Fills `net` (built on meta) from the file; raises CheckpointError for a missing tensor."""
    _GgufFiller(path, net, contents).fill()


class _GgufFiller:
    def __init__(self, path: Path, net: nn.Module, contents: GgufContents) -> None:
        from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

        self.path, self.net = path, net
        self.config = net.config
        self.model_type = self.config.model_type
        arch_name = next(a for a, t in MODEL_TYPES.items() if t == self.model_type)
        arch = next(a for a, name in MODEL_ARCH_NAMES.items() if name == arch_name)
        num_nextn = getattr(self.config, "num_nextn_predict_layers", 0) or 0
        self.name_map = get_tensor_name_map(arch, self.config.num_hidden_layers + num_nextn)
        self.tensors = {t.name: t for t in contents.tensors}
        # uint8 [file bytes]: a view of the memory map (copy-on-write, so torch may wrap it)
        self.file = torch.from_numpy(contents.data)
        # The cache file holding the tensors that run interleaved here at the same offsets.
        self.interleaved, self.interleaved_names = interleaved_file(path, contents)

    def fill(self) -> None:
        net = self.net
        for name, module in list(net.named_modules()):
            if isinstance(module, nn.Linear) and name != "lm_head":
                self._replace(name, self._linear(name, module))
        embed = GgufEmbedding(self._packed("token_embd.weight"))
        net.model.embed_tokens = embed
        # tied (no output.weight): the lm_head reads the embedding's bytes
        head = self._packed("output.weight") if "output.weight" in self.tensors else embed.packed
        net.lm_head = QuantizedLinear(head, None, format_name(head.ggml_type))
        persistent = set(net.state_dict(keep_vars=True))
        for name, tensor in list(net.named_parameters()) + list(net.named_buffers()):
            if tensor.is_meta and name in persistent:
                self._set_tensor(name, self._small(name))
        self._fill_mtp()
        for module in net.modules():
            if any(b.is_meta for b in module.buffers(recurse=False)) and hasattr(
                module, "reset_buffers"
            ):
                module.to_empty(device="cpu")
                module.reset_buffers()

    # -- names

    def _gguf_name(self, hf_name: str) -> str:
        if hf_name.endswith("e_score_correction_bias"):
            layer = re.search(r"layers\.(\d+)\.", hf_name).group(1)
            return f"blk.{layer}.exp_probs_b.bias"
        name = self.name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise CheckpointError(f"{self.path}: no GGUF name for the model's {hf_name!r}")
        return name

    def _tensor(self, gguf_name: str, hf_name: str) -> GgufTensor:
        tensor = self.tensors.get(gguf_name)
        if tensor is None:
            raise CheckpointError(
                f"{self.path}: no tensor {gguf_name!r} for the model's {hf_name!r}"
            )
        return tensor

    # -- tensors

    def _bytes(self, tensor: GgufTensor, file: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 [*shape[:-1], row_bytes]: a view of the file (or of the interleaved cache)."""
        rows = prod(tensor.shape[:-1])
        data = (self.file if file is None else file)[tensor.start : tensor.start + tensor.nbytes]
        return data.view(*tensor.shape[:-1], tensor.nbytes // rows)

    def _packed(
        self, gguf_name: str, hf_name: str = "", expert: int | None = None, interleaved: bool = True
    ) -> GgufWeight:
        """The tensor's GgufWeight (of one expert of a stacked tensor): interleaved, from the
        cache, where it runs so here and the caller does not need the file's row order."""
        tensor = self._tensor(gguf_name, hf_name or gguf_name)
        interleaved = interleaved and tensor.name in self.interleaved_names
        data = self._bytes(tensor, self.interleaved if interleaved else None)
        if expert is not None:
            data = data[expert]
        elif data.dim() != 2:
            raise CheckpointError(f"{self.path}: tensor {gguf_name!r} is not 2-D: {tensor.shape}")
        return GgufWeight(data, tensor.ggml_type, tensor.shape[-1], interleaved)

    def _part(self, gguf_name: str, hf_name: str, index: int, num_parts: int) -> GgufWeight:
        """Part `index` of `num_parts` equal row ranges of a fused tensor (GLM-4's ffn_up: gate
        rows, then up rows), a view; in the file's row order where the interleaved layout's
        16-row groups would straddle the cut."""
        rows = self._tensor(gguf_name, hf_name).shape[0]
        if rows % num_parts:
            raise CheckpointError(
                f"{self.path}: tensor {gguf_name!r} has {rows} rows, not {num_parts} equal parts"
            )
        size = rows // num_parts
        packed = self._packed(gguf_name, hf_name, interleaved=size % INTERLEAVE_ROWS == 0)
        return packed.rows(index * size, (index + 1) * size)

    def _float(self, gguf_name: str, hf_name: str) -> torch.Tensor:
        """fp32 [torch shape], owning its memory."""
        tensor = self._tensor(gguf_name, hf_name)
        data = self._bytes(tensor)
        rows = dequantize_rows(data.reshape(-1, data.shape[-1]), tensor.ggml_type)
        if rows.data_ptr() == data.data_ptr():  # F32 dequantizes to a view of the file
            rows = rows.clone()
        return rows.view(tensor.shape)

    def _check(self, name: str, value: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if tuple(value.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.path}: tensor for {name!r} has shape {tuple(value.shape)}, "
                f"the model expects {tuple(shape)}"
            )
        if not torch.isfinite(value).all():
            raise CheckpointError(f"{self.path}: tensor for {name!r} contains NaN or Inf")
        return value

    # -- modules

    def _linear(self, name: str, module: nn.Linear) -> nn.Module:
        if name.endswith("kv_b_proj"):
            return self._fp32_linear(module, self._kv_b(name))
        if name.endswith(_FP32_LINEARS):
            return self._fp32_linear(module, self._float(self._gguf_name(f"{name}.weight"), name))
        if (m := _EXPERT.match(name)) is not None:
            prefix, expert, proj = m.groups()
            gguf_name = self._gguf_name(f"{prefix}.{proj}.weight")
            packed = self._packed(gguf_name, name, int(expert))
        elif (fused := self.net.fused_source(name)) is not None:
            stored, index, num_parts = fused
            gguf_name = self._gguf_name(f"{stored}.weight")
            packed = self._part(gguf_name, name, index, num_parts)
        else:
            gguf_name = self._gguf_name(f"{name}.weight")
            permuted = self.model_type == "llama" and name.endswith(("q_proj", "k_proj"))
            packed = self._packed(gguf_name, name, interleaved=not permuted)
            if permuted:
                heads = self.config.num_attention_heads
                if name.endswith("k_proj"):
                    heads = self.config.num_key_value_heads
                data = _unpermute(packed.data, heads)
                pages.drop(packed.data)  # the file's order is read once, into the copy
                packed = GgufWeight(data, packed.ggml_type, packed.in_features)
                if gguf_name in self.interleaved_names:
                    packed = packed.interleaved_copy()
        if (packed.out_features, packed.in_features) != tuple(module.weight.shape):
            raise CheckpointError(
                f"{self.path}: tensor {gguf_name!r} is [{packed.out_features}, "
                f"{packed.in_features}], the model's {name!r} expects "
                f"{list(module.weight.shape)}"
            )
        bias = None
        if module.bias is not None:
            bias_name = gguf_name.removesuffix(".weight") + ".bias"
            value = self._float(bias_name, f"{name}.bias")
            bias = nn.Parameter(self._check(f"{name}.bias", value, module.bias.shape), False)
        return QuantizedLinear(packed, bias, format_name(packed.ggml_type))

    def _fp32_linear(self, module: nn.Linear, weight: torch.Tensor) -> nn.Linear:
        linear = Linear(module.in_features, module.out_features, bias=False, device="meta")
        linear.weight = nn.Parameter(self._check("linear", weight, module.weight.shape), False)
        return linear

    def _kv_b(self, name: str) -> torch.Tensor:
        stem = self._gguf_name(f"{name.removesuffix('kv_b_proj')}o_proj.weight")
        stem = stem.removesuffix("attn_output.weight")
        k_b = self._float(f"{stem}attn_k_b.weight", name)  # [H, kv_lora_rank, nope]
        v_b = self._float(f"{stem}attn_v_b.weight", name)  # [H, v_dim, kv_lora_rank]
        kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [H, nope + v_dim, kv_lora_rank]
        return kv_b.reshape(-1, kv_b.shape[-1])

    def _small(self, name: str) -> torch.Tensor:
        value = self._float(self._gguf_name(name), name)
        if self.model_type == "gemma3_text" and name.endswith("norm.weight"):
            value = (
                value - 1
            )  # llama.cpp's gemma converter stores 1 + w; the model computes (1 + w)
        return value

    def _set_tensor(self, name: str, value: torch.Tensor) -> None:
        module_name, _, attr = name.rpartition(".")
        module = self.net.get_submodule(module_name)
        value = self._check(name, value, getattr(module, attr).shape)
        if attr in module._parameters:
            module._parameters[attr] = nn.Parameter(value, requires_grad=False)
        else:
            module._buffers[attr] = value

    def _replace(self, name: str, new: nn.Module) -> None:
        parent, _, child = name.rpartition(".")
        setattr(self.net.get_submodule(parent), child, new)

    def _fill_mtp(self) -> None:
        """The NextN (MTP) layer, blk.N.* with N = num_hidden_layers, into `net.mtp_weights`
        under HF names, read as the model's own layers are: a GgufWeight view per linear weight
        (per expert for stacked experts), fp32 for small tensors and DSA's kv_b. The drafter
        builds the layer from them (zcode.models.mtp.build_mtp_layer)."""
        num_layers = self.config.num_hidden_layers
        if not hasattr(self.net, "mtp_block") or not any(
            (m := _LAYER.match(name)) and int(m.group(1)) >= num_layers for name in self.tensors
        ):
            return
        from zcode.models.mtp import MtpLayer

        with torch.device("meta"):
            layer = MtpLayer(self.config, self.net.mtp_block(), nn.Identity(), nn.Identity())
        prefix, weights = f"model.layers.{num_layers}.", self.net.mtp_weights
        for name, module in layer.named_modules():
            if isinstance(module, nn.Linear):
                hf_name = prefix + name.removeprefix("mtp_block.")
                new = self._linear(hf_name, module)
                packed = isinstance(new, QuantizedLinear)
                weights[f"{hf_name}.weight"] = new.packed if packed else new.weight.data
                if new.bias is not None:
                    weights[f"{hf_name}.bias"] = new.bias.data
        for name in layer.state_dict():
            hf_name = prefix + name.removeprefix("mtp_block.")
            if hf_name not in weights:
                weights[hf_name] = self._small(hf_name)
        for own in ("embed_tokens", "shared_head.head"):  # else the model's own are shared
            gguf_name = self.name_map.get_name(prefix + own)
            if f"{gguf_name}.weight" in self.tensors:
                weights[f"{prefix}{own}.weight"] = self._packed(f"{gguf_name}.weight")


def _unpermute(data: torch.Tensor, num_heads: int) -> torch.Tensor:
    # rows [H * D, ...] stored as per-head (D/2, 2) pairs -> HF's (2, D/2) halves
    rows = data.shape[0] // num_heads // 2
    return data.reshape(num_heads, rows, 2, -1).transpose(1, 2).reshape(data.shape).contiguous()


def dequantize_model(net: nn.Module, dtype: torch.dtype) -> None:
    """A natively loaded model -> plain Linear / Embedding modules and every tensor in `dtype`,
    as the HF loader leaves a model (the indexer's weights_proj stays fp32, as there)."""
    for name, module in list(net.named_modules()):
        if isinstance(module, QuantizedLinear) and isinstance(module.packed, GgufWeight):
            linear = Linear(module.in_features, module.out_features, bias=False, device="meta")
            linear.weight = nn.Parameter(module.packed.dequantize(dtype), requires_grad=False)
            if module.bias is not None:
                linear.bias = nn.Parameter(module.bias.to(dtype), requires_grad=False)
            _set_module(net, name, linear)
        elif isinstance(module, GgufEmbedding):
            embed = nn.Embedding(module.num_embeddings, module.embedding_dim, device="meta")
            embed.weight = nn.Parameter(module.packed.dequantize(dtype), requires_grad=False)
            _set_module(net, name, embed)
    if getattr(net.config, "tie_word_embeddings", False):
        net.lm_head.weight = net.model.embed_tokens.weight
    for name, param in net.named_parameters():
        if not name.endswith(_FP32_PARAMS) and param.dtype != dtype:
            param.data = param.data.to(dtype)
    for key, value in net.mtp_weights.items():
        if isinstance(value, GgufWeight):
            net.mtp_weights[key] = value.dequantize(dtype)
        else:
            net.mtp_weights[key] = value.to(dtype)


def _set_module(net: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(net.get_submodule(parent) if parent else net, child, module)
