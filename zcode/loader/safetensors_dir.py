"""HF model directories: config.json plus one or more safetensors shards."""

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from zcode.loader.errors import CheckpointError


def read_hf_config(model_dir: Path):
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{model_dir}: no config.json (not a HF model directory)")
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
    """Yields (name, tensor, file) for every tensor; a damaged file raises CheckpointError."""
    for path in files:
        try:
            handle = safe_open(str(path), framework="pt")
            names = list(handle.keys())
        except Exception as e:
            raise CheckpointError(f"{path}: not a readable safetensors file: {e}") from e
        for name in names:
            try:
                tensor = handle.get_tensor(name)
            except Exception as e:
                raise CheckpointError(f"{path}: cannot read tensor {name!r}: {e}") from e
            yield name, tensor, path
