"""Short autotune: for an (op, shape class, backend) the registry meets for the first time, check
each supporting variant against the reference on the call's own arguments, time the correct ones
(and the reference), keep the fastest, and remember it in memory and in a JSON file per machine
(the user cache dir, keyed by the hardware fingerprint and a hash of the kernels' sources).

Timing is best-of-REPS after WARMUP calls: on a shared machine other work only adds time. Under
torch.compile tracing nothing is timed: an untuned shape class takes its first supporting variant.
"""

import functools
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from zcode.hardware.probe import default_cache_dir, fingerprint
from zcode.kernels.registry import (
    OPS,
    Args,
    Variant,
    backend_of,
    outputs_match,
    reference_variant,
    variants,
)

logger = logging.getLogger(__name__)

WARMUP = 1
REPS = 5
_lock = threading.Lock()
_choices: dict[str, str] | None = None  # cache key -> variant key, loaded lazily


def cache_path() -> Path:
    return default_cache_dir() / f"kernels-{fingerprint()}-{code_version()}.json"


@functools.cache
def code_version() -> str:
    """A hash of the kernels' and weight formats' sources: a choice made for other code (a
    variant since fixed, a reference since changed) is not reused."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    kernels = root / "kernels"
    for path in sorted([*kernels.rglob("*.cpp"), *kernels.rglob("*.h"), *kernels.rglob("*.py")]):
        digest.update(path.read_bytes())
    for path in sorted((root / "quant").glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def choose(op: str, args: Args) -> Variant:
    backend = backend_of(args)
    candidates = [v for v in variants(op, backend) if v.supports(*args)]
    if not candidates:
        return reference_variant(op)
    key = f"{op}|{OPS[op].shape_class(*args)}|{backend}"
    by_key = {v.key: v for v in candidates} | {"any:reference": reference_variant(op)}
    with _lock:
        choices = _load_choices()
        if (chosen := by_key.get(choices.get(key, ""))) is not None:
            return chosen
        if torch.compiler.is_compiling():
            return candidates[0]
        chosen, timings_ms = tune(op, args, candidates)
        choices[key] = chosen.key
        _store_choices(choices)
    logger.info("autotune %s: %s (%s)", key, chosen.key, timings_ms)
    return chosen


def tune(op: str, args: Args, candidates: list[Variant]) -> tuple[Variant, dict[str, float]]:
    """The fastest of the reference and the candidates that match it on `args` (or on the op's
    `tuning_args` of them), with the best-of timings in ms of everything timed."""
    spec = OPS[op]
    shape_class = spec.shape_class(*args)
    args = spec.tuning_args(*args)
    rtol, atol = spec.tolerance(*args)
    expected = spec.reference(*args)
    timings_ms = {"any:reference": time_ms(lambda: spec.reference(*args))}
    for variant in candidates:
        try:
            correct = outputs_match(variant.fn(*args), expected, rtol, atol)
        except (RuntimeError, NotImplementedError, ValueError) as e:
            logger.info("autotune %s %s: %s failed: %s", op, shape_class, variant.key, e)
            continue
        if not correct:
            logger.warning(
                "autotune %s %s: %s disagrees with the reference; skipped",
                op,
                shape_class,
                variant.key,
            )
            continue
        timings_ms[variant.key] = time_ms(lambda v=variant: v.fn(*args))
    best = min(timings_ms, key=timings_ms.__getitem__)
    by_key = {v.key: v for v in candidates} | {"any:reference": reference_variant(op)}
    return by_key[best], timings_ms


def time_ms(fn: Callable[[], object]) -> float:
    with torch.inference_mode():
        for _ in range(WARMUP):
            fn()
        best = float("inf")
        for _ in range(REPS):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
    return 1e3 * best


def reset() -> None:
    """Forget the in-memory choices (the next call re-reads the cache file)."""
    global _choices
    with _lock:
        _choices = None


def _load_choices() -> dict[str, str]:
    global _choices
    if _choices is None:
        try:
            _choices = dict(json.loads(cache_path().read_text()))
        except FileNotFoundError:
            _choices = {}
        except (OSError, ValueError, TypeError) as e:
            logger.warning("ignoring unreadable kernel cache %s: %s", cache_path(), e)
            _choices = {}
    return _choices


def _store_choices(choices: dict[str, str]) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(choices, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not write kernel cache %s: %s", path, e)
