"""GLM-4-0414 dense: GQA with qkv bias, interleaved partial RoPE, sandwich norms; the checkpoint's
fused gate_up_proj runs as a GatedMLP's gate_proj and up_proj (its row halves)."""

from zcode.layers import decode_blocks
from zcode.layers.attention import Attention, head_dim_of
from zcode.layers.mlp import GatedMLP
from zcode.layers.norm import RMSNorm
from zcode.layers.rotary import RotaryEmbedding
from zcode.models.base import Backbone, CausalLM


def rotary_dim_of(c) -> int:
    factor = (getattr(c, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    return int(head_dim_of(c) * factor)


class Glm4DecoderLayer(decode_blocks.PreNormLayer):
    HALVES = (
        ("self_attn", "input_layernorm", "post_self_attn_layernorm"),
        ("mlp", "post_attention_layernorm", "post_mlp_layernorm"),
    )

    def __init__(self, c) -> None:
        super().__init__()
        self.self_attn = Attention.from_config(c, interleaved_rope=True)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_self_attn_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Glm4ForCausalLM(CausalLM):
    fused_modules = {"mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}

    def __init__(self, hf_config) -> None:
        super().__init__(hf_config)
        c = hf_config
        layers = [Glm4DecoderLayer(c) for _ in range(c.num_hidden_layers)]
        self.model = Backbone(c, layers, RotaryEmbedding(c, rotary_dim_of(c)))
        self._init_head()
