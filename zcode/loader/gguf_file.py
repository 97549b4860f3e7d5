"""GGUF files: metadata -> HF config and tokenizer, tensors dequantized and renamed to HF names.

The metadata and tensor table are read with transformers' GGUF reader, a struct walk over a memory
map (~0.01 s for SmolLM2). `gguf.GGUFReader` builds a numpy view per metadata element and takes
~3 s on a 49k-token vocabulary, and transformers' `load_gguf_checkpoint` and
`AutoTokenizer.from_pretrained(gguf_file=...)` each ran it again. Tensors are dequantized with the
`gguf` package and renamed with gguf's own tensor-name map.
"""

import struct
from collections.abc import Iterator
from math import prod
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from zcode.loader.errors import CheckpointError

# llama.cpp's converter permutes q/k rows of Llama-style models for its interleaved RoPE kernel.
_PERMUTED_ARCHS = {"llama"}


class GgufTensor(NamedTuple):
    name: str
    shape: tuple[int, ...]  # torch order
    ggml_type: int
    start: int  # byte offset in the file
    nbytes: int


class GgufContents(NamedTuple):
    metadata: dict  # string arrays (the vocabulary) are left as their length
    tensors: list[GgufTensor]
    data: np.ndarray  # the whole file, memory-mapped uint8


def read_gguf(path: Path) -> GgufContents:
    """Metadata and tensor table, checked against the file size so that a truncated file fails
    before any tensor is read, naming the first tensor that is cut off."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    # The pinned transformers' reader, below its GgufHeader: that one sizes tensors with
    # transformers' own block table, which lacks types gguf dequantizes (Q5_0, Q5_1, ...).
    from transformers.integrations.gguf import reader

    try:
        data = np.memmap(path, mode="r", dtype=np.uint8)
        metadata, num_tensors, pos = reader._read_metadata(data, str(path))
        entries, pos = reader._read_tensor_table(data, num_tensors, pos)
    except struct.error as e:
        raise CheckpointError(f"{path}: GGUF metadata is cut short (truncated file?): {e}") from e
    except Exception as e:  # ValueError, UnicodeDecodeError, ...: not a GGUF file we can read
        raise CheckpointError(f"{path}: not a readable GGUF file: {e}") from e
    alignment = metadata.get("general.alignment", 32)
    data_start = -(-pos // alignment) * alignment
    tensors = []
    for name, shape, ggml_type, offset in entries:
        try:
            block_size, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except ValueError as e:
            raise CheckpointError(
                f"{path}: tensor {name!r} has unknown ggml type {ggml_type}"
            ) from e
        if not shape or shape[-1] % block_size:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {shape}, not whole blocks")
        tensor = GgufTensor(
            name, shape, ggml_type, data_start + offset, prod(shape) // block_size * block_bytes
        )
        if tensor.start + tensor.nbytes > len(data):
            raise CheckpointError(
                f"{path}: tensor {name!r} ends at byte {tensor.start + tensor.nbytes} but the file "
                f"has {len(data)} bytes (truncated download?)"
            )
        tensors.append(tensor)
    return GgufContents(metadata, tensors, data)


def read_gguf_config(path: Path):
    from transformers import AutoConfig

    metadata, tensors, _ = read_gguf(path)
    config = _config_dict(path, metadata, tuple(t.name for t in tensors))
    model_type = config.pop("model_type")
    config.pop("_model_name_or_path", None)
    try:
        return AutoConfig.for_model(model_type, **config)
    except Exception as e:
        raise CheckpointError(f"{path}: metadata does not make a valid config: {e}") from e


def _config_dict(path: Path, metadata: dict, tensor_names: tuple[str, ...]) -> dict:
    """The transformers config dict, as `load_gguf_checkpoint` builds it for the architectures
    zcode runs (its renames for mistral, t5, qwen2moe, ... do not apply), or from transformers'
    per-architecture builder where there is one."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS, get_gguf_config

    arch = metadata["general.architecture"]
    if arch in GGUF_CONFIG_ARCHS:
        return get_gguf_config(metadata, tensor_names)
    if arch not in GGUF_CONFIG_MAPPING:
        raise CheckpointError(f"{path}: transformers cannot map GGUF architecture {arch!r}")
    config = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(arch, {}))
    # llama.cpp writes the output projection only when it is not the embedding matrix
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    for key, value in metadata.items():
        prefix, _, name = key.partition(".")
        if prefix in (arch, "general", "tokenizer"):
            hf_name = GGUF_CONFIG_MAPPING[prefix].get(name)
            if hf_name is not None and hf_name != -1:
                config[hf_name] = value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in metadata:
        config["vocab_size"] = metadata["tokenizer.ggml.tokens"]  # the reader leaves the length
    return config


def load_gguf_tokenizer(path: Path):
    """The tokenizer the file describes (with its chat template and special tokens), built by
    transformers' GGUF converters as `AutoTokenizer.from_pretrained(gguf_file=...)` does."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    try:
        architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
        backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot build the tokenizer from its metadata: {e}") from e
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


def iter_gguf_tensors(path: Path, model: nn.Module) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """Yields (HF name, fp32 tensor, file) for every GGUF tensor the model has a parameter for."""
    from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, dequantize, get_tensor_name_map

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
    _, tensors, data = read_gguf(path)
    for tensor in tensors:
        hf_name = gguf_to_hf.get(tensor.name)
        if hf_name is None:
            continue
        rows = prod(tensor.shape[:-1])
        # raw: [*shape[:-1], bytes per row], the layout gguf.dequantize expects
        raw = data[tensor.start : tensor.start + tensor.nbytes]
        raw = raw.reshape(*tensor.shape[:-1], tensor.nbytes // rows)
        try:
            weights = dequantize(raw, GGMLQuantizationType(tensor.ggml_type))
        except Exception as e:
            raise CheckpointError(f"{path}: cannot dequantize tensor {tensor.name!r}: {e}") from e
        # F32 dequantizes to a view of the read-only map: copy it so the parameter owns its memory
        weights = torch.from_numpy(np.require(weights, np.float32, ["C", "W"]))
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
