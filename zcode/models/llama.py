"""Llama (SmolLM2 and friends): pre-norm decoder with GQA, full NeoX RoPE and a SwiGLU MLP."""

from zcode.layers.attention import Attention, head_dim_of
from zcode.layers.mlp import GatedMLP
from zcode.layers.rotary import RotaryEmbedding
from zcode.models.base import Backbone, CausalLM, DecoderLayer


class LlamaForCausalLM(CausalLM):
    def __init__(self, hf_config) -> None:
        super().__init__(hf_config)
        c = hf_config
        mlp_bias = getattr(c, "mlp_bias", False)
        layers = [
            DecoderLayer(
                Attention.from_config(c),
                GatedMLP(c.hidden_size, c.intermediate_size, bias=mlp_bias),
                c.hidden_size,
                c.rms_norm_eps,
            )
            for _ in range(c.num_hidden_layers)
        ]
        self.model = Backbone(c, layers, RotaryEmbedding(c, head_dim_of(c)))
        self._init_head()
