"""GGUF files: metadata -> HF config and tokenizer (via transformers), tensors dequantized with
the `gguf` package and renamed to HF names with gguf's own tensor-name map."""

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from zcode.loader.errors import CheckpointError

# llama.cpp's converter permutes q/k rows of Llama-style models for its interleaved RoPE kernel.
_PERMUTED_ARCHS = {"llama"}


def _reader(path: Path):
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable GGUF file: {e}") from e
    file_size = os.path.getsize(path)
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > file_size:
            raise CheckpointError(
                f"{path}: tensor {tensor.name!r} ends at byte {end} but the file has {file_size} "
                "bytes (truncated download?)"
            )
    return reader


def read_gguf_config(path: Path):
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    _reader(path)
    try:
        parsed = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read model metadata: {e}") from e
    model_type = parsed.pop("model_type")
    parsed.pop("_model_name_or_path", None)
    return AutoConfig.for_model(model_type, **parsed)


def load_gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def iter_gguf_tensors(path: Path, model: nn.Module) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """Yields (HF name, fp32 tensor, file) for every GGUF tensor the model has a parameter for."""
    from gguf import MODEL_ARCH_NAMES, dequantize, get_tensor_name_map

    config = model.config
    arch = next((a for a, name in MODEL_ARCH_NAMES.items() if name == config.model_type), None)
    if arch is None:
        raise CheckpointError(f"{path}: gguf has no tensor-name map for {config.model_type!r}")
    name_map = get_tensor_name_map(arch, config.num_hidden_layers)
    gguf_to_hf = {}
    for hf_name, _ in model.named_parameters():
        stem, suffix = hf_name.rsplit(".", 1)
        gguf_stem = name_map.get_name(stem)
        if gguf_stem is not None:
            gguf_to_hf[f"{gguf_stem}.{suffix}"] = hf_name
    for tensor in _reader(path).tensors:
        hf_name = gguf_to_hf.get(tensor.name)
        if hf_name is None:
            continue
        try:
            weights = dequantize(tensor.data, tensor.tensor_type)
        except Exception as e:
            raise CheckpointError(f"{path}: cannot dequantize tensor {tensor.name!r}: {e}") from e
        weights = torch.from_numpy(np.ascontiguousarray(weights, dtype=np.float32))
        if config.model_type in _PERMUTED_ARCHS:
            if hf_name.endswith("q_proj.weight"):
                weights = _unpermute(weights, config.num_attention_heads)
            elif hf_name.endswith("k_proj.weight"):
                weights = _unpermute(weights, config.num_key_value_heads)
        yield hf_name, weights, path


def _unpermute(weights: torch.Tensor, num_heads: int) -> torch.Tensor:
    # [H * D, in] stored as per-head (D/2, 2) pairs -> HF's (2, D/2) halves
    rows = weights.shape[0] // num_heads // 2
    return weights.reshape(num_heads, rows, 2, -1).transpose(1, 2).reshape(weights.shape)
