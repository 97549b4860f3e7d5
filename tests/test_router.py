"""The routing predictor (zcode/harness/router.py): the ridge fit recovers a known relation, it
round-trips through the calibration artifact, and an LLM loaded with an artifact holding a
router plans each prompt at the loss the router predicts for it: a prompt predicted to lose
little gets the cheaper skipped-layer plan, one predicted to lose much does not, and each runs
its own plan (the same tokens as alone)."""

import dataclasses
import math

import pytest
import torch
from artifacts import synthetic_artifact
from cost_models import synthetic_cost_model

from zcode.errors import ValidationError
from zcode.harness.planner import Hints
from zcode.harness.revision import REVISE_EVERY
from zcode.harness.router import Router, fit, fit_router, prompt_features, repeated_fractions
from zcode.llm import LLM
from zcode.sampling_params import SamplingParams
from zcode.sparsity.artifact import FFNLevel

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
ENGINE = dict(dtype="float32", per_request_depth=True, kv_cache_bytes=1 << 20)
# ms per MB of dense weights only: a plan skipping a layer is predicted faster


def _artifact_with(router: Router, path, out) -> str:
    """A calibration artifact of the tiny checkpoint at `path` holding `router`: the dense FFN
    level only, and KV groups whose skipping costs far more than any budget below."""
    model = LLM(path, dtype="float32").model
    n, kv_heads = len(model.model.layers), model.config.num_key_value_heads
    artifact = synthetic_artifact(
        model,
        [FFNLevel(0.0, 0.0, 0.0, 1.0)],
        head_scores=torch.full((n, kv_heads), 10.0),
        router=router.state(),
    )
    artifact.save(out)
    return str(out)


def test_fit_recovers_a_linear_relation_and_round_trips(tmp_path):
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(200, 5, generator=generator)
    true = torch.tensor([[0.0, 0.3], [0.0, -0.2], [0.0, 0.0], [0.0, 0.1], [0.0, 0.0]])
    losses = (features @ true + torch.tensor([0.0, 1.0])).clamp(min=0)  # [200, 2]
    router = fit(features, losses, [(), (1,)])
    assert (router.predict_features(features) - losses).abs().max() < 0.05
    assert router.num_parameters == 5 + 5 + 6 * 2
    torch.save(router.state(), tmp_path / "r.pt")  # as the calibration artifact stores it
    loaded = Router.from_state(torch.load(tmp_path / "r.pt", weights_only=True))
    assert loaded.depths == router.depths
    assert torch.equal(loaded.predict_features(features), router.predict_features(features))
    with pytest.raises(ValidationError, match="router is unreadable"):
        Router.from_state({"schema": 1})


def test_a_prompts_features_are_its_mean_embedding_repeats_and_log_length():
    assert repeated_fractions([1, 2, 1, 2, 1, 2]) == [4 / 6, 3 / 5, 2 / 4, 1 / 3]
    assert repeated_fractions([5, 6, 7, 8, 9]) == [0.0] * 4
    assert repeated_fractions([5, 5]) == [0.5, 0.0, 0.0, 0.0]  # no bigram repeats, none longer
    embed = torch.nn.Embedding(10, 3)
    got = prompt_features(embed, [[1, 2, 1, 2, 1, 2], [7]])  # [2, 3 + 4 + 1]
    assert got.shape == (2, 8)
    assert torch.allclose(got[0, :3], embed.weight[[1, 2]].mean(0))
    assert torch.allclose(got[1, :3], embed.weight[7])
    assert got[0, 3:7].tolist() == pytest.approx([4 / 6, 3 / 5, 2 / 4, 1 / 3])
    assert got[:, -1].tolist() == pytest.approx([math.log(6), 0.0])


def test_the_artifacts_router_routes_only_per_request_depth(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama").path
    llm = LLM(path, dtype="float32")
    windows = [[5, 17, 200, 3, 99, 42], [7, 130, 250, 11, 64, 9], [8, 190, 33, 2, 9, 120]]
    embed = llm.model.model.embed_tokens
    router = fit(prompt_features(embed, windows), torch.rand(3, 2), [(), (1,)])
    artifact = _artifact_with(router, path, tmp_path / "art.pt")
    assert LLM(path, sparsity=artifact, dtype="float32").router is None
    routed = LLM(path, sparsity=artifact, **ENGINE).router
    assert routed.depths == router.depths
    assert torch.equal(routed.weights, router.weights)


def test_each_prompt_gets_the_plan_its_predicted_loss_allows(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama").path
    llm = LLM(path, **ENGINE)
    generator = torch.Generator().manual_seed(1)
    windows = [torch.randint(3, 250, (12,), generator=generator).tolist() for _ in range(12)]
    fitted = fit_router(llm, windows, skip_counts=(0, 1), order_windows=4)
    assert fitted.depths[0] == () and len(fitted.depths[1]) == 1
    # A router whose prediction for skipping that layer is the prompt's first feature
    # (scaled): prompts far apart on it are predicted to lose very little and very much.
    embed = llm.model.model.embed_tokens
    first = prompt_features(embed, windows)[:, 0]
    low, high = windows[int(first.argmin())], windows[int(first.argmax())]
    num_features = fitted.feature_mean.numel()
    weights = torch.zeros(num_features + 1, 2)
    weights[0, 1] = 1.0
    weights[-1, 1] = 0.05  # the intercept: the mean loss
    ends = prompt_features(embed, [low, high])
    scale = torch.ones(num_features)
    scale[0] = (ends[1, 0] - ends[0, 0]) / 2 / 0.05  # low -> 0, high -> 0.1 nats/token
    router = dataclasses.replace(
        fitted,
        mean_log_loss=(0.0, 0.05),
        feature_mean=ends.mean(0),
        feature_scale=scale,
        weights=weights,
    )
    routed = LLM(path, **ENGINE, sparsity=_artifact_with(router, path, tmp_path / "art.pt"))
    routed.cost_model = synthetic_cost_model(mb_ms=10.0)
    predicted = [router.predict(embed, p)[1] for p in (low, high)]
    assert predicted[0] < 0.01 and predicted[1] > 0.09
    budget = 100 * (torch.tensor(predicted).mean().exp().item() - 1)  # between the two
    # Unrouted, at the depth's mean loss, the budget allows no skipping for either prompt.
    unrouted = routed.planner().choose(Hints(max_quality_loss=budget), 2, 32).plan
    assert unrouted.skip_layers == ()
    outs = routed.generate([low, high], GREEDY, max_quality_loss=budget)
    skipping = dataclasses.replace(unrouted, skip_layers=router.depths[1])
    assert [out.plan.signature for out in outs] == [skipping.signature(), unrouted.signature()]
    assert all(out.plan.target_met for out in outs)
    for prompt, plan, out in zip((low, high), (skipping, unrouted), outs):
        assert out.token_ids == routed.generate(prompt, GREEDY, plan=plan)[0].token_ids


def test_calibrate_fits_the_router_into_the_one_artifact(tiny_checkpoint, tmp_path):
    """zcode calibrate on an engine keeping KV per head: the artifact holds the router (the
    tiny model's 2 layers: skipping none or its least important one), and an LLM loading that
    artifact with per_request_depth routes by it."""
    from zcode.sparsity.calibrate import calibrate

    path = tiny_checkpoint("llama").path
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(3, 250, (384 + 128,), generator=generator).tolist()
    artifact = calibrate(
        LLM(path, **ENGINE),
        num_tokens=384,
        num_eval_tokens=128,
        levels=((0.0, 0.0), (0.0, 0.5)),
        progress=False,
        tokens=tokens,
    )
    router = Router.from_state(artifact.router)
    assert router.depths[0] == () and [len(d) for d in router.depths] == [0, 1]
    artifact.save(tmp_path / "art.pt")
    loaded = LLM(path, sparsity=tmp_path / "art.pt", **ENGINE)
    assert loaded.router.depths == router.depths
    assert [o.label for o in loaded.planner().depths if o.skip_layers] == ["skip 1 layers"]


def test_a_routed_request_moves_to_the_plan_its_text_so_far_needs(tiny_checkpoint, tmp_path):
    """A router whose predicted loss of skipping grows with the text's length: a short prompt
    starts on the skipping plan, and at the first checkpoint (REVISE_EVERY output tokens), its
    text now long, moves to the dense one; its first tokens are the skipping plan's, the rest
    what the dense plan continues that text with."""
    path = tiny_checkpoint("llama").path
    llm = LLM(path, **ENGINE)
    generator = torch.Generator().manual_seed(1)
    windows = [torch.randint(3, 250, (12,), generator=generator).tolist() for _ in range(12)]
    fitted = fit_router(llm, windows, skip_counts=(0, 1), order_windows=4)
    prompt = windows[0][:6]
    num_features = fitted.feature_mean.numel()
    weights = torch.zeros(num_features + 1, 2)
    weights[-2, 1] = 1.0  # the standardized log length
    mean, scale = torch.zeros(num_features), torch.ones(num_features)
    longer = len(prompt) + REVISE_EVERY
    mean[-1] = math.log(len(prompt))  # the prompt: 0 nats/token
    scale[-1] = (math.log(longer) - math.log(len(prompt))) / 0.1  # its text at the checkpoint: 0.1
    router = dataclasses.replace(
        fitted, mean_log_loss=(0.0, 0.05), feature_mean=mean, feature_scale=scale, weights=weights
    )
    routed = LLM(path, **ENGINE, sparsity=_artifact_with(router, path, tmp_path / "art.pt"))
    routed.cost_model = synthetic_cost_model(mb_ms=10.0)
    budget = 100 * (math.exp(0.04) - 1)  # below the mean loss of skipping
    params = dataclasses.replace(GREEDY, max_tokens=REVISE_EVERY + 8)
    (out,) = routed.generate(prompt, params, max_quality_loss=budget)
    hints, embed = Hints(max_quality_loss=budget), routed.model.model.embed_tokens
    dense = routed.planner().choose(hints, 1, 32).plan
    skipping = routed.planner().choose(hints, 1, 32, router.predict(embed, prompt)).plan
    assert skipping.skip_layers == router.depths[1] and dense.skip_layers == ()
    assert out.plan.signature == dense.signature()
    (move,) = out.plan.revisions
    assert move["at_token"] == REVISE_EVERY
    assert (move["from"], move["to"]) == (skipping.name, dense.name)
    first = routed.generate(
        prompt, dataclasses.replace(GREEDY, max_tokens=REVISE_EVERY), plan=skipping
    )
    assert out.token_ids[:REVISE_EVERY] == first[0].token_ids
    rest = routed.generate(
        prompt + first[0].token_ids, dataclasses.replace(GREEDY, max_tokens=8), plan=dense
    )
    assert out.token_ids[REVISE_EVERY:] == rest[0].token_ids


def test_calibrate_refuses_a_router_of_fewer_than_two_windows(tiny_checkpoint):
    from zcode.sparsity.calibrate import calibrate

    llm = LLM(tiny_checkpoint("llama").path, **ENGINE)
    with pytest.raises(ValueError, match="router_tokens must be at least 256, got 200"):
        calibrate(llm, 384, 128, progress=False, tokens=list(range(3, 515)), router_tokens=200)
