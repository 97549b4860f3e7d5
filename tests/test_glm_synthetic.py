"""scripts/make_glm_synthetic.py: GLM-4.5-Air- and GLM-5-shaped random checkpoints at a size.

transformers is the oracle: the directory the script writes loads there with no missing or
unexpected tensor and gives ZCode's logits; the parameter count is read back from the
safetensors files themselves.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from paged_runner import PagedRunner
from safetensors import safe_open
from test_parity import TIE_GAP, oracle_logits

from scripts import make_glm_synthetic as script
from zcode.loader import load_model

ROOT = Path(__file__).resolve().parents[1]
TINY_PARAMS = 3_000_000  # a few MB of bf16
TINY_VOCAB = 256
PREFILL_LEN, DECODE_STEPS = 24, 8
LOGIT_TOL = 1e-4  # relative to the largest logit
# index_topk below the test sequences, so that the DSA indexer really drops keys; 16 indexer
# heads, so that its ReLU'd scores are not exactly tied (tests/tiny_models.py)
OVERRIDES = {"glm45-air": {}, "glm5": {"index_topk": 8, "index_n_heads": 16}}


@pytest.fixture(scope="module", params=sorted(OVERRIDES))
def synthetic(request, tmp_path_factory) -> tuple[str, Path, dict]:
    shape = request.param
    out = tmp_path_factory.mktemp(shape) / "hf"
    facts = script.make_checkpoint(shape, TINY_PARAMS, out, TINY_VOCAB, 0, OVERRIDES[shape])
    return shape, out, facts


def _file_params(out: Path) -> int:
    total = 0
    for path in out.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total


def test_parameter_count_lands_near_the_target(synthetic):
    shape, out, facts = synthetic
    num_params = _file_params(out)
    assert num_params == facts["params"]
    assert abs(num_params - TINY_PARAMS) / TINY_PARAMS < 0.03, num_params
    config = json.loads((out / "config.json").read_text())
    published = script.published_config(shape)
    for key in ("num_experts_per_tok", "n_shared_experts", "model_type"):
        assert config[key] == published[key]
    assert config["n_routed_experts"] >= 2 * config["num_experts_per_tok"]
    assert config["hidden_size"] < published["hidden_size"]


@pytest.mark.parametrize("shape", ["glm45-air", "glm5"])
def test_scale_fit_lands_within_one_percent_at_12b(shape):
    """Config arithmetic only (transformers' meta model counts): the 12B shapes the issue asks."""
    fields, count = script.fit_config(shape, 12_000_000_000, 49_216)
    assert abs(count - 12e9) / 12e9 < 0.01
    assert count == script.count_params(script.hf_config(fields))
    assert fields["num_hidden_layers"] < script.published_config(shape)["num_hidden_layers"]


def test_transformers_loads_every_tensor_and_matches_zcode(synthetic):
    from transformers import AutoModelForCausalLM

    shape, out, _ = synthetic
    oracle, loading = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not any(loading.values()), loading  # no missing, unexpected or mismatched tensor
    ids = torch.randint(3, TINY_VOCAB, (PREFILL_LEN + DECODE_STEPS,), generator=_seed()).tolist()
    want, min_gap = oracle_logits(oracle.eval(), ids)
    assert min_gap > TIE_GAP, f"{shape}: prompt sits on a top-k tie (gap {min_gap:.2e})"
    net, _ = load_model(out, torch.float32)
    got = PagedRunner(net).prefill_then_decode("seq", ids, PREFILL_LEN)
    diff = (got - want).abs().max().item()
    print(f"{shape}: max |logit diff| {diff:.3e} of logits up to {want.abs().max():.2f}")
    assert diff <= LOGIT_TOL * want.abs().max().item()


def _seed() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def test_weights_are_deterministic_per_name():
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    a = script.random_tensor(name, (32, 64), torch.bfloat16, 0, 64)
    assert torch.equal(a, script.random_tensor(name, (32, 64), torch.bfloat16, 0, 64))
    assert not torch.equal(a, script.random_tensor(name, (32, 64), torch.bfloat16, 1, 64))
    other = name.replace("experts.3", "experts.4")
    assert not torch.equal(a, script.random_tensor(other, (32, 64), torch.bfloat16, 0, 64))


def test_a_greedy_decode_spreads_over_the_experts(synthetic):
    """The initialisation's point: decode steps pick different experts, not one fixed set."""
    _, out, _ = synthetic
    config = json.loads((out / "config.json").read_text())
    routing = script.experts_touched(out, num_tokens=16)
    assert routing["decode_tokens"] == 16
    top_k, num_experts = config["num_experts_per_tok"], config["n_routed_experts"]
    assert routing["experts"] == num_experts
    per_layer = routing["distinct_experts_per_layer"]
    assert len(per_layer) == config["num_hidden_layers"] - config["first_k_dense_replace"]
    # one fixed set of experts would touch exactly top_k
    assert all(top_k < n <= num_experts for n in per_layer), per_layer
    assert routing["distinct_tokens"] > 1
