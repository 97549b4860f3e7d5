"""Llama (SmolLM2 and friends): pre-norm decoder with GQA, full NeoX RoPE and a SwiGLU MLP."""

import torch
from torch import nn

from zcode.forward_batch import ForwardBatch
from zcode.layers.attention import Attention
from zcode.layers.mlp import GatedMLP
from zcode.layers.norm import RMSNorm
from zcode.layers.rotary import RotaryEmbedding
from zcode.models.base import Backbone, CausalLM


def head_dim_of(c) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        self.self_attn = Attention(
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            head_dim_of(c),
            qkv_bias=getattr(c, "attention_bias", False),
        )
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, bias=getattr(c, "mlp_bias", False))
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(CausalLM):
    def __init__(self, hf_config) -> None:
        super().__init__(hf_config)
        c = hf_config
        layers = [LlamaDecoderLayer(c) for _ in range(c.num_hidden_layers)]
        self.model = Backbone(c, layers, RotaryEmbedding(c, head_dim_of(c)))
        self._init_head()
