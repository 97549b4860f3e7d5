"""GLM-4.5 / 4.6 / 4.7: GQA with half-split partial RoPE and optional QK-norm; dense MLP in the
first `first_k_dense_replace` layers, DeepSeek-V3-style MoE after."""

from zcode.layers.attention import Attention
from zcode.layers.mlp import GatedMLP
from zcode.layers.moe import MoE
from zcode.layers.rotary import RotaryEmbedding
from zcode.models.base import Backbone, CausalLM, DecoderLayer
from zcode.models.glm4 import rotary_dim_of


def glm4_moe_layer(c, layer_idx: int) -> DecoderLayer:
    return DecoderLayer(
        Attention.from_config(c, qk_norm=c.use_qk_norm),
        MoE(c)
        if layer_idx >= c.first_k_dense_replace
        else GatedMLP(c.hidden_size, c.intermediate_size),
        c.hidden_size,
        c.rms_norm_eps,
    )


class Glm4MoeForCausalLM(CausalLM):
    def __init__(self, hf_config) -> None:
        super().__init__(hf_config)
        c = hf_config
        layers = [glm4_moe_layer(c, i) for i in range(c.num_hidden_layers)]
        self.model = Backbone(c, layers, RotaryEmbedding(c, rotary_dim_of(c)))
        self._init_head()

    def mtp_block(self) -> DecoderLayer:
        """The decoder layer of the MTP layer (checkpoint layer num_hidden_layers): a MoE layer."""
        return glm4_moe_layer(self.config, self.config.num_hidden_layers)
