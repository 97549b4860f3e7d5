"""The shape every decoder-only model shares: embed -> layers -> norm -> lm_head.

An architecture file supplies its decoder layer and the rotary table; names follow HF so that
checkpoints load without a map.
"""

import torch
from torch import nn

from zcode.forward_batch import ForwardBatch
from zcode.layers import decode_blocks
from zcode.layers.linear import Linear
from zcode.layers.norm import RMSNorm


class DecoderLayer(decode_blocks.PreNormLayer):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)


class Backbone(nn.Module):
    """`rotary` returns what every layer's forward takes as `rope`; `norm` defaults to RMSNorm;
    `embed_scale` multiplies the embeddings (Gemma: sqrt(hidden_size)), rounded to their dtype
    first as HF does (in bf16, sqrt(640) is 25.25)."""

    def __init__(
        self,
        hf_config,
        layers: list[nn.Module],
        rotary: nn.Module,
        norm: nn.Module | None = None,
        embed_scale: float | None = None,
    ) -> None:
        super().__init__()
        c = hf_config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps) if norm is None else norm
        self.rotary_emb = rotary
        self.embed_scale = embed_scale

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # input_ids: [T] -> hidden: [T, D]
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        rope = self.rotary_emb(batch.positions)
        # An eager decode step of a GGUF model: every layer in one C++ call.
        if (out := decode_blocks.stack_residual(self.layers, hidden, batch, rope)) is not None:
            return self.norm(out)
        for i, layer in enumerate(self.layers):
            if batch.paging is None:
                hidden = layer(hidden, batch, rope)
            else:
                hidden = batch.paging.run(i, layer, hidden, batch, rope)
        if batch.paging is not None:
            batch.paging.write_pending()
        return self.norm(hidden)


class CausalLM(nn.Module):
    """Base class: subclasses build `self.model` (a Backbone) in __init__ before calling
    `_init_head`."""

    # Modules the checkpoint stores as one fused weight that this model runs as separate
    # modules: stored name (a suffix of module names) -> the modules taking its rows, in order,
    # in equal parts. GLM-4 fuses gate and up ([2 * I, D]); as GatedMLP's two linears its FFN
    # gets sparsity levels, and decode still runs them as one GEMV (linear_group).
    fused_modules: dict[str, tuple[str, ...]] = {}

    def __init__(self, hf_config) -> None:
        super().__init__()
        self.config = hf_config
        # GLM-4.5+ and GLM-5 ship their MTP (next-token prediction) layers as extra layers after
        # num_hidden_layers; the loader keeps them here, by checkpoint name, for speculative
        # decoding.
        self.mtp_weights: dict[str, torch.Tensor] = {}

    def fused_source(self, module_name: str) -> tuple[str, int, int] | None:
        """(stored module name, part index, number of parts) if `module_name`'s weight is rows
        of a fused checkpoint weight, else None."""
        for stored, parts in self.fused_modules.items():
            for index, part in enumerate(parts):
                if _names(module_name, part):
                    return module_name.removesuffix(part) + stored, index, len(parts)
        return None

    def fused_parts(self, stored_name: str) -> tuple[str, tuple[str, ...]] | None:
        """(prefix, the modules taking its rows) if the checkpoint's `stored_name` is a fused
        weight this model runs as separate modules (each named prefix + part), else None."""
        for stored, parts in self.fused_modules.items():
            if _names(stored_name, stored):
                return stored_name.removesuffix(stored), parts
        return None

    def _init_head(self) -> None:
        c = self.config
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)
        if getattr(c, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids: [T] -> logits [N, vocab] for the tokens in batch.logits_index (fp32)."""
        hidden = self.model(input_ids, batch)
        return self.lm_head(hidden[batch.logits_index]).float()

    def attention_layers(self) -> list[nn.Module]:
        """The modules that own KV cache, in layer order (each has cache_spec() and .cache)."""
        return [layer.self_attn for layer in self.model.layers]


def _names(module_name: str, suffix: str) -> bool:
    """Whether `module_name` is `suffix` or ends in it at a dot ("mlp.up_proj", not
    "shared_mlp.up_proj")."""
    return module_name == suffix or module_name.endswith(f".{suffix}")
