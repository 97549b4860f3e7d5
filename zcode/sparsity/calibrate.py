"""`zcode calibrate`: one pass over calibration text records activation thresholds and layer
importance, then KV-group importance (by ablation: each group alone), every candidate FFN level
(on the float rows and on int8 rows) and, for a MoE model, every candidate count of routed
experts per token are scored on a separate calibration slice, and the least important groups
removed together on the recording slice (not the slice that ranked them); with an engine
keeping KV per head (per_request_depth), the routing predictor is fitted on the recording
slice's windows too (zcode.harness.router). Last, each unit outside the leveled FFNs (attention
projections, lm_head) is profiled in each weight format (zcode.quant.sensitivity), what
precision variants are built from. The result is one SparsityArtifact.
(Latency is the hardware cost model's: `zcode hw --fit-cost`.)

Held-out text is never touched here: quality claims are made on it by the bench.
"""

from collections.abc import Sequence

from tqdm import tqdm

from zcode.calibration import corpus_tokens
from zcode.harness.router import fit_router
from zcode.layers.moe import moe_layers, set_experts_per_token
from zcode.llm import LLM
from zcode.ppl import perplexity
from zcode.quant.sensitivity import DEFAULT_FORMATS, profile_sensitivity
from zcode.sampling_params import SamplingParams
from zcode.sparsity.apply import remove_sparsity, set_ffn_level, sparse_ffns
from zcode.sparsity.artifact import FFNLevel, SparsityArtifact, fingerprint
from zcode.sparsity.head_skip import (
    HEAD_COUNTS,
    ablation_scores,
    gqa_attentions,
    joint_ablation_ratios,
)
from zcode.sparsity.layer_skip import BlockInfluence
from zcode.sparsity.predictor import FFNInputRecorder, predictor_state, train_predictors
from zcode.sparsity.sparse_mlp import WEIGHT_FORMATS
from zcode.sparsity.thresholds import ActivationRecorder, gated_mlps

# (gate/up input sparsity, down input sparsity): down inputs tolerate more (see the bench).
CANDIDATE_LEVELS = (
    (0.0, 0.0),
    (0.0, 0.1),
    (0.0, 0.2),
    (0.0, 0.3),
    (0.0, 0.4),
    (0.0, 0.5),
    (0.1, 0.3),
    (0.2, 0.4),
    (0.3, 0.5),
    (0.4, 0.6),
    (0.5, 0.7),
    (0.6, 0.8),
)
WINDOW = 512
ROUTER_WINDOW = 128  # tokens of each window the router is fitted on (a prompt's length)
# The router has a weight per embedding dimension and depth: on SmolLM2-135M, fitted on ~500
# windows it beats the static plans at one skipped layer, on random draws of ~250 not always
# (bench/bench_router.py). The calibration split holds ~70K tokens.
ROUTER_TOKENS = 65536
PREDICTOR_KEEPS = (0.75, 0.5)  # fractions of FFN neuron blocks the trained predictors keep
PREDICTOR_RANK = 4  # 30 layers x (576 x 4 + 4 x 25) = 72,720 parameters for SmolLM2-135M
PROFILE_TOKENS = 512  # of the recording slice, one sequence (zcode profile's default)
EXPERT_SHARES = (0.75, 0.5, 0.25)  # of the router's top_k: the expert counts calibrated


def expert_counts(model) -> list[int]:
    """Routed experts per token to calibrate, fewest last: shares of the MoE layers' top_k (none
    for a dense model)."""
    top_ks = {moe.gate.top_k for moe in moe_layers(model)}
    if not top_ks:
        return []
    top_k = min(top_ks)
    return sorted({max(1, round(top_k * share)) for share in EXPERT_SHARES} - {top_k}, reverse=True)


def flops_skipped(sparsity_in: float, sparsity_mid: float) -> float:
    """Nominal fraction of SwiGLU FFN multiply-adds skipped: gate and up read the kept rows of
    their input, down the kept rows of its input; the three matrices are the same size."""
    return (2 * sparsity_in + sparsity_mid) / 3


def calibrate(
    llm: LLM,
    num_tokens: int = 4096,
    num_eval_tokens: int = 1024,
    levels: tuple[tuple[float, float], ...] = CANDIDATE_LEVELS,
    score: str = "teal",
    progress: bool = True,
    tokens: list[int] | None = None,
    formats: Sequence[str] = DEFAULT_FORMATS,
    router_tokens: int = ROUTER_TOKENS,
) -> SparsityArtifact:
    """`tokens`: the calibration token ids (default: the calibration split, tokenized);
    `formats`: the weight formats each unit outside the leveled FFNs is profiled in (what
    precision levels are built from; each costs a pass per unit); `router_tokens`: the first
    tokens the router is fitted on, in windows of ROUTER_WINDOW (an engine with
    per_request_depth only; each window costs a pass per skipped-layer set)."""
    if tokens is None:
        if llm.tokenizer is None:
            raise ValueError("calibration needs the model's tokenizer to read calibration text")
        count = max(num_tokens + num_eval_tokens, router_tokens)
        tokens = corpus_tokens(llm.tokenizer, "calibration", count)
    model = llm.model
    if not gated_mlps(model):
        kinds = sorted({type(layer.mlp).__name__ for layer in model.model.layers})
        raise NotImplementedError(
            f"FFN sparsity calibration of {', '.join(kinds)} FFNs (it levels SwiGLU FFNs with "
            "separate gate_proj and up_proj, GatedMLP)"
        )
    remove_sparsity(model)
    if len(tokens) < num_tokens + num_eval_tokens:
        raise ValueError(f"the calibration text has only {len(tokens)} tokens")
    if router_tokens < 2 * ROUTER_WINDOW:  # the router's features are standardized over windows
        raise ValueError(f"router_tokens must be at least {2 * ROUTER_WINDOW}, got {router_tokens}")
    record, evaluate = tokens[:num_tokens], tokens[num_tokens : num_tokens + num_eval_tokens]
    window_len = min(WINDOW, llm.engine.max_model_len - 1)  # a window and one generated token
    windows = [record[i : i + window_len] for i in range(0, len(record) - 1, window_len)]
    num_groups = sum(a.num_kv_heads for a in gqa_attentions(model).values())
    routes = llm.engine.runner.pages is not None  # skipped layers are per request there
    counts = expert_counts(model)
    bar = tqdm(
        total=len(windows)
        + num_groups
        + len(HEAD_COUNTS)
        + len(levels) * len(WEIGHT_FORMATS)
        + len(PREDICTOR_KEEPS)
        + len(counts)
        + routes,
        desc="calibrate",
        disable=not progress,
    )
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    with ActivationRecorder(model, score) as acts, BlockInfluence(model) as bi:
        with FFNInputRecorder(model) as ffn_inputs:
            for window in windows:
                llm.generate(window, params)
                bar.update()
    table = acts.table()
    inputs = ffn_inputs.stacked()
    head_scores = ablation_scores(llm, evaluate, window_len, bar.update)
    artifact = SparsityArtifact(
        fingerprint=fingerprint(model),
        table=table,
        levels=[],
        layer_scores=bi.scores(),
        head_scores=head_scores,
        # On the recording slice, not the one that ranked the groups: ranked and measured on
        # one slice, the groups picked were those that happened to cost nothing there
        # (SmolLM2-135M, 1024 tokens: the four least important together 0.999, held-out +9.4%).
        head_count_ratios=joint_ablation_ratios(
            llm, record, window_len, head_scores, on_count=bar.update
        ),
        notes={"calibration_tokens": num_tokens, "eval_tokens": num_eval_tokens},
    )
    artifact.predictor = {}
    for keep in PREDICTOR_KEEPS:  # on the dense FFNs, before any level swaps them
        predictors = train_predictors(model, inputs, keep, PREDICTOR_RANK, progress=False)
        artifact.predictor[str(keep)] = predictor_state(predictors, keep, PREDICTOR_RANK)
        bar.update()
    del inputs
    dense_ppl = None
    for s_in, s_mid in levels:
        ratios = {}
        for weights in WEIGHT_FORMATS:  # "fp32" (as loaded) first
            set_ffn_level(model, artifact, s_in, s_mid, weights)
            ppl = perplexity(llm, evaluate, window_len, window_len).perplexity
            dense_ppl = dense_ppl or ppl  # the first level is dense
            ratios[weights] = ppl / dense_ppl
            bar.update()
        level = FFNLevel(s_in, s_mid, flops_skipped(s_in, s_mid), ratios.pop("fp32"), ratios)
        artifact.levels.append(level)
    set_ffn_level(model, artifact, 0.0, 0.0)
    for count in counts:
        set_experts_per_token(model, count)
        ppl = perplexity(llm, evaluate, window_len, window_len).perplexity
        artifact.expert_count_ratios[count] = ppl / dense_ppl
        bar.update()
    set_experts_per_token(model, None)
    if routes:
        text = tokens[:router_tokens]
        prompts = [text[i : i + ROUTER_WINDOW] for i in range(0, len(text), ROUTER_WINDOW)]
        artifact.router = fit_router(llm, [p for p in prompts if len(p) > 1]).state()
        bar.update()
    bar.close()
    # With the FFNs as SparseMLPs (dense level) the profile's units are the other linears.
    sparse_ffns(model, artifact)
    artifact.sensitivity = profile_sensitivity(
        model, record[:PROFILE_TOKENS], formats, progress=progress
    )
    return artifact
