"""Checkpoint loading: HF directories (config.json + safetensors) and GGUF files."""

from zcode.loader.checkpoint import CheckpointError, load_model, resolve_model_path

__all__ = ["CheckpointError", "load_model", "resolve_model_path"]
