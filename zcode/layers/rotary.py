"""Rotary position embeddings: NeoX half-split and interleaved pairs, full or partial."""

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def rope_inv_freq(
    hf_config, rotary_dim: int, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim / 2] and attention scaling for the config's rope type.

    Non-default rope types (llama3, yarn, ...) are delegated to transformers' own init functions so
    that scaled RoPE matches the reference exactly. `layer_type` picks one entry of a config whose
    rope_parameters are keyed by layer type (Gemma 3: sliding_attention / full_attention).
    """
    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        kwargs = {} if layer_type is None else {"layer_type": layer_type}
        with torch.device("cpu"):  # not the meta device a model is built under
            return ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", **kwargs)
    base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (base**exponent), 1.0


class RotaryEmbedding(nn.Module):
    """Turns positions into the cos/sin tables that `apply_rotary` consumes."""

    def __init__(self, hf_config, rotary_dim: int, layer_type: str | None = None) -> None:
        super().__init__()
        self.hf_config, self.rotary_dim, self.layer_type = hf_config, rotary_dim, layer_type
        self.register_buffer("inv_freq", torch.empty(rotary_dim // 2), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the table; the loader calls this after materialising a meta-device model."""
        inv_freq, self.scaling = rope_inv_freq(self.hf_config, self.rotary_dim, self.layer_type)
        self.inv_freq = inv_freq.float().to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, rotary_dim / 2], fp32
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos() * self.scaling, freqs.sin() * self.scaling


class RotaryByLayerType(nn.Module):
    """One table per layer type (Gemma 3: local RoPE on sliding layers, global on full ones);
    returns {layer type: (cos, sin)} and each layer takes its own."""

    def __init__(self, hf_config, rotary_dim: int) -> None:
        super().__init__()
        self.tables = nn.ModuleDict(
            {
                t: RotaryEmbedding(hf_config, rotary_dim, t)
                for t in sorted(set(hf_config.layer_types))
            }
        )

    def forward(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {layer_type: table(positions) for layer_type, table in self.tables.items()}


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """RoPE on the first 2 * cos.shape[-1] features of each head; the rest pass through.

    `interleaved=False` rotates halves (x[:d/2], x[d/2:]) as GPT-NeoX/Llama do. `interleaved=True`
    rotates adjacent pairs (x0, x1), (x2, x3) ... and writes them de-interleaved as
    [rotated evens | rotated odds]; q and k share that layout, so their dot products equal the
    in-place interleaved rotation of GLM-4 and DeepSeek/GLM-5.
    """
    # x: [T, H, D]; cos, sin: [T, R/2]
    rotary_dim = 2 * cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot.chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([rotated, rest], dim=-1) if rest.shape[-1] else rotated
