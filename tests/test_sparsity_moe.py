"""Fewer routed experts per token on the tiny GLM MoE checkpoints (the plan's experts dimension):
k experts per token is transformers' model with num_experts_per_tok = k (its top_k as loaded:
transformers' model as saved); a share of routing weight equals a loop over each token's kept
experts; requests with different expert counts share each forward and each gets its own
tokens, compiled decode too; calibration measures each count's quality and the cost model and
planner price it."""

import dataclasses
import random

import pytest
import torch
from artifacts import synthetic_artifact
from cost_models import synthetic_cost_model
from paged_runner import PagedRunner
from test_parity import LOGIT_TOL, PREFILL_LEN, oracle_logits, prompt_ids
from transformers import AutoModelForCausalLM

from zcode.errors import ValidationError
from zcode.hardware.cost_model import step_features
from zcode.harness.plan import ExecutionPlan
from zcode.harness.planner import Hints
from zcode.layers.moe import MoE, limit_experts, moe_layers, set_experts_per_token
from zcode.llm import LLM
from zcode.loader import load_model
from zcode.sampling_params import SamplingParams
from zcode.sparsity.artifact import FFNLevel
from zcode.sparsity.calibrate import calibrate

MOE_NAMES = ["glm4_moe", "glm_moe_dsa"]
PROMPTS = [[5, 17, 200, 3, 99, 42, 7], [7, 130, 250, 11, 64], [8, 190, 33, 2, 9, 120], [77, 150]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
ONE_EXPERT_RATIO = 1.05  # the synthetic artifact's calibrated perplexity ratio at 1 expert


def _oracle_with_top_k(path, top_k: int):
    model = AutoModelForCausalLM.from_pretrained(
        path, num_experts_per_tok=top_k, attn_implementation="eager", dtype=torch.float32
    )
    return model.eval()


@pytest.mark.parametrize("name", MOE_NAMES)
@pytest.mark.parametrize("count", [1, 2])
def test_k_experts_per_token_is_transformers_with_top_k_k(name, count, tiny_checkpoint):
    """At 2 (the router's top_k) every expert runs through the limit (set on the layers as is,
    not normalized away); at 1, transformers loaded with num_experts_per_tok=1 is the oracle."""
    ckpt = tiny_checkpoint(name)
    ids = prompt_ids()
    want, _ = oracle_logits(_oracle_with_top_k(ckpt.path, count), ids)
    net, _ = load_model(ckpt.path)
    for moe in moe_layers(net):
        assert moe.gate.top_k == 2
        moe.experts_per_token = count
    got = PagedRunner(net).prefill_then_decode("seq", ids, PREFILL_LEN)
    assert (got - want).abs().max().item() <= LOGIT_TOL
    if count == 1:  # one expert is not the model as saved
        full, _ = oracle_logits(ckpt.oracle, ids)
        assert (got - full).abs().max().item() > 100 * LOGIT_TOL


@pytest.mark.parametrize("name", MOE_NAMES)
def test_a_share_of_routing_weight_runs_each_tokens_first_experts(name, tiny_checkpoint):
    """expert_mass 0.5 through the fused kernel against a loop over each token's kept experts."""
    net, _ = load_model(tiny_checkpoint(name).path)
    moe = next(layer.mlp for layer in net.model.layers if isinstance(layer.mlp, MoE))
    torch.manual_seed(0)
    x = torch.randn(24, moe.gate.weight.shape[1])
    with torch.no_grad():
        weights, ids = moe.gate(x)  # [T, top_k], in the router's order
        set_experts_per_token(net, None, mass=0.5)
        got = moe(x)
        want = moe.shared_experts(x)
        num_kept = 0
        for t in range(x.shape[0]):  # the oracle: each token's first experts up to the share
            kept, mass = [], 0.0
            for j in range(weights.shape[1]):
                if kept and mass >= 0.5 * weights[t].sum():
                    break
                kept.append(j)
                mass += weights[t, j]
            num_kept += len(kept)
            scale = weights[t].sum() / sum(weights[t, j] for j in kept)
            for j in kept:
                want[t] += scale * weights[t, j] * moe.experts[int(ids[t, j])](x[t : t + 1])[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert num_kept < weights.numel()  # some token ran fewer experts


def test_limit_experts_rows():
    w = torch.tensor([[0.7, 0.2, 0.1], [0.4, 0.35, 0.25], [0.5, 0.3, 0.2]])
    ids = torch.tensor([[3, 1, 0], [2, 0, 1], [1, 2, 3]])
    kept, kept_ids = limit_experts(w, ids, torch.tensor([3, 2, 1]))
    torch.testing.assert_close(
        kept,
        torch.tensor([[0.7, 0.2, 0.1], [0.5333, 0.4667, 0.0], [1.0, 0.0, 0.0]]),
        atol=1e-4,
        rtol=0,
    )
    assert kept_ids.tolist() == [[3, 1, 0], [2, 0, -1], [1, -1, -1]]
    kept, kept_ids = limit_experts(w, ids, mass=0.6, renormalize=False)
    torch.testing.assert_close(
        kept, torch.tensor([[0.7, 0.0, 0.0], [0.4, 0.35, 0.0], [0.5, 0.3, 0.0]]), atol=1e-6, rtol=0
    )
    assert kept_ids.tolist() == [[3, -1, -1], [2, 0, -1], [1, 2, -1]]


def _moe_llm(path, **engine_args) -> LLM:
    llm = LLM(path, dtype="float32", kv_cache_bytes=4 << 20, **engine_args)
    levels = [FFNLevel(0.0, 0.0, 0.0, 1.0)]
    llm.sparsity = synthetic_artifact(llm.model, levels, expert_count_ratios={1: ONE_EXPERT_RATIO})
    llm.cost_model = synthetic_cost_model(mb_ms=20.0)
    llm.declare_default_plan()
    return llm


@pytest.fixture(scope="module")
def moe_llm(tiny_checkpoint):
    return _moe_llm(tiny_checkpoint("glm4_moe").path)


def _plans(llm) -> tuple[ExecutionPlan, ExecutionPlan]:
    """(all experts, one expert per token): the planner's expert-count candidates."""
    plans = {
        dict(c.plan.extras).get("experts_per_token"): c.plan for c in llm.planner().candidates()
    }
    assert set(plans) == {None, "1"}
    return plans[None], plans["1"]


def _alone(llm, plans) -> list[list[int]]:
    return [llm.generate(p, GREEDY, plan=plan)[0].token_ids for p, plan in zip(PROMPTS, plans)]


def test_requests_with_different_expert_counts_share_each_forward(moe_llm, monkeypatch):
    full, one = _plans(moe_llm)
    plans = [full, one, one, full]
    alone = _alone(moe_llm, plans)
    rows_per_forward = []
    execute = moe_llm.engine.runner.execute

    def counting(scheduled, row_settings=None):
        rows_per_forward.append(len(scheduled))
        return execute(scheduled, row_settings)

    monkeypatch.setattr(moe_llm.engine.runner, "execute", counting)
    batched = moe_llm.generate(PROMPTS, GREEDY, plan=plans)
    assert [out.token_ids for out in batched] == alone
    assert rows_per_forward == [4] * GREEDY.max_tokens
    # the two counts compute differently on one prompt
    params = dataclasses.replace(GREEDY, max_tokens=1, logprobs=0)
    firsts = [
        out.logprobs[0] for out in moe_llm.generate([PROMPTS[0]] * 2, params, plan=[full, one])
    ]
    assert firsts[0] != firsts[1]


@pytest.mark.slow
def test_compiled_decode_follows_each_expert_count(tiny_checkpoint, moe_llm):
    """One plan at a time (compiled graphs, keyed by the plan), then both in one batch (eager,
    per token): the tokens of eager decoding."""
    full, one = _plans(moe_llm)
    plans = [full, one, one, full]
    want = [moe_llm.generate(p, GREEDY, plan=plan)[0].token_ids for p, plan in zip(PROMPTS, plans)]
    compiled = _moe_llm(tiny_checkpoint("glm4_moe").path, compile=True)
    alone = [
        compiled.generate(p, GREEDY, plan=plan)[0].token_ids for p, plan in zip(PROMPTS, plans)
    ]
    assert alone == want
    assert compiled.engine.runner.num_graph_compiles >= 2
    assert [out.token_ids for out in compiled.generate(PROMPTS, GREEDY, plan=plans)] == want


def test_the_planner_prices_and_chooses_fewer_experts(moe_llm):
    full, one = _plans(moe_llm)
    candidates = {c.plan.signature(): c for c in moe_llm.planner().candidates()}
    c_full, c_one = candidates[full.signature()], candidates[one.signature()]
    assert c_one.quality_loss_pct == pytest.approx(100 * (ONE_EXPERT_RATIO - 1))
    assert c_one.ms_per_token < c_full.ms_per_token
    # the cost model's routed-expert bytes: 1 of 8 experts a token instead of 2 of 8
    model = moe_llm.model
    routed_mb = (
        sum(
            p.numel() * p.element_size()
            for moe in moe_layers(model)
            for p in moe.experts.parameters()
        )
        / 1e6
    )
    mb = {
        plan.name: step_features(model, plan, num_tokens=1, context_len=16)["dense-float32:MB"]
        for plan in (full, one)
    }
    assert mb[full.name] - mb[one.name] == pytest.approx(routed_mb * (2 - 1) / 8)
    tight = (c_full.ms_per_token + c_one.ms_per_token) / 2
    choice = moe_llm.planner().choose(Hints(max_latency_ms=tight))
    assert choice.plan.signature() == one.signature() and choice.target_met
    assert moe_llm.planner().choose(Hints(quality="max")).plan.signature() == full.signature()


def test_plans_naming_expert_limits_are_checked(moe_llm, tiny_checkpoint):
    bad = ExecutionPlan(extras=(("experts_per_token", "0"),))
    with pytest.raises(ValidationError, match="experts_per_token must be >= 1"):
        moe_llm.executor().check(bad)
    dense = LLM(tiny_checkpoint("llama").path, dtype="float32", kv_cache_bytes=1 << 20)
    with pytest.raises(ValidationError, match="no MoE layers"):
        dense.executor().check(ExecutionPlan(extras=(("experts_per_token", "1"),)))


def test_calibration_measures_fewer_experts(tiny_checkpoint):
    """Calibration's ratio at 1 expert is the perplexity of transformers' model with top_k 1
    over that of the model as saved, on the calibration's evaluation slice."""
    path = tiny_checkpoint("glm4_moe").path
    llm = LLM(path, dtype="float32", kv_cache_bytes=4 << 20)
    rng = random.Random(0)
    tokens = [rng.randrange(3, 256) for _ in range(256 + 128)]
    artifact = calibrate(
        llm, num_tokens=256, num_eval_tokens=128, levels=((0.0, 0.0),), progress=False,
        tokens=tokens,
    )  # fmt: skip
    assert set(artifact.expert_count_ratios) == {1}
    assert all(moe.experts_per_token is None for moe in moe_layers(llm.model))  # reset

    def nll(model) -> float:
        ids = torch.tensor([tokens[256:]])
        with torch.no_grad():
            return model(ids, labels=ids).loss.item()

    want = torch.tensor(nll(_oracle_with_top_k(path, 1)) - nll(tiny_checkpoint("glm4_moe").oracle))
    assert artifact.expert_count_ratios[1] == pytest.approx(want.exp().item(), rel=1e-4)


def test_generate_with_an_explicit_expert_count(tiny_checkpoint):
    """No calibration: `experts_per_token` per prompt runs that count (transformers with
    num_experts_per_tok=1 is the oracle of the first prompt; the second runs all experts, in the
    same batch), its predicted quality loss unknown; bad counts fail clearly."""
    ckpt = tiny_checkpoint("glm4_moe")
    llm = LLM(ckpt.path, dtype="float32", kv_cache_bytes=4 << 20)
    outs = llm.generate(PROMPTS[:2], GREEDY, experts_per_token=[1, None])
    for prompt, oracle, out in zip(PROMPTS, (_oracle_with_top_k(ckpt.path, 1), ckpt.oracle), outs):
        ids = torch.tensor([prompt])
        want = oracle.generate(ids, max_new_tokens=GREEDY.max_tokens, do_sample=False)
        assert out.token_ids == want[0, len(prompt) :].tolist()
    assert outs[0].plan.plan == "1 experts/token" and outs[1].plan.plan == "as loaded"
    assert outs[0].plan.predicted_quality_loss_pct is None
    with pytest.raises(ValidationError, match="experts_per_token must be an int >= 1"):
        llm.generate(PROMPTS[0], GREEDY, experts_per_token=0)
    with pytest.raises(ValidationError, match="in the plan or as experts_per_token"):
        llm.generate(PROMPTS[0], GREEDY, experts_per_token=1, plan=ExecutionPlan())
    dense = LLM(tiny_checkpoint("llama").path, dtype="float32", kv_cache_bytes=1 << 20)
    with pytest.raises(ValidationError, match="no MoE layers"):
        dense.generate(PROMPTS[0], GREEDY, experts_per_token=1)


def test_the_server_takes_experts_per_token(tiny_checkpoint):
    """A MoE server without an artifact plans `experts_per_token` and reports the plan; the
    tokens are generate()'s at the same count; a dense model's server refuses the field."""
    import openai
    from remote_server import InThreadServer

    from zcode.server.app import build_app
    from zcode.server.launch import build_state

    path = tiny_checkpoint("glm4_moe").path
    want = LLM(path, kv_cache_bytes=4 << 20).generate(PROMPTS[0], GREEDY, experts_per_token=1)
    states = [build_state(str(p), "tiny", {}) for p in (path, tiny_checkpoint("llama").path)]
    servers = [InThreadServer(build_app(state)) for state in states]
    try:
        moe, dense = (
            openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0) for s in servers
        )
        request = dict(model="tiny", prompt=PROMPTS[0], max_tokens=GREEDY.max_tokens)
        request |= dict(temperature=0, logprobs=0, extra_body={"experts_per_token": 1})
        choice = moe.completions.create(**request).choices[0]
        assert [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens] == (
            want[0].token_ids
        )
        assert choice.model_extra["zcode_plan"]["plan"] == "1 experts/token"
        with pytest.raises(openai.BadRequestError, match="experts_per_token needs a MoE model"):
            dense.completions.create(**request)
    finally:
        for served in servers:
            served.stop()
