"""apply_precision: swap a model's named nn.Linear modules for QuantizedLinear, one format each,
by round-to-nearest or GPTQ, optionally behind a Hadamard rotation of the inputs."""

import logging
from typing import Literal

import torch
from torch import nn
from tqdm import tqdm

from zcode.quant.gptq import gptq_quantize
from zcode.quant.hadamard import (
    RotatedLinear,
    hadamard_block,
    hadamard_matrix,
    random_signs,
    rotate,
    rotate_hessian,
)
from zcode.quant.linear import FORMATS, Kernel, QuantizedLinear, quantize_weight

logger = logging.getLogger(__name__)

Method = Literal["rtn", "gptq"]
METHODS = ("rtn", "gptq")
HADAMARD_SEED = 0  # one sign pattern per input width: the artifact stores it anyway

UNCHANGED = "fp32"  # a plan entry that leaves the module as loaded
# Modules whose precision decides what runs or is read elsewhere, never quantized: the MoE router
# picks experts (a flipped choice is not a small error), and the DSA indexer's head weights are
# kept in fp32 by the loader and read as `.weight` by the indexer.
PROTECTED_SUFFIXES = ("mlp.gate", "indexer.weights_proj")


def quantizable_modules(model: nn.Module) -> list[str]:
    """Names of the modules a plan may give a format: every nn.Linear except the protected."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not name.endswith(PROTECTED_SUFFIXES)
    ]


def quantize_linear(
    linear: nn.Linear,
    fmt: str,
    kernel: Kernel = "fast",
    hessian: torch.Tensor | None = None,
    hadamard: bool = False,
) -> QuantizedLinear | RotatedLinear:
    """One linear in format `fmt`: GPTQ when its inputs' Hessian X^T X is given, else
    round-to-nearest; with `hadamard`, W R is quantized behind an online rotation of x."""
    weight = linear.weight.detach().float()
    if hadamard:
        signs = random_signs(linear.in_features, HADAMARD_SEED)
        matrix = hadamard_matrix(hadamard_block(linear.in_features))
        weight = rotate(weight, signs, matrix)
        if hessian is not None:
            hessian = rotate_hessian(hessian, signs, matrix)
    if hessian is None:
        packed = quantize_weight(weight, fmt)
    else:
        packed = gptq_quantize(weight, hessian, fmt)
    quantized = QuantizedLinear(packed, linear.bias, fmt, kernel)
    return RotatedLinear(quantized, signs) if hadamard else quantized


def apply_precision(
    model: nn.Module,
    plan: dict[str, str],
    kernel: Kernel = "fast",
    method: Method = "rtn",
    hessians: dict[str, torch.Tensor] | None = None,
    hadamard: bool = False,
) -> dict[str, QuantizedLinear | RotatedLinear]:
    """Quantizes each named linear module of `model` in place.

    `method` "rtn" rounds to nearest; "gptq" needs `hessians` (X^T X of each module's inputs,
    from zcode.quant.activations.collect_hessians) and falls back to round-to-nearest, with a
    warning, for a module it has none for (a MoE expert calibration never routed to).
    `hadamard` puts every quantized module behind a Hadamard rotation of its inputs.

    `plan` maps module names (`model.layers.3.mlp.down_proj`, `lm_head`) to a format in
    FORMATS or "fp32"; modules it leaves out are unchanged. The whole plan is checked before any
    module changes: an unknown name or format, a protected module (router, DSA indexer head
    weights) or anything that is not an nn.Linear (norms, embeddings) raises ValueError. A tied
    lm_head is quantized from a copy: the embedding lookup keeps its weight.

    Returns the new modules by name.
    """
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; known: {', '.join(METHODS)}")
    if method == "gptq" and hessians is None:
        raise ValueError("method 'gptq' needs the Hessians of the modules' inputs")
    modules = dict(model.named_modules())
    todo = {}
    for name, fmt in plan.items():
        if fmt == UNCHANGED:
            continue
        if fmt not in FORMATS:
            raise ValueError(
                f"{name}: unknown format {fmt!r}; known: {UNCHANGED}, {', '.join(FORMATS)}"
            )
        module = modules.get(name)
        if module is None:
            raise ValueError(f"{name}: no such module in {type(model).__name__}")
        if name.endswith(PROTECTED_SUFFIXES):
            raise ValueError(f"{name}: protected module, kept in high precision")
        if isinstance(module, (QuantizedLinear, RotatedLinear)):
            raise ValueError(f"{name}: already quantized ({module.format})")
        if not isinstance(module, nn.Linear):
            raise ValueError(
                f"{name}: only nn.Linear modules take a weight format, "
                f"this is {type(module).__name__}"
            )
        todo[name] = fmt
    hessians = hessians if method == "gptq" else {}
    uncalibrated = [name for name in todo if name not in hessians]
    if method == "gptq" and uncalibrated:
        logger.warning(
            "no calibration inputs reached %d modules, rounded to nearest: %s",
            len(uncalibrated),
            ", ".join(uncalibrated[:5]),
        )
    replaced = {}
    progress = tqdm(todo.items(), desc=f"quantize ({method})", unit="module", disable=None)
    for name, fmt in progress:
        parent_name, _, child = name.rpartition(".")
        new = quantize_linear(modules[name], fmt, kernel, hessians.get(name), hadamard)
        setattr(model.get_submodule(parent_name), child, new)
        replaced[name] = new
    return replaced
