"""Tensor and expert parallelism over torch.distributed (gloo, 2 processes) against one process.

The oracle is the same engine in one process (itself held to transformers by test_parity.py):
under TP=2 the greedy tokens must be the same and every step's logits within the parity
tolerance, with the paged KV cache and prefix caching on (the second round of prompts reuses the
first round's full blocks). Ranks are spawned processes that join through torchrun's environment
variables, one thread each.
"""

import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from tiny_models import VOCAB

from zcode.distributed.group import TPGroup
from zcode.distributed.pipeline import model_stages, split_pipeline, stage_layers
from zcode.distributed.shard import (
    head_shards,
    row_parallel,
    shard_model,
    slice_rows,
    split_sizes,
    weight_bytes,
)
from zcode.errors import RankFailure
from zcode.llm import LLM
from zcode.loader import load_model
from zcode.quant.gguf import GgufWeight
from zcode.quant.linear import QuantizedLinear
from zcode.sampling_params import SamplingParams

LOGIT_TOL = 1e-4  # test_parity.py's
# GGUF as stored quantizes activations to int8 per block: an fp32 rounding difference in the
# all-reduced input can move a value across a rounding boundary, and 30 layers amplify it. Of max
# |logit|: two equally valid orders of the same sums in one process (ggml.cpp's row and interleaved
# kernels on SmolLM2 Q4_1) were 5.3% apart on "The capital of France is", each 3.8-4.8% from the
# model dequantized to fp32; a wrong split or a lost all-reduce moves logits by their own size.
INT8_LOGIT_REL_TOL = 0.08
RANK_TIMEOUT_S = 480  # a hang guard, not a speed bound: generous on a busy machine (< 600 s)
# SmolLM2 as stored where ggml.cpp does not build: the gguf package's dequantize, autotuned at
# the first step of each process, takes minutes.
SLOW_RANK_TIMEOUT_S = 900
FAKE_GROUP = TPGroup(rank=0, world_size=2, compute=None, control=None, join=None)
TP2 = {"tensor_parallel_size": 2}
PP2 = {"pipeline_parallel_size": 2}


# -- the split, without processes


def test_split_sizes_give_larger_pieces_first_in_whole_multiples():
    assert split_sizes(9, 2) == [5, 4]
    assert split_sizes(1536, 2, multiple=32) == [768, 768]
    assert split_sizes(96, 2, multiple=32) == [64, 32]
    with pytest.raises(NotImplementedError, match="multiples of 256"):
        split_sizes(384, 2, multiple=256)


def test_head_shards_split_whole_groups_or_replicate_kv_heads():
    # SmolLM2: 9 query heads in 3 groups -> two groups on rank 0, one on rank 1
    shards = head_shards(9, 3, 2)
    assert [(s.q_heads, s.kv_heads) for s in shards] == [
        (range(0, 6), range(0, 2)),
        (range(6, 9), range(2, 3)),
    ]
    # fewer KV heads than ranks: each KV head on world_size / num_kv_heads ranks
    shards = head_shards(8, 2, 4)
    assert [s.kv_heads for s in shards] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [s.q_heads for s in shards] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    for shard in shards:  # every query head reads the KV head of its own group
        assert all(h // 4 == shard.kv_heads.start for h in shard.q_heads)
    with pytest.raises(NotImplementedError, match="replicating KV heads"):
        head_shards(6, 2, 4)


@pytest.mark.parametrize("interleaved", [False, True], ids=["rows", "interleaved"])
def test_gguf_slices_are_the_dequantized_weights_slices(interleaved):
    """Slices of an interleaved weight are interleaved again where their rows fill groups of 16
    (a rank runs the kernels one process runs), else left in the file's order."""
    g = torch.Generator().manual_seed(0)
    packed = GgufWeight.random(GGMLQuantizationType.Q4_1, 64, 128, g)
    full = packed.dequantize()  # the gguf package's dequantize: [64, 128]
    if interleaved:
        packed = packed.interleaved_copy()
    linear = QuantizedLinear(packed, None, "gguf-q4_1")
    for rows in (torch.tensor([3, 4, 5, 40]), torch.arange(16, 48)):
        part = slice_rows(linear, rows).packed
        assert part.interleaved == (interleaved and len(rows) % 16 == 0)
        assert torch.equal(part.dequantize(), full[rows])
    cols = row_parallel(linear, 32, 96, FAKE_GROUP).linear.packed
    assert cols.interleaved == interleaved
    assert torch.equal(cols.dequantize(), full[:, 32:96])
    with pytest.raises(NotImplementedError, match="whole blocks of 32"):
        row_parallel(linear, 16, 64, FAKE_GROUP)


def _expert_bytes(model: torch.nn.Module) -> int:
    return sum(p.nbytes for name, p in model.named_parameters() if ".experts." in name)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_each_rank_holds_half_of_the_routed_experts(tiny_checkpoint, expert_parallel):
    """Routed expert parameter bytes per rank: half of one process's, whole experts (EP) or a
    slice of each (TP), and the two ranks' parts make up all of them."""
    path = tiny_checkpoint("glm4_moe").path
    total = _expert_bytes(load_model(path)[0])
    per_rank = []
    for rank in range(2):
        net, _ = load_model(path)
        shard_model(net, TPGroup(rank, 2, None, None, None), expert_parallel)
        moes = [layer.mlp.moe for layer in net.model.layers if hasattr(layer.mlp, "moe")]
        assert [len(moe.experts) for moe in moes] == [4 if expert_parallel else 8] * 2
        per_rank.append(_expert_bytes(net))
    assert per_rank == [total // 2, total // 2]


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_three_ranks_moe_parts_add_up_to_the_whole_layer(monkeypatch, expert_parallel):
    """Uneven splits without processes: 8 experts as 3 + 3 + 2 (EP) or each expert's 40
    features as 14 + 13 + 13 (TP); each rank's output before the all-reduce, summed, is the
    unsharded layer's."""
    import copy

    from test_moe_fused import HIDDEN, make_moe

    from zcode.distributed import layers
    from zcode.distributed.shard import shard_moe

    monkeypatch.setattr(layers, "all_reduce", lambda x, group: x)  # this rank's part
    whole = make_moe(top_k=3)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(4))
    parts = [
        shard_moe(copy.deepcopy(whole), TPGroup(rank, 3, None, None, None), expert_parallel)
        for rank in range(3)
    ]
    if expert_parallel:
        assert [(p.first_expert, len(p.moe.experts)) for p in parts] == [(0, 3), (3, 3), (6, 2)]
    else:
        assert [p.moe.experts[0].gate_proj.out_features for p in parts] == [14, 13, 13]
    with torch.inference_mode():
        torch.testing.assert_close(sum(p(x) for p in parts), whole(x), rtol=0, atol=1e-5)


def test_expert_parallel_needs_tensor_parallel_processes():
    from zcode.distributed.config import ParallelConfig
    from zcode.errors import ValidationError

    with pytest.raises(ValidationError, match="tensor_parallel_size to 2 or more"):
        ParallelConfig(expert_parallel=True)
    with pytest.raises(ValidationError, match="tensor_parallel_size to 2 or more"):
        LLM(None, expert_parallel=True)


def test_moe_traffic_matches_a_count_over_random_routings():
    """The all-to-all's expected bytes against routings drawn at random: per token, 2 D bytes
    for each other rank (not the token's own) holding one of its experts."""
    from zcode.distributed.traffic import moe_bytes_per_token

    hidden, experts, top_k, ranks = 64, 16, 3, 4
    expected = moe_bytes_per_token(hidden, experts, top_k, ranks, bytes_per_value=2)
    assert expected["all_reduce"] == 2 * 3 * hidden * 2
    g = torch.Generator().manual_seed(0)
    num_tokens, moved = 20000, 0
    for _ in range(num_tokens):
        holders = set((torch.randperm(experts, generator=g)[:top_k] // (experts // ranks)).tolist())
        owner = int(torch.randint(ranks, (1,), generator=g))
        moved += 2 * hidden * 2 * len(holders - {owner})
    assert moved / num_tokens == pytest.approx(expected["all_to_all"], rel=0.02)


def test_more_processes_than_the_launch_has_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    from zcode.errors import ValidationError

    with pytest.raises(ValidationError, match="torchrun --nproc-per-node 2"):
        LLM(None, tensor_parallel_size=2)


# -- two processes against one


def _prompts(seed: int) -> list[list[int]]:
    """Two prompts, then two sharing their first 35 tokens (two full KV blocks) with them."""
    g = torch.Generator().manual_seed(seed)
    first = [torch.randint(3, VOCAB, (40,), generator=g).tolist() for _ in range(2)]
    second = [p[:35] + torch.randint(3, VOCAB, (5,), generator=g).tolist() for p in first]
    return [first, second]


def _run(llm: LLM, rounds: list, max_tokens: int = 6) -> dict:
    """Greedy tokens, the logits of every step and the prefix-cache hits of `rounds`."""
    logits = []
    execute = llm.engine.runner.execute

    def recording(scheduled, row_settings=None):
        out = execute(scheduled, row_settings)
        logits.extend(x.clone() for x in out if x.numel())
        return out

    llm.engine.runner.execute = recording
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens = [[out.token_ids for out in llm.generate(prompts, params)] for prompts in rounds]
    return {
        "tokens": tokens,
        "logits": logits,
        "prefix_cache_hits": llm.engine.stats()["prefix_cache_hits"],
        "weight_bytes": weight_bytes(llm.model),
    }


def _reference_kernels() -> None:
    """GGUF linears on their reference kernel: the fast kernels autotune every new shape (minutes
    per process where ggml.cpp does not build), and the reference computes what they compute."""
    QuantizedLinear.fast_kernel = lambda self, rows: type(self.packed).linear_reference


def _rank_main(
    rank: int, port: int, model, dtype: str, rounds, max_tokens: int, out: str, die, parallel
):
    from zcode.distributed.config import ParallelConfig

    parallel = ParallelConfig(**parallel, collective_timeout_s=30)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(parallel.world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    _reference_kernels()
    if die and rank == 1:  # dies at its third broadcast: the KV block count, a step, then gone
        import torch.distributed as dist

        broadcast, calls = dist.broadcast_object_list, []

        def dying(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                os._exit(3)
            return broadcast(*args, **kwargs)

        dist.broadcast_object_list = dying
    llm = LLM(model, dtype=dtype, parallel=parallel, kv_cache_bytes=8 << 20)
    try:  # only rank 0 gets here: the follower exits in LLM() when rank 0 ends
        result = _run(llm, rounds, max_tokens)
    except RankFailure as e:
        result = {"error": str(e)}
    torch.save(result, out)


def _launch(
    tmp_path: Path,
    model,
    dtype: str,
    rounds,
    max_tokens: int = 6,
    die: bool = False,
    timeout_s: float = RANK_TIMEOUT_S,
    parallel: dict = TP2,
) -> dict:
    """`parallel`: ParallelConfig's fields; one process per rank."""
    from zcode.distributed.config import ParallelConfig

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "rank0.pt")
    context = multiprocessing.get_context("spawn")
    model = None if model is None else str(model)
    args = (port, model, dtype, rounds, max_tokens, out, die, parallel)
    world_size = ParallelConfig(**parallel).world_size
    ranks = [context.Process(target=_rank_main, args=(r, *args)) for r in range(world_size)]
    for p in ranks:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in ranks:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(ranks) if p.is_alive()]
    for p in ranks:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks {hung} still running after {timeout_s} s"
    result = torch.load(out)
    result["exitcodes"] = [p.exitcode for p in ranks]
    return result


def _one_process(model, dtype: str, rounds, max_tokens: int = 6) -> dict:
    fast_kernel = QuantizedLinear.fast_kernel
    _reference_kernels()
    try:
        return _run(LLM(model, dtype=dtype, kv_cache_bytes=8 << 20), rounds, max_tokens)
    finally:
        QuantizedLinear.fast_kernel = fast_kernel


def _assert_same(tp: dict, single: dict, tol: float) -> None:
    assert set(tp["exitcodes"]) == {0}
    assert tp["tokens"] == single["tokens"]
    assert tp["prefix_cache_hits"] == single["prefix_cache_hits"] > 0
    assert len(tp["logits"]) == len(single["logits"])
    diff = max((a - b).abs().max().item() for a, b in zip(tp["logits"], single["logits"]))
    assert diff <= tol, f"logits {diff:.2e} apart"
    # rank 0 keeps about half: its heads, half the FFN and half the vocabulary
    assert tp["weight_bytes"] < 0.75 * single["weight_bytes"]


# The default suite runs each model and each kind of split once; the other pairs are `slow` (in
# .ci/run): two ranks start in ~10 s each, and the default suite has a 15-minute budget.
SLOW = pytest.mark.slow


@pytest.mark.parametrize("name", ["llama", pytest.param("glm4", marks=SLOW)])
def test_tp2_matches_one_process_on_tiny_models(tiny_checkpoint, tmp_path, name):
    path = tiny_checkpoint(name).path
    rounds = _prompts(seed=1)
    _assert_same(_launch(tmp_path, path, "float32", rounds), _one_process(path, "float32", rounds),
                 LOGIT_TOL)  # fmt: skip


@pytest.fixture(scope="module")
def one_process_runs(tiny_checkpoint) -> dict:
    """One process's run per tiny model, shared by its TP and EP tests."""
    runs = {}

    def run(name: str) -> dict:
        if name not in runs:
            runs[name] = _one_process(tiny_checkpoint(name).path, "float32", _prompts(seed=3))
        return runs[name]

    return run


@pytest.mark.parametrize(
    "name, expert_parallel",
    [
        ("glm4_moe", True),
        ("glm_moe_dsa", False),
        pytest.param("glm4_moe", False, marks=SLOW),
        pytest.param("glm_moe_dsa", True, marks=SLOW),
    ],
    ids=["glm4_moe-ep2", "glm_moe_dsa-tp2", "glm4_moe-tp2", "glm_moe_dsa-ep2"],
)
def test_moe_models_match_one_process(tiny_checkpoint, one_process_runs, tmp_path, name,
                                      expert_parallel):  # fmt: skip
    """MoE experts sliced (TP) or whole, 4 of 8 per rank (EP); glm_moe_dsa's MLA split by
    heads with the latent cache and the DSA indexer replicated."""
    parallel = {**TP2, "expert_parallel": expert_parallel}
    tp = _launch(
        tmp_path, tiny_checkpoint(name).path, "float32", _prompts(seed=3), parallel=parallel
    )
    _assert_same(tp, one_process_runs(name), LOGIT_TOL)


def _smollm2_rounds() -> list[list[str]]:
    """Two prompts, then two sharing their first full KV blocks."""
    opening = "The history of the Roman Empire begins with the founding of the city of Rome and its"
    opening += (
        " early kings, who ruled it for more than two centuries until they were driven out by"
    )
    return [[opening + " Romulus", opening + " the"], [opening + " Remus", opening + " a"]]


@pytest.mark.slow
def test_tp2_matches_one_process_on_smollm2(tmp_path):
    """The real model dequantized to fp32: 9 query heads in 3 KV groups split 6 + 3, a tied
    vocab-parallel embedding and head; the second round reuses the first one's full blocks."""
    rounds = _smollm2_rounds()
    tp = _launch(tmp_path, None, "float32", rounds, timeout_s=SLOW_RANK_TIMEOUT_S)
    _assert_same(tp, _one_process(None, "float32", rounds), LOGIT_TOL)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [TP2, PP2], ids=["tp2", "pp2"])
def test_two_processes_match_one_process_on_smollm2_gguf_as_stored(tmp_path, parallel):
    """TP: Q4_1 blocks split by rows and, at whole blocks, by columns; PP: each rank's layers'
    blocks copied out of the file map. Activations are quantized to int8 per block, so the
    all-reduce's rounding differences move logits by int8 noise (a near-tie could flip a greedy
    token: one step, the prompts' next tokens)."""
    rounds = [["The capital of France is", "def fibonacci(n):"]]
    tp = _launch(tmp_path, None, "auto", rounds, max_tokens=1, timeout_s=SLOW_RANK_TIMEOUT_S,
                 parallel=parallel)  # fmt: skip
    single = _one_process(None, "auto", rounds, max_tokens=1)
    assert tp["exitcodes"] == [0, 0]
    assert tp["tokens"] == single["tokens"]
    for a, b in zip(tp["logits"], single["logits"]):
        rel = ((a - b).abs().max() / b.abs().max()).item()
        assert rel <= INT8_LOGIT_REL_TOL, f"logits {rel:.1%} of max |logit| apart"
    assert tp["weight_bytes"] < 0.75 * single["weight_bytes"]


@pytest.mark.parametrize("parallel", [TP2, pytest.param(PP2, marks=SLOW)], ids=["tp2", "pp2"])
def test_a_dead_rank_fails_rank_0_with_a_clear_error(tiny_checkpoint, tmp_path, parallel):
    path = tiny_checkpoint("llama").path
    result = _launch(tmp_path, path, "float32", _prompts(2), die=True, parallel=parallel)
    assert result["exitcodes"] == [0, 3]
    assert "rank 0 of 2: a collective failed" in result["error"]
    assert "relaunch torchrun" in result["error"]


@pytest.mark.slow
@pytest.mark.parametrize("option", ["--tensor-parallel-size", "--pipeline-parallel-size"])
def test_zcode_generate_under_torchrun_prints_what_one_process_prints(option):
    torchrun = Path(sys.executable).parent / "torchrun"
    command = ["-m", "zcode", "generate", "--dtype", "float32", "--max-tokens", "8"]
    command += ["--temperature", "0", "Paris is"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    single = subprocess.run(
        [sys.executable, *command], capture_output=True, text=True, env=env, timeout=600
    )
    tp = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", *command, option, "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=SLOW_RANK_TIMEOUT_S,
    )
    assert single.returncode == 0, single.stderr
    assert tp.returncode == 0, tp.stderr
    assert tp.stdout == single.stdout != ""


# -- pipeline parallelism


def test_stage_layers_are_contiguous_ranges_larger_first():
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(4, 3) == [range(0, 2), range(2, 3), range(3, 4)]
    # a boundary on a layer that cannot start a stage moves to the nearest one that can, the
    # later one on a tie
    assert stage_layers(4, 2, lambda layer: layer != 2) == [range(0, 3), range(3, 4)]
    assert stage_layers(6, 2, lambda layer: layer not in (2, 3)) == [range(0, 4), range(4, 6)]
    with pytest.raises(NotImplementedError, match="each rank needs at least one"):
        stage_layers(1, 2)
    with pytest.raises(NotImplementedError, match="can start stage 1"):
        stage_layers(3, 2, lambda layer: layer == 0)


def test_pipeline_parallel_config_and_launch_errors(monkeypatch):
    from zcode.distributed.config import ParallelConfig
    from zcode.errors import ValidationError

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert ParallelConfig(pipeline_parallel_size=2).world_size == 2
    with pytest.raises(NotImplementedError, match="tensor-parallel stages"):
        ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    with pytest.raises(ValidationError, match="pipeline_parallel_size 2 needs 2 processes"):
        LLM(None, pipeline_parallel_size=2)
    # a skip_layers draft would run fewer layers on rank 0 than on the ranks following it
    with pytest.raises(NotImplementedError, match="parallelism with speculative skip_layers"):
        LLM(None, pipeline_parallel_size=2, speculative="skip_layers")
    # the MTP layer and its caches are whole on rank 0
    with pytest.raises(NotImplementedError, match="parallelism with speculative mtp"):
        LLM(None, pipeline_parallel_size=2, speculative="mtp")


def _tensor_bytes(module: torch.nn.Module) -> int:
    return sum(t.nbytes for t in [*module.parameters(), *module.buffers()])


@pytest.mark.parametrize("name", ["llama", "glm4_moe", "glm_moe_dsa_shared"])
def test_each_stage_holds_only_its_layers_weights_and_kv_cache(tiny_checkpoint, name):
    """Without processes: rank r keeps the layers of its stage (rank 0 also the embedding, the
    last rank the lm_head; both the final norm and the rotary tables), and its KV cache, sized
    from the same bytes, holds those layers only."""
    from zcode.config import EngineConfig
    from zcode.engine.kv_cache import kv_bytes_per_token
    from zcode.engine.llm_engine import LLMEngine

    path = tiny_checkpoint(name).path
    config = EngineConfig(kv_cache_bytes=1 << 20)
    whole, tokenizer = load_model(path, torch.float32)
    replicated = _tensor_bytes(whole.model.norm) + _tensor_bytes(whole.model.rotary_emb)
    one_process = LLMEngine(whole, tokenizer, config).runner
    all_layers = whole.attention_layers()
    stages = model_stages(whole, 2)
    # IndexShare: the even boundary, layer 2, shares layer 1's selection: it moves to layer 3
    assert stages[0] == range(3 if name == "glm_moe_dsa_shared" else (len(all_layers) + 1) // 2)
    per_rank_bytes = []
    for rank, stage in enumerate(stages):
        net, _ = load_model(path, torch.float32)
        split_pipeline(net, TPGroup(rank, 2, None, None, None))
        runner = LLMEngine(net, tokenizer, config).runner
        per_rank_bytes.append(weight_bytes(net))
        own = [all_layers[i] for i in stage]
        assert [a.cache_spec() for a in net.attention_layers()] == [a.cache_spec() for a in own]
        assert all(a.cache for a in net.attention_layers())
        assert runner.kv_cache.bytes_per_token == kv_bytes_per_token(own, torch.float32)
        cache_bytes = sum(t.nbytes for a in net.attention_layers() for t in a.cache.values())
        assert cache_bytes <= config.kv_cache_bytes * 1.05  # the budget, plus the padding block
        assert runner.num_blocks > one_process.num_blocks  # fewer layers: more tokens per byte
    # resident storages: a rank that kept views of the checkpoint file would count all of it
    assert sum(per_rank_bytes) == _tensor_bytes(whole) + replicated
    if name == "llama":  # two equal layers, embedding and lm_head the same size: half each
        assert per_rank_bytes[0] == per_rank_bytes[1]


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("llama", marks=SLOW),
        pytest.param("glm4", marks=SLOW),
        "glm4_moe",
        "glm_moe_dsa",
        pytest.param("glm_moe_dsa_shared", marks=SLOW),
    ],
)
def test_pp2_matches_one_process(tiny_checkpoint, one_process_runs, tmp_path, name):
    """Rank 0 runs the embedding and the first layers, rank 1 the rest, the norm and lm_head;
    the hidden states go over to rank 1 and the sampled rows' logits come back. IndexShare
    (glm_moe_dsa_shared, layers full, full, shared, full) splits 3 + 1, off the shared layer."""
    path = tiny_checkpoint(name).path
    pp = _launch(tmp_path, path, "float32", _prompts(seed=3), parallel=PP2)
    _assert_same(pp, one_process_runs(name), LOGIT_TOL)


@pytest.mark.slow
def test_pp3_middle_stage_receives_and_sends(tiny_checkpoint, one_process_runs, tmp_path):
    """Three stages of one layer each: rank 1 both receives and sends the hidden states."""
    path = tiny_checkpoint("glm4_moe").path
    pp = _launch(
        tmp_path, path, "float32", _prompts(seed=3), parallel={"pipeline_parallel_size": 3}
    )
    _assert_same(pp, one_process_runs("glm4_moe"), LOGIT_TOL)


@pytest.mark.slow
def test_pp2_matches_one_process_on_smollm2(tmp_path):
    """30 layers as 15 + 15; the tied embedding is on both ends (rank 0 looks tokens up, rank 1
    computes the logits with it), so each rank holds 60% of the weights, not half. The second
    round reuses the first one's full blocks."""
    rounds = _smollm2_rounds()
    pp = _launch(tmp_path, None, "float32", rounds, timeout_s=SLOW_RANK_TIMEOUT_S, parallel=PP2)
    _assert_same(pp, _one_process(None, "float32", rounds), LOGIT_TOL)
