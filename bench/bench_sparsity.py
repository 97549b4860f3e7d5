"""Dynamic sparsity on SmolLM2-135M: quality on held-out text against decode speed, all plans
measured against the same engine dense in the same run.

    .venv/bin/python bench/bench_sparsity.py [--quick] [--threads N] [--artifact PATH]

Quality (held-out split, teacher-forced 512-token windows): perplexity, greedy-token agreement
with dense (argmax of the next-token distribution) and mean KL(dense || plan) per token, plus the
realized fraction of FFN multiply-adds skipped (masks recomputed in Python from the FFN inputs).
Speed: batch-1 decode ms/token, min and median over interleaved repeats; a batch 1/4/16 table of
the decode-step speed-up with the union density of the batch's masks; KV bytes per token of the
layer-skipping and head-pruning plans. The planner (max_latency_ms and other hints) is benched by
bench_plan.py.
Writes bench/results/sparsity.json and bench/results/sparsity_pareto.png.
"""

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from table_format import print_rows  # noqa: E402

from zcode import LLM  # noqa: E402
from zcode.calibration import corpus_tokens  # noqa: E402
from zcode.engine.kv_cache import kv_bytes_per_token  # noqa: E402
from zcode.engine.llm_engine import LLMEngine  # noqa: E402
from zcode.forward_batch import ForwardBatch  # noqa: E402
from zcode.sampling_params import SamplingParams  # noqa: E402
from zcode.sparsity.apply import apply_plan, make_plan, remove_sparsity  # noqa: E402
from zcode.sparsity.artifact import SparsityArtifact, default_path  # noqa: E402
from zcode.sparsity.calibrate import calibrate  # noqa: E402
from zcode.sparsity.latency import weight_mb_per_token  # noqa: E402
from zcode.sparsity.predictor import (  # noqa: E402
    FFNInputRecorder,
    load_predictors,
    num_parameters,
    recall_precision,
)
from zcode.sparsity.sparse_mlp import SparseMLP  # noqa: E402

RESULTS = Path(__file__).parent / "results"
WINDOW = 512


def teacher_forced_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """[T, V] logits of one window, straight through the model (the engine is idle, so its
    first blocks are free to use)."""
    block = llm.config.block_size
    table = list(range(math.ceil(len(ids) / block)))
    batch = ForwardBatch.build([len(ids)], [len(ids)], [table], block, [len(ids)])
    with torch.inference_mode():
        return llm.model(torch.tensor(ids), batch)


def quality(llm: LLM, windows: list[list[int]], dense_logits: list[torch.Tensor] | None):
    nll, count, agree, kl = 0.0, 0, 0, 0.0
    logits_all = []
    for k, ids in enumerate(windows):
        logits = teacher_forced_logits(llm, ids)
        logits_all.append(logits)
        logp = F.log_softmax(logits[:-1], -1)
        nll -= logp.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
        count += len(ids) - 1
        if dense_logits is not None:
            dense_logp = F.log_softmax(dense_logits[k][:-1], -1)
            agree += (dense_logp.argmax(-1) == logp.argmax(-1)).sum().item()
            kl += F.kl_div(logp, dense_logp, log_target=True, reduction="sum").item()
    out = {"ppl": math.exp(nll / count)}
    if dense_logits is not None:
        out["greedy_agreement"] = agree / count
        out["kl_per_token"] = kl / count
    return out, logits_all


class RealizedSparsity:
    """Pre-hooks on every SparseMLP recomputing its masks from the input: the fraction of FFN
    multiply-adds the kernel skipped, per token, averaged."""

    def __init__(self, model) -> None:
        self.mlps = [m for m in model.modules() if isinstance(m, SparseMLP) and not m.is_dense]
        self.skipped, self.total = 0.0, 0

    def __enter__(self):
        self.handles = [m.register_forward_pre_hook(self._hook) for m in self.mlps]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def _hook(self, m: SparseMLP, args):
        (x,) = args  # [T, D]
        keep_in = x.abs() * m.scale_in > m.thresh_in
        gate_up = (x * keep_in) @ m.w_gate_up_t
        gate, up = gate_up.split(m.intermediate_size, -1)
        h = F.silu(gate) * up
        keep_mid = h.abs() * m.scale_mid > m.thresh_mid
        frac = (2 * (~keep_in).float().mean(-1) + (~keep_mid).float().mean(-1)) / 3  # [T]
        self.skipped += frac.sum().item()
        self.total += frac.numel()

    def value(self, num_layers: int) -> float:
        """Skipped fraction over all FFN work (dense layers count as nothing skipped)."""
        if not self.total:
            return 0.0
        return self.skipped / self.total * len(self.mlps) / num_layers


def decode_step_ms(
    llm: LLM, prompts: list[list[int]], num_tokens: int, skips: list[dict] | None = None
) -> float:
    """Median wall ms of a decode step with len(prompts) requests running together; skips[i]:
    what request i skips (add_request's skip_layers / skip_kv_heads)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=num_tokens + 1, temperature=0, ignore_eos=True)
    skips = skips or [{}] * len(prompts)
    seqs = [engine.add_request(p, params, **s) for p, s in zip(prompts, skips, strict=True)]
    times, prefilled = [], False
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        if prefilled:
            times.append(1e3 * (time.perf_counter() - start))
        prefilled = all(s.num_computed_tokens >= s.num_prompt_tokens for s in seqs)
    return statistics.median(times)


def use_plan(llm: LLM, artifact: SparsityArtifact, plan) -> None:
    """Dense model, then `plan`; the engine (and KV cache) is rebuilt to the plan's shape."""
    remove_sparsity(llm.model)
    _restore_heads(llm)
    apply_plan(llm.model, artifact, plan)
    llm.engine = LLMEngine(llm.model, llm.tokenizer, llm.config)


_ORIGINAL_ATTN: dict[int, torch.nn.Module] = {}


def _restore_heads(llm: LLM) -> None:
    for i, layer in enumerate(llm.model.model.layers):
        if i not in _ORIGINAL_ATTN:
            _ORIGINAL_ATTN[i] = layer.self_attn
        elif layer.self_attn is not _ORIGINAL_ATTN[i]:
            layer.self_attn = _ORIGINAL_ATTN[i]


def run_sizes(args: argparse.Namespace) -> tuple[int, int, int]:
    """Applies --threads; (held-out tokens, timing repeats, decode tokens) for --quick or not."""
    if args.threads:
        torch.set_num_threads(args.threads)
    return (1024, 3, 12) if args.quick else (4096, 5, 24)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens, levels and repeats")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--artifact", help="a zcode calibrate artifact (default: calibrate here)")
    args = ap.parse_args()
    quick = args.quick
    heldout_tokens, repeats, decode_tokens = run_sizes(args)

    llm = LLM(None, dtype="float32", enable_prefix_caching=False)
    _restore_heads(llm)
    if args.artifact:
        artifact = SparsityArtifact.load(args.artifact)
    else:
        print("calibrating ...", flush=True)
        artifact = calibrate(llm, num_tokens=2048 if quick else 4096, num_eval_tokens=1024)
        artifact.save(default_path(llm.model))  # --artifact of the next run; --sparsity's file
        print(f"saved the artifact to {default_path(llm.model)}")
    held = corpus_tokens(llm.tokenizer, "heldout", heldout_tokens)
    windows = [held[i : i + WINDOW] for i in range(0, len(held) - 1, WINDOW)]
    num_layers = len(llm.model.model.layers)

    teal = [(lv.sparsity_in, lv.sparsity_mid) for lv in artifact.levels]
    if quick:
        keep = {(0.0, 0.0), (0.0, 0.3), (0.1, 0.3), (0.3, 0.5), (0.5, 0.7)}
        teal = [t for t in teal if t in keep]
    plans = [("teal", make_plan(artifact, s_in, s_mid)) for s_in, s_mid in teal]
    plans += [("layer_skip", make_plan(artifact, num_skip_layers=k)) for k in (1, 2, 4, 6)]
    plans += [("head_prune", make_plan(artifact, num_drop_heads=k)) for k in (3, 10, 20)]
    keeps = [float(k) for k in artifact.predictor or {}]
    plans += [("predictor", make_plan(artifact, predictor_keep=k)) for k in keeps]
    predictor_metrics = predictor_report(llm, artifact, windows, keeps)

    rows = []
    dense_logits = None
    for family, plan in plans:
        use_plan(llm, artifact, plan)
        with RealizedSparsity(llm.model) as realized:
            q, logits = quality(llm, windows, dense_logits)
        if dense_logits is None:
            dense_logits = logits
        kv = kv_bytes_per_token(llm.model.attention_layers(), torch.float32)
        skipped = realized.value(num_layers)
        if family == "predictor":  # each token keeps exactly that fraction of neuron blocks
            skipped = 1 - plan.ffn_density
        rows.append(
            {
                "family": family,
                "plan": plan.name,
                "skip_layers": list(plan.skip_layers),
                "extras": dict(plan.extras),
                "ffn_flops_skipped": skipped,
                "weight_mb_per_token": weight_mb_per_token(llm.model, plan.ffn_density),
                "kv_bytes_per_token": kv,
                "ms": [],
                **q,
            }
        )
        print(f"quality {plan.name}: {q}", flush=True)
    dense = rows[0]
    for row in rows:
        row["ppl_increase"] = row["ppl"] / dense["ppl"] - 1
        row["kv_saved"] = 1 - row["kv_bytes_per_token"] / dense["kv_bytes_per_token"]

    prompt = held[:64]
    for _ in range(repeats):  # interleaved, so drifting load hits every plan alike
        for (_family, plan), row in zip(plans, rows):
            use_plan(llm, artifact, plan)
            row["ms"].append(decode_step_ms(llm, [prompt], decode_tokens))
    for row in rows:
        row["ms_min"], row["ms_median"] = min(row["ms"]), statistics.median(row["ms"])
        row["tok_s"] = 1e3 / row["ms_min"]
        row["speedup_vs_dense"] = dense["ms_min"] / row["ms_min"]
    print_rows(
        ["plan", "ppl", "+ppl", "agree", "KL", "FFN skipped", "KV saved", "ms min/med", "x dense"],
        [
            (
                r["plan"],
                f"{r['ppl']:.3f}",
                f"{100 * r['ppl_increase']:+.2f}%",
                f"{r.get('greedy_agreement', 1):.3f}",
                f"{r.get('kl_per_token', 0):.4f}",
                f"{r['ffn_flops_skipped']:.1%}",
                f"{r['kv_saved']:.1%}",
                f"{r['ms_min']:.1f}/{r['ms_median']:.1f}",
                f"{r['speedup_vs_dense']:.3f}",
            )
            for r in rows
        ],
    )

    # Batch sweep: dense against the sparsest TEAL level within 1% and a strong level.
    teal_rows = [r for r in rows if r["family"] == "teal"]
    within = [r for r in teal_rows if r["ppl_increase"] <= 0.01]
    best = max(within, key=lambda r: r["ffn_flops_skipped"])
    strong = max(teal_rows, key=lambda r: r["ffn_flops_skipped"])
    batch_rows = []
    prompts = [held[i * 64 : (i + 1) * 64] for i in range(16)]
    for bsz in (1, 4, 16):
        ms = {name: [] for name in ("dense", "best", "strong")}
        for _ in range(repeats):
            for name, row in (("dense", dense), ("best", best), ("strong", strong)):
                use_plan(llm, artifact, _plan_named(plans, row["plan"]))
                ms[name].append(decode_step_ms(llm, prompts[:bsz], decode_tokens))
        union = {
            name: _union_density(llm, artifact, plans, row["plan"], prompts[:bsz])
            for name, row in (("best", best), ("strong", strong))
        }
        batch_rows.append(
            {
                "batch": bsz,
                "dense_ms_min": min(ms["dense"]),
                **{f"{n}_ms_min": min(ms[n]) for n in ("best", "strong")},
                **{f"{n}_speedup": min(ms["dense"]) / min(ms[n]) for n in ("best", "strong")},
                **{f"{n}_union_density": union[n] for n in union},
            }
        )
    print(f"\nbatch sweep: best = {best['plan']}, strong = {strong['plan']}")
    print_rows(
        ["batch", "dense ms", "best ms", "x", "union rows", "strong ms", "x", "union rows"],
        [
            (
                str(b["batch"]),
                f"{b['dense_ms_min']:.1f}",
                f"{b['best_ms_min']:.1f}",
                f"{b['best_speedup']:.3f}",
                f"{b['best_union_density']:.2f}",
                f"{b['strong_ms_min']:.1f}",
                f"{b['strong_speedup']:.3f}",
                f"{b['strong_union_density']:.2f}",
            )
            for b in batch_rows
        ],
    )

    RESULTS.mkdir(exist_ok=True)
    meta = {"threads": torch.get_num_threads(), "quick": quick, "heldout_tokens": len(held)}
    blob = {
        "meta": meta,
        "plans": rows,
        "batch": batch_rows,
        "predictor": predictor_metrics,
    }
    (RESULTS / "sparsity.json").write_text(json.dumps(blob, indent=2))
    _plot(rows, RESULTS / "sparsity_pareto.png")
    print(f"\nwrote {RESULTS / 'sparsity.json'} and {RESULTS / 'sparsity_pareto.png'}")


def predictor_report(llm: LLM, artifact, windows, keeps) -> list[dict]:
    """Recall and precision of the trained block predictors on held-out FFN inputs."""
    remove_sparsity(llm.model)
    with FFNInputRecorder(llm.model) as rec:
        for ids in windows:
            teacher_forced_logits(llm, ids)
    inputs = rec.stacked()
    model_params = sum(p.numel() for p in llm.model.parameters())
    out = []
    for keep in keeps:
        state = artifact.predictor[str(keep)]
        predictors = load_predictors(state, llm.model.config.hidden_size)
        metrics = recall_precision(llm.model, predictors, inputs, keep)
        params = num_parameters(predictors)
        out.append(
            {"keep": keep, "params": params, "share_of_model": params / model_params, **metrics}
        )
        print(f"predictor keep {keep}: {out[-1]}", flush=True)
    return out


def _plan_named(plans, name: str):
    return next(p for _, p in plans if p.name == name)


def _union_density(llm, artifact, plans, name, prompts) -> float:
    """Mean fraction of FFN weight rows a decode step of this batch reads (union of masks)."""
    use_plan(llm, artifact, _plan_named(plans, name))
    fractions = []

    def hook(m: SparseMLP, args):
        (x,) = args
        if x.shape[0] != len(prompts):
            return  # prefill
        keep_in = (x.abs() * m.scale_in > m.thresh_in).any(0).float().mean()
        gate, up = ((x * (x.abs() * m.scale_in > m.thresh_in)) @ m.w_gate_up_t).split(
            m.intermediate_size, -1
        )
        h = F.silu(gate) * up
        keep_mid = (h.abs() * m.scale_mid > m.thresh_mid).any(0).float().mean()
        fractions.append(float((2 * keep_in + keep_mid) / 3))

    mlps = [m for m in llm.model.modules() if isinstance(m, SparseMLP)]
    handles = [m.register_forward_pre_hook(hook) for m in mlps]
    try:
        decode_step_ms(llm, prompts, 4)
    finally:
        for h in handles:
            h.remove()
    return statistics.mean(fractions) if fractions else 1.0


def _plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    families = (("teal", "o"), ("predictor", "D"), ("layer_skip", "s"), ("head_prune", "^"))
    for family, marker in families:
        pts = sorted((r["tok_s"], r["ppl"]) for r in rows if r["family"] == family)
        if pts:
            ax.plot(*zip(*pts), marker=marker, label=family.replace("_", " "))
    dense = rows[0]
    ax.scatter([dense["tok_s"]], [dense["ppl"]], color="black", zorder=5, label="dense")
    ax.axhline(dense["ppl"] * 1.01, color="gray", linestyle="--", linewidth=0.8, label="dense +1%")
    ax.set_xlabel("batch-1 decode tok/s (min over repeats)")
    ax.set_ylabel("held-out perplexity")
    ax.set_yscale("log")
    ax.set_title("SmolLM2-135M fp32: dynamic sparsity, quality vs speed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
