"""GLM-4.5 / 4.6 / 4.7: GQA with half-split partial RoPE and optional QK-norm; dense MLP in the
first `first_k_dense_replace` layers, DeepSeek-V3-style MoE after."""

import torch
from torch import nn

from zcode.forward_batch import ForwardBatch
from zcode.layers.attention import Attention
from zcode.layers.mlp import GatedMLP
from zcode.layers.moe import MoE
from zcode.layers.norm import RMSNorm
from zcode.layers.rotary import RotaryEmbedding
from zcode.models.base import Backbone, CausalLM
from zcode.models.glm4 import rotary_dim_of
from zcode.models.llama import head_dim_of


class Glm4MoeDecoderLayer(nn.Module):
    def __init__(self, c, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            head_dim_of(c),
            qkv_bias=c.attention_bias,
            qk_norm_eps=c.rms_norm_eps if c.use_qk_norm else None,
        )
        if layer_idx >= c.first_k_dense_replace:
            self.mlp = MoE(c)
        else:
            self.mlp = GatedMLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class Glm4MoeForCausalLM(CausalLM):
    def __init__(self, hf_config) -> None:
        super().__init__(hf_config)
        c = hf_config
        layers = [Glm4MoeDecoderLayer(c, i) for i in range(c.num_hidden_layers)]
        self.model = Backbone(c, layers, RotaryEmbedding(c, rotary_dim_of(c)))
        self._init_head()
