"""Gemma 3 text (Gemma3ForCausalLM): GQA with per-head QK-norm, sandwich norms around attention
and a GeGLU MLP, Gemma's (1 + weight) RMSNorms, embeddings scaled by sqrt(hidden_size), and
sliding-window layers (local RoPE) interleaved with full-attention layers (global RoPE) as the
config's `layer_types` lists them.
"""

import torch

from zcode.forward_batch import ForwardBatch
from zcode.layers import decode_blocks
from zcode.layers.attention import Attention, head_dim_of
from zcode.layers.mlp import GeluGatedMLP
from zcode.layers.norm import RMSNorm
from zcode.layers.rotary import RotaryByLayerType
from zcode.models.base import Backbone, CausalLM

LAYER_TYPES = ("sliding_attention", "full_attention")


class Gemma3DecoderLayer(decode_blocks.PreNormLayer):
    HALVES = (
        ("self_attn", "input_layernorm", "post_attention_layernorm"),
        ("mlp", "pre_feedforward_layernorm", "post_feedforward_layernorm"),
    )

    def __init__(self, c, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = Attention(
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            head_dim_of(c),
            qkv_bias=c.attention_bias,
            qk_norm_eps=c.rms_norm_eps,
            qk_norm_unit_offset=True,
            scale=c.query_pre_attn_scalar**-0.5,
            sliding_window=c.sliding_window if layer_type == "sliding_attention" else None,
        )
        self.mlp = GeluGatedMLP(c.hidden_size, c.intermediate_size)
        norm_names = (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        )
        for name in norm_names:
            setattr(self, name, RMSNorm(c.hidden_size, c.rms_norm_eps, unit_offset=True))

    def layer_rope(self, rope: dict[str, tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        return rope[self.layer_type]


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, hf_config) -> None:
        super().__init__(hf_config)
        c = hf_config
        _check_supported(c)
        layers = [Gemma3DecoderLayer(c, t) for t in c.layer_types[: c.num_hidden_layers]]
        self.model = Backbone(
            c,
            layers,
            RotaryByLayerType(c, head_dim_of(c)),
            norm=RMSNorm(c.hidden_size, c.rms_norm_eps, unit_offset=True),
            embed_scale=c.hidden_size**0.5,
        )
        self._init_head()

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        logits = super().forward(input_ids, batch)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def _check_supported(c) -> None:
    if c.hidden_activation != "gelu_pytorch_tanh":
        raise ValueError(
            f"Gemma 3 hidden_activation {c.hidden_activation!r}: only gelu_pytorch_tanh"
        )
    unknown = set(c.layer_types) - set(LAYER_TYPES)
    if unknown:
        raise ValueError(f"Gemma 3 layer_types {sorted(unknown)}: expected {LAYER_TYPES}")
    if c.attn_logit_softcapping is not None:
        raise NotImplementedError(
            "Gemma 3 attn_logit_softcapping: tanh-capped scores need an attention path of their "
            "own (SDPA cannot cap); Gemma 3 checkpoints leave it None"
        )
    if getattr(c, "use_bidirectional_attention", False):
        raise NotImplementedError("Gemma 3 use_bidirectional_attention (EmbeddingGemma)")
