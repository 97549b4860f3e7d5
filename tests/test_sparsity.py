"""Sparsity modules against plain oracles: the masked dense SwiGLU for SparseMLP, a model with a
layer's output zeroed for skipping, o_proj columns zeroed for head pruning."""

import math

import pytest
import torch
import torch.nn.functional as F

from zcode.layers.mlp import GatedMLP
from zcode.sparsity import kernel
from zcode.sparsity.sparse_mlp import SparseMLP, tokens_at_levels
from zcode.sparsity.thresholds import channel_scales

KERNEL_MISSING = "the sparse C++ kernel does not build here (gcc is part of the set-up)"


def _mlp(seed: int = 0, hidden: int = 48, inter: int = 96) -> GatedMLP:
    torch.manual_seed(seed)
    mlp = GatedMLP(hidden, inter)
    for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        lin.weight.data.normal_(0, 0.2)
    return mlp.requires_grad_(False)


def _oracle(mlp: GatedMLP, x, t_in, t_mid, score="teal"):
    """The masked dense formula, from the GatedMLP's own weights."""
    s_in, s_mid = channel_scales(mlp, score)
    a = x * (x.abs() * s_in > t_in)
    h = F.silu(F.linear(a, mlp.gate_proj.weight)) * F.linear(a, mlp.up_proj.weight)
    return F.linear(h * (h.abs() * s_mid > t_mid), mlp.down_proj.weight)


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 4, 16, 64])
@pytest.mark.parametrize("score", ["teal", "wina"])
def test_sparse_mlp_matches_masked_dense(use_kernel, num_tokens, score):
    assert kernel.available() or not use_kernel, KERNEL_MISSING
    mlp = _mlp()
    x = torch.randn(num_tokens, 48)
    scale_in, scale_mid = channel_scales(mlp, score)
    t_in = float((x.abs() * scale_in).quantile(0.5))
    t_mid = 0.05 * float(scale_mid.mean())
    sparse = SparseMLP(mlp, t_in, t_mid, score, use_kernel=use_kernel)
    torch.testing.assert_close(sparse(x), _oracle(mlp, x, t_in, t_mid, score))


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("dense_fraction", [1.0, 0.5])
def test_each_token_at_its_own_level_is_that_level_alone(use_kernel, dense_fraction):
    """Tokens at three levels (dense among them) in one call: each row is the masked dense
    formula at its own thresholds."""
    assert kernel.available() or not use_kernel, KERNEL_MISSING
    mlp = _mlp(4)
    x = torch.randn(6, 48)
    scale_in, scale_mid = channel_scales(mlp, "teal")
    levels = [(-1.0, -1.0), (float((x.abs() * scale_in).quantile(0.4)), 0.02), (1.0, 0.05)]
    per_token = torch.tensor([levels[i % 3] for i in range(6)])  # [T, 2]
    sparse = SparseMLP(mlp, 0.3, 0.1, use_kernel=use_kernel, dense_fraction=dense_fraction)
    with tokens_at_levels([sparse], per_token[None]):
        got = sparse(x)
    for t, (t_in, t_mid) in enumerate(per_token.tolist()):
        torch.testing.assert_close(got[t], _oracle(mlp, x[t : t + 1], t_in, t_mid)[0])
    assert sparse.token_thresholds is None  # bound for the call only
    torch.testing.assert_close(sparse(x), _oracle(mlp, x, 0.3, 0.1))


def _int8_mlp(mlp: GatedMLP) -> GatedMLP:
    """The FFN with each weight replaced by its int8 format's dequantized weight (the oracle of
    a SparseMLP reading int8 rows)."""
    from zcode.quant.int8 import Int8Weight

    out = GatedMLP(mlp.gate_proj.in_features, mlp.gate_proj.out_features)
    for name in ("gate_proj", "up_proj", "down_proj"):
        weight = Int8Weight.quantize(getattr(mlp, name).weight).dequantize()
        getattr(out, name).weight.data.copy_(weight)
    return out.requires_grad_(False)


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 3, 8, 20])
def test_sparse_mlp_on_int8_rows_is_the_int8_ffn_masked(use_kernel, num_tokens):
    """int8 rows: the masked formula over the int8 format's own weights (codes x per-channel
    scales), at a sparse level and at the dense one, token by token and in the GEMM fallback;
    back on fp32 rows, the float FFN again."""
    assert kernel.available() or not use_kernel, KERNEL_MISSING
    mlp = _mlp(6, hidden=40, inter=300)  # 600 gate|up columns: several column slices
    x = torch.randn(num_tokens, 40)
    t_in = float(x.abs().quantile(0.4))
    sparse = SparseMLP(mlp, t_in, 0.05, dense_fraction=0.5, use_kernel=use_kernel)
    sparse.set_weight_format("int8")
    assert not sparse.compilable
    quantized = _int8_mlp(mlp)
    close = {"rtol": 1e-4, "atol": 1e-4}  # the scale multiplies the sum, not each product
    torch.testing.assert_close(sparse(x), _oracle(quantized, x, t_in, 0.05), **close)
    sparse.set_thresholds(-1.0, -1.0)
    torch.testing.assert_close(sparse(x), quantized(x), **close)
    assert not torch.allclose(sparse(x), mlp(x), atol=1e-4)  # int8 rows are not the fp32 ones
    sparse.set_weight_format("fp32")
    assert sparse.compilable
    torch.testing.assert_close(sparse(x), mlp(x))


def test_sparse_mlp_refuses_an_unknown_row_format():
    from zcode.errors import ValidationError

    with pytest.raises(ValidationError, match="fp32 or int8 rows"):
        SparseMLP(_mlp(), 0.1, 0.1).set_weight_format("int4")


@pytest.mark.parametrize("num_tokens", [3, 5])  # one token a pass; four at once, then one
def test_kernel_reads_int8_rows_of_kept_inputs_only(num_tokens):
    """int8 codes with column scales: rows no token keeps hold the largest code, so the output
    equals the kept rows' product only when those rows are never summed; each of 600 columns
    (several threads' slices) scaled by its own scale."""
    assert kernel.available(), KERNEL_MISSING
    torch.manual_seed(7)
    x = torch.randn(num_tokens, 64)
    codes = torch.randint(-127, 128, (64, 600), dtype=torch.int8)
    col_scale = torch.rand(600) + 0.01
    thresh = torch.tensor([1.5, 1.0, 2.0, 2.2, 1.8])[:num_tokens]
    masks = x.abs() > thresh[:, None]
    kept = masks.any(dim=0)
    poisoned = torch.where(kept[:, None], codes, torch.tensor(127, dtype=torch.int8))
    out = kernel.sparse_rows(x, torch.ones(64), thresh, poisoned, 1.0, col_scale)
    expected = ((x * masks).double() @ codes.double()) * col_scale.double()
    assert 0 < kept.float().mean() < 0.8
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)


def test_kernel_reads_the_union_of_the_tokens_own_rows():
    """Poisoned rows, as below, with a threshold per token: a row kept by any token is read,
    none other."""
    assert kernel.available(), KERNEL_MISSING
    torch.manual_seed(5)
    x = torch.randn(3, 64)
    w_t = torch.randn(64, 40)
    thresh = torch.tensor([2.0, 1.0, 1.5])
    masks = x.abs() > thresh[:, None]  # [T, K]
    kept = masks.any(dim=0)
    poisoned = torch.where(kept[:, None], w_t, float("nan"))
    out = kernel.sparse_rows(x, torch.ones(64), thresh, poisoned, 1.0)
    assert 0 < kept.float().mean() < 0.8
    torch.testing.assert_close(out, (x * masks) @ torch.where(kept[:, None], w_t, 0.0))


def test_dense_level_is_the_dense_mlp():
    mlp = _mlp(1)
    x = torch.randn(5, 48)
    torch.testing.assert_close(SparseMLP(mlp, -1, -1)(x), mlp(x))
    torch.testing.assert_close(SparseMLP(mlp, 0.3, 0.1).to_dense()(x), mlp(x))


def test_kernel_never_reads_skipped_rows():
    """Rows of dropped inputs are poisoned with NaN: had the kernel loaded them (even to
    multiply by zero), the output would be NaN."""
    assert kernel.available(), KERNEL_MISSING
    torch.manual_seed(2)
    x = torch.randn(3, 64)
    w_t = torch.randn(64, 40)
    ones = torch.ones(64)
    thresh = 0.8
    kept = (x.abs() > thresh).any(dim=0)
    poisoned = w_t.clone()
    poisoned[~kept] = float("nan")
    out = kernel.sparse_rows(x, ones, torch.full((3,), thresh), poisoned, 1.0)
    expected = (x * (x.abs() > thresh)) @ torch.where(kept[:, None], w_t, 0.0)
    assert kept.float().mean() < 0.8  # the test skips rows at all
    torch.testing.assert_close(out, expected)


def test_dense_fallback_past_the_union_density():
    assert kernel.available(), KERNEL_MISSING
    torch.manual_seed(3)
    x = torch.randn(32, 64)  # the union of 32 tokens' masks keeps nearly every row
    w_t = torch.randn(64, 40)
    ones = torch.ones(64)
    poisoned = w_t.clone()
    poisoned[(x.abs() <= 0.5).all(dim=0)] = float("nan")  # rows no token keeps, if any
    thresh = torch.full((32,), 0.5)
    sparse = kernel.sparse_rows(x, ones, thresh, w_t, 1.0)
    fallback = kernel.sparse_rows(x, ones, thresh, w_t, 0.5)
    torch.testing.assert_close(fallback, sparse)
    torch.testing.assert_close(fallback, (x * (x.abs() > 0.5)) @ w_t)


def _copy_oracle(ckpt):
    import copy

    return copy.deepcopy(ckpt.oracle).eval()


def test_skipped_layers_match_transformers_without_them(tiny_checkpoint):
    """Oracle: transformers' model with the layer removed from its ModuleList."""
    from paged_runner import PagedRunner
    from test_parity import PREFILL_LEN, oracle_logits, prompt_ids

    from zcode.engine.kv_cache import kv_bytes_per_token
    from zcode.loader import load_model
    from zcode.sparsity.layer_skip import skip_layers

    ckpt = tiny_checkpoint("llama")
    oracle = _copy_oracle(ckpt)
    skip = [1]
    oracle.model.layers = torch.nn.ModuleList(
        [layer for i, layer in enumerate(oracle.model.layers) if i not in skip]
    )
    oracle.config.num_hidden_layers = len(oracle.model.layers)
    ids = prompt_ids()
    want, _ = oracle_logits(oracle, ids)
    net, _ = load_model(ckpt.path)
    dense_kv = kv_bytes_per_token(net.attention_layers(), torch.float32)
    skip_layers(net, skip)
    got = PagedRunner(net).prefill_then_decode("seq", ids, PREFILL_LEN)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    num_layers = len(net.model.layers)
    kv = kv_bytes_per_token(net.attention_layers(), torch.float32)
    assert kv == dense_kv * (num_layers - len(skip)) // num_layers


def test_pruned_heads_match_transformers_with_their_outputs_zeroed(tiny_checkpoint):
    """Oracle: transformers' model with the o_proj columns of the dropped heads zeroed, which
    removes exactly their contribution."""
    from paged_runner import PagedRunner
    from test_parity import PREFILL_LEN, oracle_logits, prompt_ids

    from zcode.engine.kv_cache import kv_bytes_per_token
    from zcode.loader import load_model
    from zcode.sparsity.head_skip import prune_heads

    ckpt = tiny_checkpoint("llama")
    net, _ = load_model(ckpt.path)
    attn = net.model.layers[0].self_attn
    assert attn.num_kv_heads >= 2, "pruning a KV-head group needs a model with several"
    group = attn.num_heads // attn.num_kv_heads
    oracle = _copy_oracle(ckpt)
    width = group * attn.head_dim
    with torch.no_grad():
        oracle.model.layers[0].self_attn.o_proj.weight[:, 0:width] = 0
    ids = prompt_ids()
    want, _ = oracle_logits(oracle, ids)
    dense_kv = kv_bytes_per_token(net.attention_layers(), torch.float32)
    prune_heads(net, [(0, 0)])
    got = PagedRunner(net).prefill_then_decode("seq", ids, PREFILL_LEN)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    per_kv_head = 2 * attn.head_dim * 4  # K and V, fp32
    assert kv_bytes_per_token(net.attention_layers(), torch.float32) == dense_kv - per_kv_head


def test_group_ablation_scores_match_transformers_perplexities(tiny_checkpoint):
    """Oracle: transformers' perplexity of the same windows with the groups' o_proj columns
    zeroed (each alone, then the least important together), over its dense perplexity."""
    from zcode.llm import LLM
    from zcode.sparsity.head_skip import ablation_scores, joint_ablation_ratios, prune_order

    ckpt = tiny_checkpoint("llama")
    llm = LLM(ckpt.path, kv_cache_bytes=1 << 20)
    tokens = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    window = 16
    calls = []
    got = ablation_scores(llm, tokens, window, lambda: calls.append(1))

    oracle = _copy_oracle(ckpt)

    def oracle_ppl() -> float:
        nll, count = 0.0, 0
        for begin in range(0, len(tokens), window):
            ids = tokens[begin : begin + window]
            with torch.no_grad():
                logits = oracle(torch.tensor([ids]), use_cache=False).logits[0].double()
            logp = F.log_softmax(logits[:-1], -1)
            nll -= logp.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
            count += len(ids) - 1
        return math.exp(nll / count)

    dense = oracle_ppl()
    config = oracle.config
    head_dim = config.hidden_size // config.num_attention_heads
    width = config.num_attention_heads // config.num_key_value_heads * head_dim

    def oracle_ratio(groups) -> float:
        weights = [oracle.model.layers[i].self_attn.o_proj.weight for i, _ in groups]
        kept = [w.detach().clone() for w in weights]
        with torch.no_grad():
            for w, (_, g) in zip(weights, groups):
                w[:, g * width : (g + 1) * width] = 0
            ratio = oracle_ppl() / dense
            for w, k in zip(weights, kept):
                w.copy_(k)
        return ratio

    want = torch.zeros_like(got)
    for i in range(config.num_hidden_layers):
        for g in range(config.num_key_value_heads):
            want[i, g] = oracle_ratio([(i, g)])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert len(calls) == want.numel() and (want != 1).all()  # each group changed something
    # the model is left as it was
    assert ablation_scores(llm, tokens, window).equal(got)

    # the k least important groups removed together
    order = prune_order(got)
    counts = tuple(range(1, len(order) + 1))
    assert len(counts) >= 2
    joint = joint_ablation_ratios(llm, tokens, window, got, counts + (len(order) + 1,))
    assert list(joint) == list(counts)  # no count beyond the groups a model can lose
    for k in counts:
        assert joint[k] == pytest.approx(oracle_ratio(order[:k]), rel=1e-4)
    assert ablation_scores(llm, tokens, window).equal(got)


def test_artifact_round_trip_and_wrong_model(tmp_path, tiny_checkpoint):
    from zcode.errors import ValidationError
    from zcode.loader import load_model
    from zcode.sparsity.artifact import FFNLevel, SparsityArtifact, fingerprint
    from zcode.sparsity.thresholds import ThresholdTable

    net, _ = load_model(tiny_checkpoint("llama").path)
    num_layers = len(net.model.layers)
    table = ThresholdTable("teal", (0.0, 0.5), torch.rand(num_layers, 2), torch.rand(num_layers, 2))
    artifact = SparsityArtifact(
        fingerprint=fingerprint(net),
        table=table,
        levels=[FFNLevel(0.0, 0.0, 0.0, 1.0), FFNLevel(0.0, 0.5, 1 / 6, 1.02)],
        layer_scores=torch.rand(num_layers),
        head_scores=torch.rand(num_layers, 2),
        head_count_ratios={1: 1.01, 2: 1.1},
    )
    path = tmp_path / "a.pt"
    artifact.save(path)
    loaded = SparsityArtifact.load(path)
    assert loaded.levels == artifact.levels
    assert loaded.head_count_ratios == {1: 1.01, 2: 1.1}
    torch.testing.assert_close(loaded.table.thresh_mid, table.thresh_mid)
    loaded.check_model(net)
    assert loaded.best_level(1.01) == artifact.levels[0]
    with torch.no_grad():
        net.model.embed_tokens.weight[0] += 1
    with pytest.raises(ValidationError, match="another model"):
        loaded.check_model(net)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValidationError, match="not a sparsity artifact"):
        SparsityArtifact.load(tmp_path / "junk.pt")


def test_predicted_mlp_matches_dense_over_each_tokens_blocks():
    """Oracle: the dense SwiGLU with each token's unpredicted neurons zeroed before down_proj."""
    from zcode.sparsity.predictor import BLOCK, BlockPredictor, PredictedMLP, labels

    mlp = _mlp(4, hidden=48, inter=4 * BLOCK)
    torch.manual_seed(5)
    predictor = BlockPredictor(48, 4, rank=3)
    x = torch.randn(6, 48)
    got = PredictedMLP(mlp, predictor, keep=0.5)(x)
    chosen = labels(predictor(x), 0.5).repeat_interleave(BLOCK, dim=1)  # [T, I]
    h = F.silu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight)
    torch.testing.assert_close(got, F.linear(h * chosen, mlp.down_proj.weight))
    assert not chosen.all()


def test_predictor_learns_above_chance():
    """On an FFN whose neuron blocks are gated by one input direction each (a block fires when x
    points its way), the trained predictor's recall beats the chance level of its keep
    fraction."""
    from zcode.sparsity.predictor import recall_precision, train_predictors

    class Net(torch.nn.Module):
        def __init__(self, mlp):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
            self.model.layers[0].mlp = mlp

    mlp = _mlp(6, hidden=32, inter=8 * 64)
    torch.manual_seed(7)
    directions = torch.randn(8, 32)
    with torch.no_grad():
        mlp.gate_proj.weight.copy_(3 * directions.repeat_interleave(64, dim=0))
        mlp.gate_proj.weight.add_(0.05 * torch.randn(8 * 64, 32))
    net = Net(mlp)
    train = {0: torch.randn(512, 32)}
    held = {0: torch.randn(256, 32)}
    predictors = train_predictors(net, train, keep=0.25, rank=8, epochs=150, progress=False)
    metrics = recall_precision(net, predictors, held, keep=0.25)
    assert metrics["recall"] > 0.5  # chance: 0.25


def test_old_artifacts_with_a_latency_fit_still_load(tmp_path, tiny_checkpoint):
    """The artifact's own latency fit is gone (the cost model predicts latency): an artifact
    written with one loads, the field ignored."""
    from zcode.loader import load_model
    from zcode.sparsity.artifact import FFNLevel, SparsityArtifact, fingerprint
    from zcode.sparsity.thresholds import ThresholdTable

    net, _ = load_model(tiny_checkpoint("llama").path)
    n = len(net.model.layers)
    artifact = SparsityArtifact(
        fingerprint(net),
        ThresholdTable("teal", (0.0,), torch.zeros(n, 1), torch.zeros(n, 1)),
        [FFNLevel(0.0, 0.0, 0.0, 1.0)],
        torch.zeros(n),
        torch.zeros(n, 2),
    )
    artifact.save(tmp_path / "a.pt")
    blob = torch.load(tmp_path / "a.pt", weights_only=True)
    blob["latency"] = {"overhead_ms": 1.0, "ms_per_mb": 10.0, "sparse_ms_per_mb": 12.0}
    torch.save(blob, tmp_path / "old.pt")
    assert SparsityArtifact.load(tmp_path / "old.pt").levels == artifact.levels


def test_calibration_measures_removed_groups_on_text_that_did_not_rank_them(
    tiny_checkpoint, monkeypatch
):
    """Ranked and measured on one slice, the groups removed were those that happened to cost
    nothing there (SmolLM2-135M: four groups 0.999 on the ranking slice, +9.4% held-out): the
    joint ratios are measured on tokens the single ablations never scored."""
    import random

    from zcode.llm import LLM
    from zcode.sparsity import calibrate as calibration

    read = {}

    def spy(name, fn):
        def wrapped(llm, tokens, *args, **kwargs):
            read[name] = list(tokens)
            return fn(llm, tokens, *args, **kwargs)

        monkeypatch.setattr(calibration, name, wrapped)

    spy("ablation_scores", calibration.ablation_scores)
    spy("joint_ablation_ratios", calibration.joint_ablation_ratios)
    llm = LLM(tiny_checkpoint("llama").path, dtype="float32")
    rng = random.Random(1)
    tokens = [rng.randrange(3, 256) for _ in range(256 + 128)]
    artifact = calibration.calibrate(
        llm, num_tokens=256, num_eval_tokens=128, levels=((0.0, 0.0),), progress=False,
        tokens=tokens,
    )  # fmt: skip
    assert read["ablation_scores"] == tokens[256:]
    assert read["joint_ablation_ratios"] == tokens[:256]
    assert artifact.head_count_ratios  # measured


def test_calibrating_ffns_it_cannot_level_is_a_clear_error(tiny_checkpoint):
    """Gemma-3's FFN is GELU-gated (GeluGatedMLP; the sparse kernels assume SiLU): no
    thresholds to record, said so, before any pass over the text (GLM-4's fused FFN was a
    RuntimeError from torch.stack deep in the thresholds)."""
    from zcode.llm import LLM
    from zcode.sparsity import calibrate as calibration

    llm = LLM(tiny_checkpoint("gemma3_text").path, dtype="float32")
    with pytest.raises(NotImplementedError, match="FFN sparsity calibration of GeluGatedMLP"):
        calibration.calibrate(llm, num_tokens=256, num_eval_tokens=128, tokens=[3] * 384)


def test_glm4_ffn_levels_match_transformers_with_the_fused_ffn_inputs_masked(tiny_checkpoint):
    """GLM-4 stores gate and up as one [2I, D] weight; ZCode runs its row halves as a GatedMLP,
    so its FFNs take sparsity levels. Oracle: transformers' Glm4MLP (fused) with the inputs of
    gate_up_proj and down_proj masked at the same thresholds (t_mid at each layer's median |h|,
    so half the intermediate inputs drop)."""
    from paged_runner import PagedRunner
    from test_parity import PREFILL_LEN, oracle_logits, prompt_ids

    from zcode.loader import load_model
    from zcode.sparsity.thresholds import gated_mlps

    ckpt = tiny_checkpoint("glm4")
    oracle = _copy_oracle(ckpt)
    ids = prompt_ids()
    thresh_in, thresh_mid = 0.5, {}

    def median_h(i):
        def hook(_m, args):
            thresh_mid.setdefault(i, float(args[0].abs().median()))

        return hook

    def mask(threshold):
        return lambda _m, args: args[0] * (args[0].abs() > threshold)

    mlps = [layer.mlp for layer in oracle.model.layers]
    handles = [m.down_proj.register_forward_pre_hook(median_h(i)) for i, m in enumerate(mlps)]
    dense, _ = oracle_logits(oracle, ids)
    for h in handles:
        h.remove()
    for i, m in enumerate(mlps):
        m.gate_up_proj.register_forward_pre_hook(mask(thresh_in))
        m.down_proj.register_forward_pre_hook(mask(thresh_mid[i]))
    want, _ = oracle_logits(oracle, ids)
    assert (want - dense).abs().max() > 1e-2  # the masks change the outputs

    net, _ = load_model(ckpt.path)
    assert sorted(gated_mlps(net)) == list(range(len(mlps)))  # every FFN can be leveled
    for i, layer in enumerate(net.model.layers):
        layer.mlp = SparseMLP(layer.mlp, thresh_in, thresh_mid[i])
    got = PagedRunner(net).prefill_then_decode("seq", ids, PREFILL_LEN)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_calibration_windows_fit_a_short_context(tiny_checkpoint):
    """The tiny Llama holds 512 positions: calibration's 512-token windows, each run with one
    generated token, shrink to fit (they failed with the engine's context-length error)."""
    import random

    from zcode.llm import LLM
    from zcode.sparsity import calibrate as calibration

    llm = LLM(tiny_checkpoint("llama").path, dtype="float32")
    assert llm.engine.max_model_len == 512
    rng = random.Random(2)
    tokens = [rng.randrange(3, 256) for _ in range(1024 + 512)]
    artifact = calibration.calibrate(
        llm, num_tokens=1024, num_eval_tokens=512, levels=((0.0, 0.0),), progress=False,
        tokens=tokens, formats=("int8",),
    )  # fmt: skip
    assert artifact.levels and artifact.sensitivity["formats"] == ["int8"]
