"""Expert offload (zcode/engine/expert_cache.py) on tiny GLM MoE checkpoints loaded as stored.

Oracles: the same engine without an expert cache for the tokens (test_parity ties that one to
transformers); the routed expert ids seen by a forward hook on every router, counted here, for
the lookups, hits and disk bytes; mincore (the kernel's page residency) for what stays in RAM.
Each test copies its checkpoint to a fresh file, on disk and out of the page cache, so no other
model in the session maps its pages and no large folio of the write straddles experts (see the
expert_cache docstring).
"""

import os
import shutil
from pathlib import Path

import pytest
import torch

from scripts import make_gguf
from zcode import cli
from zcode.errors import ValidationError
from zcode.layers.moe import MoE, set_experts_per_token
from zcode.llm import LLM
from zcode.sampling_params import SamplingParams

MOE_NAMES = ["glm4_moe", "glm_moe_dsa"]
PROMPTS = [[5, 17, 42, 99, 7, 250, 31, 64, 12, 200], [9, 8, 7, 6, 5, 4, 3]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _on_disk(path: Path) -> Path:
    """`path` (a file or the files of a directory) written back and out of the page cache."""
    for f in path.iterdir() if path.is_dir() else [path]:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)  # dirty pages cannot leave the page cache
        # nor can the large folios of a file just written: start from the file on disk
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    return path


def _fresh_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return _on_disk(dst)


def _tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(prompts, GREEDY)]


def _assert_residency_is_real(llm: LLM) -> None:
    """Experts the cache keeps are in RAM and those it dropped are not, by mincore; the kept ones
    are locked there, by the kernel's count of locked bytes in the file's mappings."""
    cache = llm.engine.expert_cache
    measured = cache.measured_residency()  # [L, E]
    assert torch.equal(measured[cache.resident], torch.ones(int(cache.resident.sum())))
    assert not measured[~cache.resident].any()
    assert torch.equal(cache.pinned, cache.resident)
    ranges = [r for layer in cache.ranges for e in layer for r in e]
    expected = sum(
        r._whole_pages()[1] - r._whole_pages()[0]
        for (i, e), pinned in zip(_expert_ids(cache), cache.pinned.flatten().tolist())
        if pinned
        for r in cache.ranges[i][e]
    )
    paths = {os.readlink(f"/proc/self/fd/{r.fd}") for r in ranges}
    assert _smaps_bytes(paths, "Locked:") == expected
    # the file's pages themselves: locking a copy-on-write mapping must not copy them (a plain
    # mlock populated it with write faults, one anonymous copy per page)
    assert _smaps_bytes(paths, "Anonymous:") == 0


def _expert_ids(cache) -> list[tuple[int, int]]:
    return [(i, e) for i in range(len(cache.ranges)) for e in range(len(cache.ranges[i]))]


def _smaps_bytes(paths: set[str], field: str) -> int:
    """The kernel's count of `field` bytes ("Locked:", "Anonymous:") in this process's mappings
    of `paths` (smaps)."""
    total, in_file = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            in_file = len(fields) == 6 and fields[5] in paths
        elif in_file and fields[0] == field:
            total += int(fields[1]) * 1024
    return total


@pytest.mark.parametrize("name, policy", [(n, "lru") for n in MOE_NAMES] + [("glm4_moe", "lfu")])
def test_evicting_budget_gives_the_same_tokens(name, policy, tiny_checkpoint, tmp_path):
    path = _fresh_copy(tiny_checkpoint(name).path, tmp_path / name)
    llm = LLM(path, kv_cache_bytes=1 << 20, expert_cache_fraction=0.25, expert_cache_policy=policy)
    got = _tokens(llm)
    stats = llm.engine.stats()
    cache = llm.engine.expert_cache
    assert stats["expert_cache_resident_bytes"] <= cache.budget_bytes < cache.total_expert_bytes
    # evictions: more bytes read than every expert once, so some expert was read again
    assert stats["expert_cache_read_bytes"] > cache.total_expert_bytes
    assert 0 < stats["expert_cache_hits"] < stats["expert_cache_lookups"]
    _assert_residency_is_real(llm)
    resident = LLM(path, kv_cache_bytes=1 << 20, expert_cache_fraction=1.0)
    assert _tokens(resident) == got
    assert _tokens(LLM(path, kv_cache_bytes=1 << 20)) == got


def _routed_ids_per_step(llm: LLM, prompt: list[int]) -> tuple[list[set], list[int]]:
    """Runs one greedy request step by step; per step the (layer, expert) pairs its routers
    chose, from forward hooks, and the request's output token ids."""
    layers = [m for m in llm.model.modules() if isinstance(m, MoE)]
    seen: set = set()

    def hook(layer_index):
        def record(module, args, out):
            seen.update((layer_index, e) for e in out[1].flatten().tolist())

        return record

    handles = [layer.gate.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    steps, out = [], None
    llm.engine.add_request(prompt, GREEDY)
    while llm.engine.has_unfinished():
        (out,) = llm.engine.step()
        steps.append(set(seen))
        seen.clear()
    for h in handles:
        h.remove()
    return steps, out


def _expert_bytes(llm: LLM) -> dict[tuple[int, int], int]:
    layers = [m for m in llm.model.modules() if isinstance(m, MoE)]
    return {
        (i, e): sum(p.nbytes for p in expert.parameters())
        for i, layer in enumerate(layers)
        for e, expert in enumerate(layer.experts)
    }


def _lru_misses(steps: list[set], capacity: int) -> list[set]:
    """Misses of an LRU cache of `capacity` equal-sized experts that keeps, after each step, the
    most recently used; within one step the ones it already held, then by (layer, expert)."""
    held: set = set()
    last_step: dict = {}
    misses = []
    for step, used in enumerate(steps):
        misses.append(used - held)
        last_step.update(dict.fromkeys(used, step))
        order = sorted(held | used, key=lambda k: (-last_step[k], k not in held, k))
        held = set(order[:capacity])
    return misses


@pytest.mark.parametrize("name", MOE_NAMES)
@pytest.mark.parametrize(
    "budget", [{"expert_cache_fraction": 1.0}, {"expert_cache_gb": 0}, "lru 3 experts"]
)
def test_accounting_matches_the_routed_ids(budget, name, tiny_checkpoint, tmp_path):
    path = _fresh_copy(tiny_checkpoint(name).path, tmp_path / name)
    if budget == "lru 3 experts":
        bytes_per_expert = set(_expert_bytes(LLM(path, kv_cache_bytes=1 << 20)).values())
        assert len(bytes_per_expert) == 1
        budget = {"expert_cache_gb": 3 * bytes_per_expert.pop() / 1e9}
        budget["expert_cache_policy"] = "lru"
    llm = LLM(path, kv_cache_bytes=1 << 20, **budget)
    prompt = PROMPTS[0]
    steps, out = _routed_ids_per_step(llm, prompt)
    sizes = _expert_bytes(llm)
    if budget.get("expert_cache_fraction") == 1.0:  # cold start, then everything stays
        misses = [s - set().union(*steps[:i]) for i, s in enumerate(steps)]
    elif budget["expert_cache_gb"] == 0:
        misses = steps
    else:
        misses = _lru_misses(steps, capacity=3)
    num_lookups = sum(map(len, steps))
    read_bytes = sum(sizes[k] for step in misses for k in step)
    num_tokens = len(prompt) + GREEDY.max_tokens - 1  # the last token is sampled, not run
    stats = llm.engine.stats()
    assert stats["expert_cache_lookups"] == num_lookups
    assert stats["expert_cache_hits"] == num_lookups - sum(map(len, misses))
    assert stats["expert_cache_read_bytes"] == read_bytes
    assert stats["expert_cache_tokens"] == num_tokens
    report = out.expert_cache  # batch 1: the request's figures are the engine's
    assert report["num_tokens"] == num_tokens
    assert report["disk_bytes_per_token"] == pytest.approx(read_bytes / num_tokens)
    assert report["hit_rate"] == pytest.approx(stats["expert_cache_hit_rate"])
    _assert_residency_is_real(llm)


@pytest.mark.parametrize("name, count", [(n, None) for n in MOE_NAMES] + [("glm4_moe", 1)])
def test_prefetch_reads_the_next_routers_choice(name, count, tiny_checkpoint, tmp_path):
    """With nothing resident (budget 0) every routed expert is a miss; the cache reads ahead,
    per step and layer, the experts the next layer's router picks for this layer's input (under
    the plan's experts per token: one of two with count 1), and counts as prefetch hits the
    misses among them. The oracle replays that from hooks."""
    path = _fresh_copy(tiny_checkpoint(name).path, tmp_path / name)
    llm = LLM(path, kv_cache_bytes=1 << 20, expert_cache_gb=0)
    set_experts_per_token(llm.model, count)
    layers = [m for m in llm.model.modules() if isinstance(m, MoE)]

    def chosen(layer: MoE, x: torch.Tensor) -> set[int]:
        return {e for e in layer.route(x)[1].flatten().tolist() if e >= 0}

    inputs: dict[int, torch.Tensor] = {}
    handles = [
        layer.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0]))
        for i, layer in enumerate(layers)
    ]
    llm.engine.add_request(PROMPTS[0], GREEDY)
    prefetched = hits = 0
    while llm.engine.has_unfinished():
        (out,) = llm.engine.step()
        with torch.inference_mode():  # the step's inputs are inference tensors
            routed = [chosen(layer, inputs[i]) for i, layer in enumerate(layers)]
            for i in range(len(layers) - 1):
                ahead = chosen(layers[i + 1], inputs[i])
                prefetched += len(ahead)
                hits += len(ahead & routed[i + 1])
    for h in handles:
        h.remove()
    stats = llm.engine.stats()
    assert stats["expert_cache_prefetched"] == prefetched > 0
    assert stats["expert_cache_prefetch_hits"] == hits
    _assert_residency_is_real(llm)  # experts read ahead and not kept are dropped
    no_prefetch = LLM(path, kv_cache_bytes=1 << 20, expert_cache_gb=0, expert_cache_prefetch=False)
    set_experts_per_token(no_prefetch.model, count)
    assert _tokens(no_prefetch, PROMPTS[:1]) == [out.token_ids]
    assert no_prefetch.engine.stats()["expert_cache_prefetched"] == 0


def test_without_the_right_to_lock_the_cache_runs_unpinned(tiny_checkpoint, tmp_path, caplog):
    from zcode.engine import expert_cache

    path = _fresh_copy(tiny_checkpoint("glm4_moe").path, tmp_path / "glm4_moe")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(expert_cache.FileRange, "pin", lambda self: False)
        llm = LLM(path, kv_cache_bytes=1 << 20, expert_cache_fraction=0.5)
        got = _tokens(llm, PROMPTS[:1])
    cache = llm.engine.expert_cache
    assert not cache.pinning and not cache.pinned.any() and cache.resident.any()
    assert llm.engine.stats()["expert_cache_pinned_bytes"] == 0
    assert sum("refused to lock" in r.getMessage() for r in caplog.records) == 1
    assert got == _tokens(LLM(path, kv_cache_bytes=1 << 20), PROMPTS[:1])


# slow: compiles the decode graph (~40 s on 2 cores)
@pytest.mark.slow
def test_compiled_decode_counts_the_same_experts(tiny_checkpoint, tmp_path):
    path = _fresh_copy(tiny_checkpoint("glm4_moe").path, tmp_path / "glm4_moe")
    budget = {"kv_cache_bytes": 1 << 20, "expert_cache_fraction": 0.25, "max_num_seqs": 1}
    eager = LLM(path, **budget)
    compiled = LLM(path, compile=True, **budget)
    prompt = PROMPTS[:1]
    assert _tokens(compiled, prompt) == _tokens(eager, prompt)
    assert compiled.engine.stats()["num_graph_compiles"] >= 1
    for key in ("expert_cache_lookups", "expert_cache_hits", "expert_cache_read_bytes"):
        assert compiled.engine.stats()[key] == eager.engine.stats()[key], key


def test_gguf_experts_offload(tmp_path):
    files = make_gguf.make_gguf_files("glm4_moe", tmp_path, ("f32",))
    path = _on_disk(files["f32"])
    llm = LLM(path, kv_cache_bytes=1 << 20, expert_cache_fraction=0.25)
    got = _tokens(llm)
    cache = llm.engine.expert_cache
    assert llm.engine.stats()["expert_cache_read_bytes"] > cache.total_expert_bytes
    _assert_residency_is_real(llm)
    assert _tokens(LLM(path, kv_cache_bytes=1 << 20)) == got


def test_converted_weights_and_dense_models_are_refused(tiny_checkpoint):
    with pytest.raises(ValidationError, match="load them as stored"):
        LLM(tiny_checkpoint("glm4_moe").path, dtype="bfloat16", expert_cache_gb=1)
    with pytest.raises(ValidationError, match="no MoE layers"):
        LLM(tiny_checkpoint("llama").path, expert_cache_gb=1)


@pytest.mark.parametrize("size", ["lots", "-1", "150%", "inf"])
def test_bad_budget_fails_before_loading(size, capsys, monkeypatch):
    monkeypatch.setattr(cli.options, "load_llm", lambda *a, **k: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "hi", "--expert-cache-gb", size])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("zcode: error: --expert-cache-gb takes GB") and err.count("\n") == 1


def test_metrics_count_the_engine_totals():
    from zcode.server.metrics import Metrics

    metrics = Metrics("m")
    stats = {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0}
    for hits in (3, 5):
        metrics.engine_stats(
            stats
            | {
                "expert_cache_lookups": 8,
                "expert_cache_hits": hits,
                "expert_cache_read_bytes": 1000,
                "expert_cache_resident_bytes": 4096,
            }
        )
    text = metrics.render().decode()
    assert 'zcode:expert_cache_hits_total{model_name="m"} 5.0' in text
    assert 'zcode:expert_cache_disk_read_bytes_total{model_name="m"} 1000.0' in text
    assert 'zcode:expert_cache_resident_bytes{model_name="m"} 4096.0' in text


class _Loaded(Exception):
    pass


def test_cli_passes_the_budget(monkeypatch):
    seen = {}

    def load_llm(*args, **engine_args):
        seen.update(engine_args)
        raise _Loaded

    monkeypatch.setattr(cli.options, "load_llm", load_llm)
    for size, want in (("25%", {"expert_cache_fraction": 0.25}), ("1.5", {"expert_cache_gb": 1.5})):
        seen.clear()
        with pytest.raises(_Loaded):
            cli.main(["generate", "hi", "--expert-cache-gb", size])
        assert {k: seen.get(k) for k in want} == want


def test_an_expert_limit_counts_and_reads_only_the_kept_experts(tiny_checkpoint, tmp_path):
    """One routed expert per token of the router's two (a plan's experts_per_token): each decode
    step of one sequence counts one expert a layer, not two, so the dropped one is never read;
    the tokens are the fully resident model's at the same limit."""
    path = _fresh_copy(tiny_checkpoint("glm4_moe").path, tmp_path / "glm4_moe")

    def run(count, **budget):
        llm = LLM(path, kv_cache_bytes=1 << 20, **budget)
        set_experts_per_token(llm.model, count)
        cache, per_step = llm.engine.expert_cache, []
        if cache is not None:
            after_step = cache.after_step

            def recording(token_counts):
                per_step.append({int(layer.expert_counts.sum()) for layer in cache.layers})
                after_step(token_counts)

            cache.after_step = recording
        return _tokens(llm, PROMPTS[:1]), per_step

    got, per_step = run(1, expert_cache_gb=0)
    assert per_step[1:] == [{1}] * (GREEDY.max_tokens - 1)  # decode steps: 1 token, 1 expert
    assert run(None, expert_cache_gb=0)[1][1:] == [{2}] * (GREEDY.max_tokens - 1)
    assert run(1, expert_cache_fraction=1.0)[0] == got
