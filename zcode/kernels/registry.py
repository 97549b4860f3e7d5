"""The kernel registry: every op has one reference implementation and any number of variants per
backend; `get` returns the variant the autotuner measured fastest (and correct) for the call.

An op is registered with
- `reference(*args)`: plain PyTorch, obviously correct (reused from zcode/layers and zcode/quant);
- `shape_class(*args)`: a short string that groups calls a single choice serves (row-count bucket,
  format, ...); the autotune cache is keyed by (op, shape class, backend, hardware);
- `cases()`: named random inputs, odd shapes included, which the test suite runs every variant on
  against the reference, and which the autotuner times when it meets a shape class;
- `tolerance(*args)`: (rtol, atol) for comparing a variant's output with the reference's;
- `tuning_args(*args)`: optionally, the smaller arguments the autotuner measures in their place
  (a slice of a weight too large to dequantize whole for the reference).

A variant is registered for a backend (`cpu` or `cuda`) with an optional `supports(*args)`
predicate (a kernel that only handles some formats or dtypes). Outputs are tensors or tuples of
tensors; the comparison (`outputs_match`) lives here so tests and autotune agree.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

BACKENDS = ("cpu", "cuda")
Args = tuple
Case = tuple[str, Callable[[torch.Generator], Args]]  # (name, seeded generator -> args)


@dataclass(frozen=True)
class Variant:
    op: str
    name: str
    backend: str
    fn: Callable
    supports: Callable[..., bool] = lambda *args: True

    @property
    def key(self) -> str:
        return f"{self.backend}:{self.name}"


@dataclass
class Op:
    name: str
    reference: Callable
    shape_class: Callable[..., str]
    cases: Callable[[], list[Case]]
    tolerance: Callable[..., tuple[float, float]]
    tuning_args: Callable[..., Args] = lambda *args: args
    variants: list[Variant] = field(default_factory=list)


OPS: dict[str, Op] = {}


def define_op(
    name: str,
    reference: Callable,
    shape_class: Callable[..., str],
    cases: Callable[[], list[Case]],
    tolerance: Callable[..., tuple[float, float]] = lambda *args: (1e-4, 1e-5),
    tuning_args: Callable[..., Args] = lambda *args: args,
) -> Op:
    if name in OPS:
        raise ValueError(f"op {name!r} is already defined")
    OPS[name] = Op(name, reference, shape_class, cases, tolerance, tuning_args)
    return OPS[name]


def register(
    op: str, name: str, backend: str = "cpu", supports: Callable[..., bool] | None = None
) -> Callable[[Callable], Callable]:
    """Decorator: registers `fn` as variant `name` of `op` on `backend`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    def decorate(fn: Callable) -> Callable:
        variants = OPS[op].variants
        if any(v.name == name and v.backend == backend for v in variants):
            raise ValueError(f"{op}: variant {backend}:{name} is already registered")
        variants.append(Variant(op, name, backend, fn, supports or (lambda *args: True)))
        return fn

    return decorate


def reference_variant(op: str) -> Variant:
    return Variant(op, "reference", "any", OPS[op].reference)


def variants(op: str, backend: str | None = None) -> list[Variant]:
    """The fast variants of `op` (on `backend`, or all)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; known: {', '.join(sorted(OPS))}")
    return [v for v in OPS[op].variants if backend is None or v.backend == backend]


def backend_of(args: Args) -> str:
    """`cuda` when any tensor argument lives on a GPU, else `cpu`."""
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.is_cuda:
            return "cuda"
    return "cpu"


def get(op: str, *args) -> Callable:
    """The implementation to run `op` on these arguments with: the autotuned choice for their
    shape class on their backend (measured once, then read from the cache)."""
    from zcode.kernels.autotune import choose

    return choose(op, args).fn


def call(op: str, *args):
    return get(op, *args)(*args)


def outputs_match(actual, expected, rtol: float, atol: float) -> bool:
    if isinstance(expected, tuple | list):
        return len(actual) == len(expected) and all(
            outputs_match(a, e, rtol, atol) for a, e in zip(actual, expected)
        )
    if expected.dtype in (torch.bool, torch.int64, torch.int32):
        return actual.dtype == expected.dtype and torch.equal(actual.cpu(), expected.cpu())
    return actual.shape == expected.shape and torch.allclose(
        actual.float().cpu(), expected.float().cpu(), rtol=rtol, atol=atol
    )
