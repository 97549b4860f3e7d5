"""Quantized artifacts: a HF-style directory that ZCode loads as it loads any checkpoint.

    DIR/config.json            the model's config
    DIR/model.safetensors      every tensor of the model: the packed buffers of each quantized
                               linear (`NAME.packed.qweight`, ... or, rotated,
                               `NAME.linear.packed.qweight` and `NAME.signs`), the rest as loaded
    DIR/quantization.json      the precision plan, method and rotation, for people to read
    DIR/tokenizer*.json        the tokenizer and chat template (tokenizer.save_pretrained)

The safetensors metadata key METADATA_KEY holds the same JSON as quantization.json: that is what
the loader reads. Loading builds the model, swaps in the QuantizedLinear (or RotatedLinear) the
plan names, built straight from the stored codes and scales — nothing is quantized again — and
loads the remaining tensors as usual. A tied lm_head that is quantized is stored as its own
packed buffers; the embedding keeps the float weight.
"""

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from zcode.errors import CheckpointError
from zcode.quant.formats import PackedWeight, round_up
from zcode.quant.gptq import format_layout
from zcode.quant.hadamard import RotatedLinear
from zcode.quant.int4 import N_MULTIPLE, Int4Weight
from zcode.quant.int8 import K_MULTIPLE, Int8Weight
from zcode.quant.linear import QuantizedLinear

METADATA_KEY = "zcode.quantization"
WEIGHTS_FILE = "model.safetensors"
PLAN_FILE = "quantization.json"


def read_plan(path: str | Path) -> dict[str, str]:
    """A precision plan from JSON: {module: format}, or an object whose "plan" is that map
    (quantization.json and the planner's output). Raises ValueError naming the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not JSON: {e}") from e
    plan = data.get("plan", data) if isinstance(data, dict) else data
    if not isinstance(plan, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in plan.items()
    ):
        raise ValueError(f"{path}: expected a JSON object mapping module names to formats")
    return plan


def save_artifact(
    model: nn.Module,
    tokenizer,
    out_dir: str | Path,
    method: str,
    hadamard: bool,
) -> Path:
    """Writes `model`, already quantized by apply_precision(..., method, hadamard), to out_dir;
    the plan recorded is the format of every quantized module found in it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    modules = dict(model.named_modules())
    rotated = {f"{name}.linear" for name, m in modules.items() if isinstance(m, RotatedLinear)}
    quantized = {
        name: module.format
        for name, module in modules.items()
        if isinstance(module, (QuantizedLinear, RotatedLinear)) and name not in rotated
    }
    if rotated and len(rotated) != len(quantized):
        raise ValueError("an artifact rotates every quantized linear or none")
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the loader ties it again
    state.update({name: t.contiguous() for name, t in getattr(model, "mtp_weights", {}).items()})
    info = {"method": method, "hadamard": hadamard, "plan": quantized}
    text = json.dumps(info, indent=2) + "\n"
    save_file(state, str(out_dir / WEIGHTS_FILE), metadata={METADATA_KEY: text})
    (out_dir / PLAN_FILE).write_text(text)
    model.config.save_pretrained(str(out_dir))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
    return out_dir


def artifact_info(files: list[Path]) -> dict | None:
    """The quantization JSON of a safetensors checkpoint, or None for a plain one."""
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                text = (handle.metadata() or {}).get(METADATA_KEY)
        except Exception as e:
            raise CheckpointError(f"{file}: not a readable safetensors file: {e}") from e
        if text is not None:
            try:
                return json.loads(text)
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{file}: malformed {METADATA_KEY} metadata: {e}") from e
    return None


def load_quantized_modules(net: nn.Module, files: list[Path]) -> set[str]:
    """Swaps in the quantized modules an artifact's metadata names, built from its stored
    buffers, and returns the tensor names consumed (the caller loads the rest). A plain
    checkpoint changes nothing and returns an empty set."""
    info = artifact_info(files)
    if info is None:
        return set()
    plan, hadamard = info.get("plan"), info.get("hadamard")
    if not isinstance(plan, dict) or not isinstance(hadamard, bool):
        raise CheckpointError(f"{files[0]}: {METADATA_KEY} metadata lacks 'plan' or 'hadamard'")
    reader = _TensorReader(files)
    modules = dict(net.named_modules())
    consumed: set[str] = set()
    for name, fmt in plan.items():
        linear = modules.get(name)
        if not isinstance(linear, nn.Linear):
            raise CheckpointError(f"{files[0]}: plan names {name!r}, not a linear of this model")
        try:
            cls, group_size = format_layout(fmt)
        except ValueError as e:
            raise CheckpointError(f"{files[0]}: {name}: {e}") from e
        prefix = f"{name}.linear.packed." if hadamard else f"{name}.packed."
        buffers = {
            key: reader.read(prefix + key, dtype, shape)
            for key, (dtype, shape) in _buffer_specs(cls, group_size, linear).items()
        }
        consumed.update(prefix + key for key in buffers)
        packed = _packed(cls, group_size, buffers, linear)
        module = QuantizedLinear(packed, linear.bias, fmt)
        if hadamard:
            signs = reader.read(f"{name}.signs", torch.float32, (linear.in_features,))
            consumed.add(f"{name}.signs")
            module = RotatedLinear(module, signs)
        parent, _, child = name.rpartition(".")
        setattr(net.get_submodule(parent), child, module)
    return consumed


def _buffer_specs(cls, group_size: int | None, linear: nn.Linear) -> dict[str, tuple]:
    """Buffer name -> (dtype, shape) the format stores for this linear."""
    num_out, num_in = linear.out_features, linear.in_features
    if issubclass(cls, Int4Weight):
        cols = round_up(num_in, group_size)
        rows = round_up(num_out, N_MULTIPLE)
        return {
            "qweight": (torch.uint8, (rows, cols // 2)),
            "scales_and_zeros": (torch.bfloat16, (cols // group_size, rows, 2)),
        }
    if issubclass(cls, Int8Weight):
        return {
            "qweight": (torch.int8, (num_out, round_up(num_in, K_MULTIPLE))),
            "scales": (torch.bfloat16, (num_out,)),
        }
    return {"weight": (torch.bfloat16, (num_out, num_in))}


def _packed(cls, group_size: int | None, buffers: dict, linear: nn.Linear) -> PackedWeight:
    num_out, num_in = linear.out_features, linear.in_features
    if issubclass(cls, Int4Weight):
        return cls(buffers["qweight"], buffers["scales_and_zeros"], group_size, num_out, num_in)
    if issubclass(cls, Int8Weight):
        return cls(buffers["qweight"], buffers["scales"], num_in)
    return cls(buffers["weight"])


class _TensorReader:
    """Reads named tensors from a set of safetensors files, checking dtype and shape."""

    def __init__(self, files: list[Path]) -> None:
        self.file_of: dict[str, Path] = {}
        for file in files:
            try:
                with safe_open(str(file), framework="pt") as handle:
                    self.file_of.update(dict.fromkeys(handle.keys(), file))
            except Exception as e:
                raise CheckpointError(f"{file}: not a readable safetensors file: {e}") from e

    def read(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        file = self.file_of.get(name)
        if file is None:
            raise CheckpointError(f"quantized checkpoint lacks tensor {name!r}")
        try:
            with safe_open(str(file), framework="pt") as handle:
                tensor = handle.get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{file}: cannot read tensor {name!r}: {e}") from e
        if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"{file}: tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, "
                f"the plan's format needs {dtype} {tuple(shape)}"
            )
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CheckpointError(f"{file}: tensor {name!r} contains NaN or Inf")
        # Copied into torch's own 64-byte aligned memory (safetensors' tensors sat at 32-byte
        # offsets here). Once, before this copy, the packed int8 kernel crashed (SIGSEGV) on a
        # loaded weight; it did not recur since, nor with misaligned weights in isolation.
        return tensor.clone()
