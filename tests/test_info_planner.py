"""`zcode info`'s fit planner against independent counts: parameters against transformers' own
model of the shipped configs, file bytes and ggml types against the GGUF files llama.cpp's
converter and quantizer really write, the decode prediction against the bytes of such a file."""

import json
import subprocess
import sys

import pytest
import torch
from gguf import GGUFReader
from test_cli import ENV

from scripts import make_glm_synthetic as script
from zcode.hardware.cost_model import GGUF_KINDS, CostModel
from zcode.info import FitOptions, model_info, shipped_configs
from zcode.info_fit import RAM_USABLE, plan_fit
from zcode.info_gguf import FILE_TYPES, file_tensors, gguf_tensor_types
from zcode.loader.checkpoint import build_model, read_config

# Rows of whole 256-blocks where K-quants matter most, narrower ones elsewhere: the Q4_K_M file
# mixes Q4_K, Q6_K and the fallbacks of rows that are not whole 256-blocks.
PLANNER_PARAMS = 8_000_000
KQUANT_DIMS = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256}
SHAPES = ("glm45-air", "glm5")


@pytest.fixture(scope="module", params=SHAPES)
def gguf_files(request, tmp_path_factory) -> dict:
    """A tiny synthetic checkpoint of each shape and its files of every type."""
    hf_dir = tmp_path_factory.mktemp(request.param) / "hf"
    script.make_checkpoint(request.param, PLANNER_PARAMS, hf_dir, 256, 0, KQUANT_DIMS)
    files = script.make_gguf_files(hf_dir, list(FILE_TYPES))
    net = build_model(read_config(hf_dir), device="meta")
    return {"hf": hf_dir, "net": net, **files}


def _file(path) -> dict[str, tuple[str, int]]:
    return {t.name: (t.tensor_type.name, int(t.n_bytes)) for t in GGUFReader(path).tensors}


@pytest.mark.parametrize("file_type", FILE_TYPES)
def test_tensor_types_and_bytes_match_the_llama_cpp_file(gguf_files, file_type):
    net = gguf_files["net"]
    tensors = file_tensors(net)
    types = gguf_tensor_types(tensors, file_type, net)
    planned = {t.name: (ty, t.nbytes(ty)) for t, ty in zip(tensors, types)}
    assert planned == _file(gguf_files[file_type])
    if file_type == "q4_k_m":  # the mix is exercised, fallbacks included
        assert {"Q4_K", "Q6_K"} <= set(types) and set(types) & {"Q5_0", "Q8_0"}, set(types)


@pytest.mark.parametrize("file_type", FILE_TYPES)
def test_the_cost_fits_gguf_linears_are_those_zcode_loads_from_the_file(gguf_files, file_type):
    """The cost fit times a llama.cpp file as blocks swapped into a model of float weights
    (gguf_file_linears): each linear's ggml type, layout (interleaved or not) and rows as ZCode
    loads them from the file llama.cpp's converter and quantizer wrote, a MoE layer's routed
    experts one stacked tensor per projection, as the file's are."""
    from zcode.hardware.cost_fit import gguf_file_linears
    from zcode.layers.moe import moe_layers
    from zcode.loader import load_model
    from zcode.quant.linear import QuantizedLinear
    from zcode.quant.variants import swap

    loaded, _ = load_model(gguf_files[file_type])
    fit_model, _ = load_model(gguf_files["hf"], torch.float32)
    fit = gguf_file_linears(fit_model, file_type)

    def layout(modules) -> dict:
        return {n: (m.format, m.packed.kernel_type, tuple(m.packed.data.shape)) for n, m in modules}

    linears = ((n, m) for n, m in loaded.named_modules() if isinstance(m, QuantizedLinear))
    assert layout(fit.items()) == layout(linears)
    swap(fit_model, fit)
    x = torch.zeros(1, loaded.config.hidden_size)
    for ours, theirs in zip(moe_layers(fit_model), moe_layers(loaded), strict=True):
        stacks = [lists[0].shape for lists in ours.gguf_weights(x)[:3]]
        assert stacks == [lists[0].shape for lists in theirs.gguf_weights(x)[:3]]
        assert all(len(shape) == 3 for shape in stacks)


def test_offload_arithmetic_against_the_file(gguf_files):
    """Roofline prediction (no cost model) and offload at a RAM size that holds the dense part
    and the KV cache but not the experts, against sums over the Q4_0 file's own tensors."""
    net, path = gguf_files["net"], gguf_files["q4_0"]
    config = net.config
    tensors = GGUFReader(path).tensors
    weight_bytes = sum(int(t.n_bytes) for t in tensors)
    expert_bytes = sum(int(t.n_bytes) for t in tensors if "_exps." in t.name)
    share = config.num_experts_per_tok / config.n_routed_experts
    embedding = next(t for t in tensors if t.name == "token_embd.weight")
    read = (
        sum(
            int(t.n_bytes) * (share if "_exps." in t.name else 1)
            for t in tensors
            if t.name != "token_embd.weight"
        )
        + int(embedding.n_bytes) / config.vocab_size
    )
    context, bandwidth_gbps, disk_gbps = 64, 10.0, 0.5
    kv = (
        context
        * 4
        * sum(
            torch.Size(s).numel() for a in net.attention_layers() for s in a.cache_spec().values()
        )
    )
    dense = weight_bytes - expert_bytes
    ram = int((dense + kv + expert_bytes // 4) / RAM_USABLE) + 1  # room for ~a quarter
    fit = plan_fit(
        net, ram, context_len=context, disk_gbps=disk_gbps, read_bandwidth_gbps=bandwidth_gbps
    )
    row = next(r for r in fit.formats if r.file_type == "q4_0")
    assert (row.weight_bytes, row.expert_bytes, row.kv_bytes) == (weight_bytes, expert_bytes, kv)
    assert row.read_bytes_per_token == round(read)
    assert row.fits is False and row.offload_fits is True
    cache = int(ram * RAM_USABLE) - dense - kv
    assert row.expert_cache_bytes == cache
    assert row.hit_rate == pytest.approx(cache / expert_bytes)
    disk = (1 - cache / expert_bytes) * expert_bytes * share
    assert row.disk_bytes_per_token == round(disk)
    decode_s = (read + kv) / (bandwidth_gbps * 1e9)
    assert row.decode_tok_s == pytest.approx(1 / decode_s)
    assert row.offload_tok_s == pytest.approx(1 / (decode_s + disk / (disk_gbps * 1e9)))
    given = plan_fit(net, ram, context_len=context, hit_rate=0.5, read_bandwidth_gbps=10.0)
    assert next(r for r in given.formats if r.file_type == "q4_0").disk_bytes_per_token == round(
        0.5 * expert_bytes * share
    )


def test_cost_model_prediction_reads_the_linears_of_the_file(gguf_files):
    """A cost model charging c ms per MB of every kind, nothing else: its predicted decode time
    is c times the linear weights a token reads, summed here over the file's tensors (routed
    experts at top_k / E; the embedding and router are not linears)."""
    net, path = gguf_files["net"], gguf_files["q4_k_m"]
    c = 0.01
    kinds = (*GGUF_KINDS, "dense-float32")
    decode = {"step": 0.0, "seqs": 0.0, "kv:MB": 0.0, "attn:GFLOP": 0.0}
    decode |= {"moe-fused:layers": 0.0}
    decode |= {f"{k}:MB": c for k in kinds} | {f"{k}:calls": 0.0 for k in kinds}
    cost = CostModel(decode, {}, "test")
    share = net.config.num_experts_per_tok / net.config.n_routed_experts
    linear_mb = 0.0
    for t in GGUFReader(path).tensors:
        if len(t.shape) < 2 or t.name == "token_embd.weight" or "ffn_gate_inp" in t.name:
            continue
        num_bytes = int(t.n_bytes)
        if "attn_k_b" in t.name or "attn_v_b" in t.name:  # ZCode runs kv_b_proj in fp32
            num_bytes = 4 * int(t.n_elements)
        if "indexer.proj" in t.name:  # and the indexer's weights_proj
            num_bytes = 4 * int(t.n_elements)
        linear_mb += num_bytes * (share if "_exps." in t.name else 1) / 1e6
    fit = model_info(gguf_files["hf"], FitOptions(context_len=16, cost=cost)).fit
    row = next(r for r in fit.formats if r.file_type == "q4_k_m")
    assert fit.predictor == "cost model"
    assert row.decode_tok_s == pytest.approx(1e3 / (c * linear_mb))


@pytest.fixture(scope="module")
def published() -> dict:
    """model_info of each shipped config with a roofline fit plan (GLM-5's meta model takes
    ~a minute to build: once)."""
    fit = FitOptions(context_len=8192, read_bandwidth_gbps=40.0)
    return {name: model_info(name, fit) for name in shipped_configs()}


def test_shipped_configs_count_like_transformers(published):
    from transformers import AutoConfig, AutoModelForCausalLM

    assert list(published) == ["glm-4.5-air", "glm-5"]
    for name, info in published.items():
        config = AutoConfig.from_pretrained(info.path.removesuffix("config.json"))
        with torch.device("meta"):
            oracle = AutoModelForCausalLM.from_config(config)
        assert info.num_params == sum(p.numel() for p in oracle.parameters()), name
    air, glm5 = published["glm-4.5-air"], published["glm-5"]
    assert 105e9 < air.num_params < 108e9  # published as 106B total, 12B active (which counts
    active_body = air.num_active_params - 2 * air.vocab_size * air.hidden_size  # no embedding)
    assert 11.5e9 < active_body < 12.5e9
    assert 740e9 < glm5.num_params < 760e9 and glm5.num_experts == 256


def test_info_plans_the_published_glm_configs(published):
    for info in published.values():
        rows = {r.file_type: r for r in info.fit.formats}
        assert list(rows) == list(FILE_TYPES)
        # bytes per weight: bf16 2, Q8_0 34/32, Q4_0 18/32 (+ the Q6_K output): in that order
        per_param = {t: r.weight_bytes / info.num_params for t, r in rows.items()}
        assert per_param["bf16"] == pytest.approx(2, rel=0.01)
        assert per_param["q8_0"] == pytest.approx(34 / 32, rel=0.01)
        assert 18 / 32 < per_param["q4_0"] < per_param["q4_k_m"] < 0.7  # Q5_0, Q6_K, Q8_0 mixed in
        for r in rows.values():  # a token reads the active parameters' share
            active = info.num_active_params / info.num_params
            assert r.read_bytes_per_token < 1.1 * active * r.weight_bytes
            assert r.decode_tok_s == pytest.approx(40e9 / (r.read_bytes_per_token + r.kv_bytes))


@pytest.mark.slow  # the hardware probe runs in the empty cache: ~25 s (in .ci/run)
def test_cli_prints_the_fit_plan(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "zcode.cli", "info", "glm-4.5-air", "--json", "--context", "1024"],
        capture_output=True, text=True, env={**ENV, "ZCODE_CACHE_DIR": str(tmp_path)}, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    fit = json.loads(result.stdout)["fit"]
    assert fit["context_len"] == 1024 and fit["predictor"] == "bandwidth roofline"
    assert [r["file_type"] for r in fit["formats"]] == list(FILE_TYPES)
    bad = subprocess.run(
        [sys.executable, "-m", "zcode.cli", "info", "glm-5", "--hit-rate", "1.5"],
        capture_output=True, text=True, env=ENV, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("zcode: error: ") and "1.5" in bad.stderr
