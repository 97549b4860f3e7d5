"""Session fixtures: each tiny checkpoint is built once, the default model is loaded once.

Tests get a factory (`tiny_checkpoint(name)`) rather than one fixture per config so that a test
parametrized over `tiny_models.configs()` builds only the checkpoints it asks for. The oracles
are shared across tests: a test that changes one must restore it. Heavy imports happen inside
the fixtures so that collecting unrelated test files stays fast.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedModel

    from zcode.llm import LLM

# Engines plan by the cost model alone: with latency feedback on, earlier requests' measured ms
# would decide later plans, and a test's plans would depend on how fast this machine ran
# (zcode.config.EngineConfig.latency_feedback; a test of it passes latency_feedback=True).
os.environ["ZCODE_LATENCY_FEEDBACK"] = "0"


# `make test` runs each file whole on one of two workers (--dist loadfile), in collection order
# (--no-loadscope-reorder; xdist's own reorder sends files by their number of tests, which put
# test_real_model's 2 tests, 77 s, and test_distributed_server's 7, 121 s, last: one worker
# then ran them alone for ~5 min, 1112 s in all for 1637 s of tests). Longest first, so that the
# last files to start are short ones. Seconds per file in the default suite on two workers
# (2026-12-07, Zen 3); files not listed took under 25 s and follow in their usual order.
FILE_SECONDS = {
    "test_spec_decode.py": 178, "test_distributed.py": 140, "test_distributed_server.py": 121,
    "test_gguf_loader.py": 112, "test_server.py": 92, "test_server_bad_input.py": 78,
    "test_real_model.py": 77, "test_cli.py": 73, "test_kernels.py": 68, "test_sparsity.py": 61,
    "test_info_planner.py": 61, "test_draft_policy.py": 49, "test_expert_cache.py": 48,
    "test_engine.py": 46, "test_request_depth.py": 35, "test_server_startup.py": 33,
    "test_plan_generate.py": 31, "test_router.py": 28, "test_mixed_plans.py": 27,
}  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))  # stable: a file's order kept


@pytest.fixture(scope="module", autouse=True)
def _collect_the_modules_engines():
    """After each test module, its engines are freed: a compiled engine takes every object alive
    out of the collector's walks (gc.freeze, LLMEngine._freeze_heap), the module's other engines
    with it, and an engine's reference cycles are then freed only by a collection after
    gc.unfreeze (in the suite's one process they stayed: 4.45 GB more after test_mixed_plans)."""
    yield
    gc.unfreeze()
    gc.collect()


@dataclass(frozen=True)
class TinyCheckpoint:
    name: str
    path: Path  # HF directory written by save_pretrained
    oracle: PreTrainedModel  # the transformers model that wrote it (eager attention, fp32)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Callable[[str], TinyCheckpoint]:
    from tiny_models import make_checkpoint

    built: dict[str, TinyCheckpoint] = {}

    def get(name: str) -> TinyCheckpoint:
        if name not in built:
            path = tmp_path_factory.mktemp(name)
            built[name] = TinyCheckpoint(name, path, make_checkpoint(name, path))
        return built[name]

    return get


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoint) -> Callable[[str], tuple[nn.Module, PreTrainedModel]]:
    """A factory of (our model, transformers' model) for a tiny checkpoint: the checkpoint is the
    session's, our model is loaded afresh for each test module (engines give it KV caches)."""
    from zcode.loader import load_model

    def get(name: str) -> tuple[nn.Module, PreTrainedModel]:
        checkpoint = tiny_checkpoint(name)
        net, _ = load_model(checkpoint.path)
        return net, checkpoint.oracle

    return get


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from zcode.loader.checkpoint import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture(scope="session")
def default_llm() -> LLM:
    from zcode.llm import LLM

    # Dequantized to fp32, the oracle's reading of the file: tests against transformers compare
    # exactly. (Run as stored, the default, the Q4_1 blocks meet llama.cpp: test_gguf_loader.py.)
    # 256 MiB of KV cache holds ~5.6k tokens of SmolLM2-135M: every perplexity window at once.
    return LLM(None, dtype="float32", kv_cache_bytes=256 << 20)


@pytest.fixture(scope="session")
def default_oracle(default_model_path: Path) -> PreTrainedModel:
    """transformers' own reading of the same GGUF file, dequantized to fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(default_model_path.parent), gguf_file=default_model_path.name, dtype=torch.float32
    )
    return model.eval()
