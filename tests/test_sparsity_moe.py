"""Adaptive expert count on the tiny GLM MoE checkpoints: off (mass 1.0) is transformers' MoE
exactly; on, it runs fewer experts and equals a per-token loop over the kept experts."""

import pytest
import torch

from zcode.layers.moe import MoE
from zcode.loader import load_model
from zcode.sparsity.expert_skip import AdaptiveMoE, keep_mass, set_expert_mass

MOE_NAMES = ["glm4_moe", "glm_moe_dsa"]


@pytest.mark.parametrize("name", MOE_NAMES)
def test_knob_off_matches_transformers(name, tiny_checkpoint):
    from paged_runner import PagedRunner
    from test_parity import LOGIT_TOL, PREFILL_LEN, oracle_logits, prompt_ids

    ckpt = tiny_checkpoint(name)
    ids = prompt_ids()
    want, _ = oracle_logits(ckpt.oracle, ids)
    net, _ = load_model(ckpt.path)
    assert set_expert_mass(net, 1.0)
    got = PagedRunner(net).prefill_then_decode("seq", ids, PREFILL_LEN)
    assert (got - want).abs().max().item() <= LOGIT_TOL


@pytest.mark.parametrize("name", MOE_NAMES)
def test_confident_tokens_run_fewer_experts(name, tiny_checkpoint):
    net, _ = load_model(tiny_checkpoint(name).path)
    moe = next(layer.mlp for layer in net.model.layers if isinstance(layer.mlp, MoE))
    top_k = moe.gate.top_k
    torch.manual_seed(0)
    x = torch.randn(24, moe.gate.weight.shape[1])
    adaptive = AdaptiveMoE(moe, mass=0.5)
    with torch.no_grad():
        got = adaptive(x)
        weights, ids = moe.gate(x)
        want = moe.shared_experts(x)
        for t in range(x.shape[0]):  # the oracle: each token's kept experts, one by one
            order = weights[t].argsort(descending=True).tolist()
            kept, mass = [], 0.0
            for j in order:
                if kept and mass >= 0.5 * weights[t].sum():
                    break
                kept.append(j)
                mass += weights[t, j]
            scale = weights[t].sum() / sum(weights[t, j] for j in kept)
            for j in kept:
                want[t] += scale * weights[t, j] * moe.experts[int(ids[t, j])](x[t : t + 1])[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert adaptive.experts_run < top_k * x.shape[0]


def test_keep_mass_rows():
    w = torch.tensor([[0.7, 0.2, 0.1], [0.25, 0.35, 0.4]])
    out = keep_mass(w, 0.6, 1)
    torch.testing.assert_close(
        out, torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.4667, 0.5333]]), atol=1e-4, rtol=0
    )
