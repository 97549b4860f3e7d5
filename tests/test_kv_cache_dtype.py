"""EngineConfig.kv_cache_dtype: an fp32 model's KV cache held in bf16 or fp16.

transformers (fp32 throughout) is the oracle. The narrower cache rounds each key and value once,
to 8 (bf16) or 11 (fp16) significant bits: relative errors up to 2^-9 and 2^-12 in the scores
and attention outputs, which reach the tiny models' logits (max |logit| ~0.6) as absolute
differences of ~1e-3 (bf16, at most 3.0e-3 measured) and ~1e-4 (fp16, at most 3.6e-4): KV_TOL is
about three times the largest. That the cache is narrow is checked on its tensors.
"""

import pytest
import torch
from paged_runner import PagedRunner
from test_parity import PREFILL_LEN, TIE_GAP, oracle_logits, prompt_ids

from zcode import cli
from zcode.errors import ValidationError
from zcode.llm import LLM
from zcode.loader import load_model
from zcode.sampling_params import SamplingParams

NAMES = ["llama", "glm4", "glm4_moe", "gemma3_text", "glm_moe_dsa"]  # GQA, MLA + DSA
KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
KV_TOL = {torch.bfloat16: 1e-2, torch.float16: 1.2e-3}


def _cache_dtypes(net) -> set[torch.dtype]:
    return {t.dtype for layer in net.attention_layers() for t in layer.cache.values()}


@pytest.mark.parametrize("kv_dtype", KV_DTYPES.values(), ids=KV_DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers_within_the_cache_rounding(name, kv_dtype, tiny_checkpoint):
    ckpt = tiny_checkpoint(name)
    ids = prompt_ids()
    want, min_gap = oracle_logits(ckpt.oracle, ids)
    assert min_gap > TIE_GAP, f"{name}: prompt sits on a top-k tie (gap {min_gap:.2e})"
    net, _ = load_model(ckpt.path)
    runner = PagedRunner(net, kv_dtype=kv_dtype)
    assert _cache_dtypes(net) == {kv_dtype}
    got = runner.prefill_then_decode("seq", ids, PREFILL_LEN)  # prefill, then decode steps
    diff = (got - want).abs().max().item()
    print(f"{name} {kv_dtype}: max |logit diff| {diff:.3e} of up to {want.abs().max():.2f}")
    assert got.dtype == torch.float32
    assert diff <= KV_TOL[kv_dtype]


def test_the_engine_holds_twice_the_tokens_and_compiled_steps_equal_eager(tiny_checkpoint):
    """Half the bytes a token: twice the blocks in the same memory. The compiled decode step
    (the C++ kernel over an fp16 cache inside the graph) gives eager's tokens."""
    path = tiny_checkpoint("llama").path
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = prompt_ids()[:PREFILL_LEN]
    full = LLM(path, kv_cache_bytes=1 << 20)
    half = LLM(path, kv_cache_bytes=1 << 20, kv_cache_dtype="float16")
    assert _cache_dtypes(half.model) == {torch.float16}
    assert half.engine.runner.kv_cache.bytes_per_token * 2 == (
        full.engine.runner.kv_cache.bytes_per_token
    )
    assert half.engine.block_manager.num_blocks == 2 * full.engine.block_manager.num_blocks
    eager = half.generate([prompt], params)[0].token_ids
    compiled = LLM(path, kv_cache_bytes=1 << 20, kv_cache_dtype="float16", compile=True)
    assert compiled.generate([prompt], params)[0].token_ids == eager
    assert compiled.engine.runner.num_graph_compiles > 0


def test_head_pages_and_drafts_keep_the_block_caches_tokens(tiny_checkpoint):
    """KV pages per head (per-request depth) and n-gram drafts verified over an fp16 cache: the
    same rounding at the same places, so the block cache's greedy tokens."""
    path = tiny_checkpoint("llama").path
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = prompt_ids()[:12] * 3  # repeats, so the n-gram lookup drafts
    want = LLM(path, kv_cache_bytes=1 << 20, kv_cache_dtype="float16").generate([prompt], params)
    paged = LLM(path, kv_cache_bytes=1 << 20, kv_cache_dtype="float16", per_request_depth=True)
    assert paged.engine.runner.kv_cache.pages.dtype == torch.float16
    drafted = LLM(path, kv_cache_bytes=1 << 20, kv_cache_dtype="float16", speculative="ngram")
    for llm in (paged, drafted):
        assert llm.generate([prompt], params)[0].token_ids == want[0].token_ids
    assert drafted.engine.spec_totals["num_draft_tokens"] > 0


def test_the_planner_and_cost_model_count_the_narrow_cache(tiny_checkpoint):
    from zcode.engine.kv_cache import cache_dtype
    from zcode.harness.planner import kv_bytes_per_head

    path = tiny_checkpoint("llama").path
    full = LLM(path, kv_cache_bytes=1 << 20)
    half = LLM(path, kv_cache_bytes=1 << 20, kv_cache_dtype="bfloat16")
    assert cache_dtype(half.model) == torch.bfloat16
    assert [2 * b for b, _ in kv_bytes_per_head(half.model)] == [
        b for b, _ in kv_bytes_per_head(full.model)
    ]


def test_a_cache_wider_than_the_activations_or_an_unknown_dtype_is_refused(tiny_checkpoint):
    # ValidationError: the CLI and the server print it as a bad option, without a traceback
    with pytest.raises(ValidationError, match="only an fp32 model's KV cache"):
        LLM(tiny_checkpoint("llama").path, dtype="bfloat16", kv_cache_dtype="float16")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(tiny_checkpoint("llama").path, kv_cache_dtype="int8")


class _Loaded(Exception):
    pass


def test_the_cli_passes_the_option(monkeypatch, tmp_path):
    seen = []
    text = tmp_path / "text.txt"
    text.write_text("some text to score")

    def load_llm(*args, **engine_args):
        seen.append(engine_args.get("kv_cache_dtype"))
        raise _Loaded

    monkeypatch.setattr(cli.options, "load_llm", load_llm)
    for command in (["generate", "hi"], ["chat"], ["ppl", str(text)]):
        with pytest.raises(_Loaded):
            cli.main([*command, "--kv-cache-dtype", "float16"])
    with pytest.raises(_Loaded):
        cli.main(["generate", "hi"])
    assert seen == ["float16"] * 3 + [None]
