"""GLM's MTP (multi-token prediction, "NextN") layer: the extra layer GLM-4.5+ and GLM-5 ship
after their decoder layers (checkpoint layer `num_hidden_layers`), run as a drafter (DeepSeek-V3's
MTP module; vLLM's glm4_moe_mtp / deepseek_mtp, llama.cpp's NextN, transformers' MtpLayer):

    x  = eh_proj(cat(enorm(embed(t_j)), hnorm(h_{j-1})))   h: the target's final-normed hidden
    x  = mtp_block(x)              one decoder layer of the model's kind, with its own KV cache
    h' = shared_head.norm(x)       logits = shared_head.head(h'), the model's lm_head by default

The output at position j predicts token j + 1. A chained draft feeds h' as the next step's h (the
normed hidden, as GLM's NextN and transformers' MtpLayer carry it).
"""

import torch
from torch import nn

from zcode.errors import CheckpointError, ValidationError
from zcode.forward_batch import ForwardBatch
from zcode.layers.linear import Linear
from zcode.layers.norm import RMSNorm
from zcode.quant.gguf import GgufEmbedding, GgufWeight, format_name
from zcode.quant.linear import QuantizedLinear


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, eps: float, head: nn.Module) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.head = head


class MtpLayer(nn.Module):
    def __init__(
        self, hf_config, mtp_block: nn.Module, embed_tokens: nn.Module, head: nn.Module
    ) -> None:
        """embed_tokens, head: the model's own modules unless the checkpoint has the layer's."""
        super().__init__()
        c = hf_config
        self.embed_tokens = embed_tokens
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.eh_proj = Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.mtp_block = mtp_block
        self.shared_head = SharedHead(c.hidden_size, c.rms_norm_eps, head)

    def forward(
        self,
        input_ids: torch.Tensor,
        prev_hidden: torch.Tensor,
        batch: ForwardBatch,
        rope: tuple[torch.Tensor, ...],
    ) -> torch.Tensor:
        """input_ids: [T] tokens j, prev_hidden: [T, D] the hidden state at j - 1 -> h' [T, D]."""
        embeds = self.embed_tokens(input_ids)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(prev_hidden)], dim=-1))
        return self.shared_head.norm(self.mtp_block(x, batch, rope))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, D] from forward -> [N, V] fp32."""
        return self.shared_head.head(hidden).float()


def build_mtp_layer(model: nn.Module) -> MtpLayer:
    """The model's first MTP layer from the weights the loader kept (`model.mtp_weights`, HF
    names); ValidationError for a model or checkpoint without one."""
    c = model.config
    if not hasattr(model, "mtp_block"):
        raise ValidationError(
            f"speculative='mtp' needs a model with MTP layers (glm4_moe, glm_moe_dsa); "
            f"{c.model_type} has none"
        )
    if not model.mtp_weights:
        raise ValidationError(
            "speculative='mtp': this checkpoint has no MTP layer weights (model.layers."
            f"{c.num_hidden_layers}.*, num_nextn_predict_layers "
            f"{getattr(c, 'num_nextn_predict_layers', 0)}); use 'ngram' or 'skip_layers'"
        )
    prefix = f"model.layers.{c.num_hidden_layers}."
    others = sorted(name for name in model.mtp_weights if not name.startswith(prefix))
    if others:
        raise NotImplementedError(
            f"speculative='mtp' with more than one MTP layer ({others[0]} ...): only the first "
            "is run so far"
        )
    weights = {name.removeprefix(prefix): t for name, t in model.mtp_weights.items()}
    with torch.device("meta"):
        layer = MtpLayer(c, model.mtp_block(), nn.Identity(), nn.Identity())
    layer.embed_tokens = _own_embedding(weights) or model.model.embed_tokens
    layer.shared_head.head = _own_head(weights) or model.lm_head
    _load(layer, weights)
    return layer.eval()


def _own_embedding(weights: dict) -> nn.Module | None:
    weight = weights.pop("embed_tokens.weight", None)
    if weight is None:
        return None
    if isinstance(weight, GgufWeight):
        return GgufEmbedding(weight)
    return nn.Embedding.from_pretrained(weight, freeze=True)


def _own_head(weights: dict) -> nn.Module | None:
    weight = weights.pop("shared_head.head.weight", None)
    if weight is None:
        return None
    if isinstance(weight, GgufWeight):
        return QuantizedLinear(weight, None, format_name(weight.ggml_type))
    head = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    head.weight = nn.Parameter(weight, requires_grad=False)
    return head


def _load(layer: MtpLayer, weights: dict) -> None:
    """Every parameter and persistent buffer of `layer` (built on meta) but the shared embedding
    and head from `weights` (checkpoint names relative to the MTP layer): tensors in the
    loader's dtypes, or a GGUF file's GgufWeight, whose Linear becomes a QuantizedLinear."""
    targets = {
        name: tensor
        for name, tensor in layer.state_dict(keep_vars=True).items()
        if not name.startswith(("embed_tokens.", "shared_head.head."))
    }
    by_checkpoint_name = {name.removeprefix("mtp_block."): name for name in targets}
    missing = sorted(set(by_checkpoint_name) - set(weights))
    unknown = sorted(set(weights) - set(by_checkpoint_name))
    if missing or unknown:
        raise CheckpointError(
            f"MTP layer weights do not match the model's MTP layer: missing {missing[:5]}, "
            f"unexpected {unknown[:5]}"
        )
    for checkpoint_name, name in by_checkpoint_name.items():
        target, value = targets[name], weights[checkpoint_name]
        if isinstance(value, GgufWeight):
            module_name = name.removesuffix(".weight")
            value_shape = (value.out_features, value.in_features)
            if value_shape != tuple(target.shape):
                raise CheckpointError(
                    f"MTP tensor {checkpoint_name!r} is {list(value_shape)}, the layer expects "
                    f"{list(target.shape)}"
                )
            # its bias, if any, follows as a tensor into the new module's parameters
            quantized = QuantizedLinear(value, None, format_name(value.ggml_type))
            _set_module(layer, module_name, quantized)
            continue
        if tuple(value.shape) != tuple(target.shape):
            raise CheckpointError(
                f"MTP tensor {checkpoint_name!r} has shape {tuple(value.shape)}, the layer "
                f"expects {tuple(target.shape)}"
            )
        module_name, _, attr = name.rpartition(".")
        module = layer.get_submodule(module_name)
        if attr in module._parameters:
            module._parameters[attr] = nn.Parameter(value.contiguous(), requires_grad=False)
        else:
            module._buffers[attr] = value.contiguous()
    for module in layer.modules():  # non-persistent buffers (none are in a checkpoint)
        if any(b.is_meta for b in module.buffers(recurse=False)) and hasattr(
            module, "reset_buffers"
        ):
            module.to_empty(device="cpu")
            module.reset_buffers()


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)
