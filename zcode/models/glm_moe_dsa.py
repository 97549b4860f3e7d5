"""GLM-5 / 5.1 / 5.2: MLA attention with the DSA lightning indexer and DeepSeek-V3-style MoE.

Layers marked "shared" in `indexer_types` (GLM-5.2 IndexShare) reuse the top-k selection of the
last full indexer layer.
"""

import torch
from torch import nn

from zcode.forward_batch import ForwardBatch
from zcode.layers.mla import MLAttention
from zcode.layers.mlp import GatedMLP
from zcode.layers.moe import MoE
from zcode.layers.norm import RMSNorm
from zcode.layers.rotary import RotaryEmbedding
from zcode.models.base import Backbone, CausalLM


class GlmMoeDsaDecoderLayer(nn.Module):
    def __init__(self, c, use_indexer: bool, use_moe: bool) -> None:
        super().__init__()
        self.self_attn = MLAttention(c, use_indexer=use_indexer)
        self.mlp = MoE(c) if use_moe else GatedMLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, rope, prev_keep: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn_out, keep = self.self_attn(self.input_layernorm(x), batch, rope, prev_keep)
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x)), keep


class GlmMoeDsaMtpBlock(GlmMoeDsaDecoderLayer):
    """The MTP layer's decoder layer: MLA with its own DSA indexer and a MoE, alone (no earlier
    layer's top-k to share)."""

    def __init__(self, c) -> None:
        super().__init__(c, use_indexer=True, use_moe=True)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope) -> torch.Tensor:
        return super().forward(x, batch, rope, None)[0]


class GlmMoeDsaBackbone(Backbone):
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb(batch.positions)
        keep = None
        for layer in self.layers:
            hidden, keep = layer(hidden, batch, rope, keep)
        return self.norm(hidden)


class GlmMoeDsaForCausalLM(CausalLM):
    def __init__(self, hf_config) -> None:
        super().__init__(hf_config)
        c = hf_config
        layers = [
            GlmMoeDsaDecoderLayer(
                c,
                use_indexer=c.indexer_types[i] == "full",
                use_moe=c.mlp_layer_types[i] == "sparse",
            )
            for i in range(c.num_hidden_layers)
        ]
        self.model = GlmMoeDsaBackbone(c, layers, RotaryEmbedding(c, c.qk_rope_head_dim))
        self._init_head()

    def mtp_block(self) -> GlmMoeDsaMtpBlock:
        """The decoder layer of the MTP layer (checkpoint layer num_hidden_layers)."""
        return GlmMoeDsaMtpBlock(self.config)
