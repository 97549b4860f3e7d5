"""HF model directories: config.json plus one or more safetensors shards."""

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoConfig

from zcode.errors import CheckpointError
from zcode.loader import pages

# The keys that size a model: transformers fills a missing one with its config class's default
# (a 4096-wide Llama), which would describe some other model without a word.
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def read_hf_config(model_dir: Path):
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{model_dir}: no config.json (not a HF model directory)")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config_file}: not a JSON file: {e}") from e
    shape = raw.get("text_config", raw) if isinstance(raw, dict) else None
    if not isinstance(shape, dict):
        raise CheckpointError(f"{config_file}: not a model config (a JSON object is expected)")
    if missing := [key for key in SHAPE_KEYS if key not in shape]:
        raise CheckpointError(
            f"{config_file}: no {', '.join(missing)}: the config does not give the model's shape"
        )
    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # transformers raises many types for a bad config
        raise CheckpointError(f"{config_file}: cannot parse model config: {e}") from e


def shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: malformed safetensors index: {e}") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: lists shards that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weights found")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """Yields (name, tensor, file) for every tensor; a damaged file raises CheckpointError.

    Tensors are views of a copy-on-write memory map of the file (zero-copy: a page is read when
    first touched, and a write copies only that page); safetensors' `safe_open` still checks the
    header and the file size first. A tensor whose dtype or alignment a view cannot take is read
    by safe_open. Once the consumer asks for the next tensor, this process lets go of the pages
    of the previous view it touched (zcode.loader.pages), before anything wrote to it: the
    loader's checks read every tensor, and a tensor-parallel rank keeps only its slices, so
    loading holds one tensor resident at a time, not the file; a view kept and used later maps
    its pages again."""
    for path in files:
        try:
            handle = safe_open(str(path), framework="pt")
            names = list(handle.keys())
        except Exception as e:
            raise CheckpointError(f"{path}: not a readable safetensors file: {e}") from e
        header, data = _mapped(path)
        for name in names:
            tensor = _view(data, header.get(name))
            if tensor is not None:
                yield name, tensor, path
                pages.drop(tensor)
                continue
            try:
                tensor = handle.get_tensor(name)
            except Exception as e:
                raise CheckpointError(f"{path}: cannot read tensor {name!r}: {e}") from e
            yield name, tensor, path


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _mapped(path: Path) -> tuple[dict, torch.Tensor]:
    """(header, uint8 tensor of the data section) of a file safe_open has already checked."""
    raw = np.memmap(path, mode="c", dtype=np.uint8)
    header_len = int.from_bytes(raw[:8].tobytes(), "little")
    header = json.loads(raw[8 : 8 + header_len].tobytes())
    return header, torch.from_numpy(raw[8 + header_len :])


def _view(data: torch.Tensor, info: dict | None) -> torch.Tensor | None:
    if info is None or info.get("dtype") not in _DTYPES:
        return None
    dtype = _DTYPES[info["dtype"]]
    start, end = info["data_offsets"]
    size = dtype.itemsize
    if (data.data_ptr() + start) % size or (end - start) % size:
        return None
    return data[start:end].view(dtype).view(info["shape"])
