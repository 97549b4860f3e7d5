"""apply_precision: swap a model's named nn.Linear modules for QuantizedLinear, one format each."""

from torch import nn

from zcode.quant.linear import FORMATS, Kernel, QuantizedLinear

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
        if type(module) is nn.Linear and not name.endswith(PROTECTED_SUFFIXES)
    ]


def apply_precision(
    model: nn.Module, plan: dict[str, str], kernel: Kernel = "fast"
) -> dict[str, QuantizedLinear]:
    """Quantizes each named linear module of `model` in place, by round-to-nearest.

    `plan` maps module names (`model.layers.3.mlp.down_proj`, `lm_head`) to a format in
    FORMATS or "fp32"; modules it leaves out are unchanged. The whole plan is checked before any
    module changes: an unknown name or format, a protected module (router, DSA indexer head
    weights) or anything that is not an nn.Linear (norms, embeddings) raises ValueError. A tied
    lm_head is quantized from a copy: the embedding lookup keeps its weight.

    Returns the new modules by name.
    """
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
        if isinstance(module, QuantizedLinear):
            raise ValueError(f"{name}: already quantized ({module.format})")
        if type(module) is not nn.Linear:
            raise ValueError(
                f"{name}: only nn.Linear modules take a weight format, "
                f"this is {type(module).__name__}"
            )
        todo[name] = fmt
    replaced = {}
    for name, fmt in todo.items():
        parent_name, _, child = name.rpartition(".")
        new = QuantizedLinear.from_linear(modules[name], fmt, kernel)
        setattr(model.get_submodule(parent_name), child, new)
        replaced[name] = new
    return replaced
