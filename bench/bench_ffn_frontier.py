"""How much FFN work SmolLM2-135M can skip at <= 1% held-out perplexity: TEAL input thresholds
(gate/up input, down input, both; plain |x| or WINA's |x| * weight column norm) against CATS
(threshold |silu(gate(x))|: gate runs dense, up computes and down reads only the kept neurons),
by default at 40/50/60% of FFN FLOPs skipped.

    .venv/bin/python bench/bench_ffn_frontier.py [--quick] [--targets 0.1,0.2,0.3]

Reference implementation in plain torch (masks applied, nothing skipped: this measures quality,
not speed). Per-layer thresholds are quantiles of the dense model's activations on the
calibration split; quality is on the held-out split only (teacher-forced 512-token windows:
perplexity change, greedy agreement and KL vs dense). The FLOPs skipped are realized, counted
per token from the masks: gate (1 - input kept), up (input kept x neurons kept), down (nonzero
inputs), each a third of the FFN. Writes bench/results/ffn_frontier.json.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from bench_sparsity import WINDOW, quality, teacher_forced_logits  # noqa: E402
from table_format import print_rows  # noqa: E402

from zcode import LLM  # noqa: E402
from zcode.calibration import corpus_tokens  # noqa: E402
from zcode.layers.mlp import GatedMLP  # noqa: E402
from zcode.sparsity.thresholds import channel_scales  # noqa: E402

RESULTS = Path(__file__).parent / "results"
TARGETS = (0.4, 0.5, 0.6)  # fractions of FFN FLOPs skipped
QUANTILE_SAMPLE = 1 << 22  # torch.quantile's input limit is 2**24 elements


class MaskedMLP(nn.Module):
    """SwiGLU with three optional magnitude masks (threshold < 0: off), counting FLOPs skipped:
    a = x [|x| s_in > t_in]; g = a Wg^T; kept neurons n = [|silu(g)| > t_gate];
    h = silu(g) (a Wu^T) n; out = (h [|h| s_mid > t_mid]) Wd^T (s: per-channel scales)."""

    def __init__(
        self, mlp: GatedMLP, t_in: float, t_gate: float, t_mid: float, score: str = "teal"
    ) -> None:
        super().__init__()
        self.mlp, self.t_in, self.t_gate, self.t_mid = mlp, t_in, t_gate, t_mid
        self.scale_in, self.scale_mid = channel_scales(mlp, score)  # [D], [I]
        self.skipped, self.num_tokens = 0.0, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, D] -> [T, D]
        keep_in = x.abs() * self.scale_in > self.t_in  # [T, D]
        a = x * keep_in
        act = F.silu(F.linear(a, self.mlp.gate_proj.weight))  # [T, I]
        keep_n = act.abs() > self.t_gate  # [T, I]
        h = act * F.linear(a, self.mlp.up_proj.weight) * keep_n
        h = h * (h.abs() * self.scale_mid > self.t_mid)
        frac_in = keep_in.float().mean(-1)  # [T]
        work = frac_in + frac_in * keep_n.float().mean(-1) + h.ne(0).float().mean(-1)
        self.skipped += (1 - work / 3).sum().item()
        self.num_tokens += x.shape[0]
        return F.linear(h, self.mlp.down_proj.weight)


class Recorder:
    """Dense FFN activations per layer on calibration text: |x|, |silu(gate)|, |h| samples, and
    the WINA scores of x and h."""

    def __init__(self, mlps: dict[int, GatedMLP]) -> None:
        self.mlps = mlps
        self.acts = {i: {k: [] for k in ("in", "gate", "mid", "wina-in", "wina-mid")} for i in mlps}
        self.wina = {i: channel_scales(m, "wina") for i, m in mlps.items()}

    def __enter__(self):
        self.handles = [m.register_forward_hook(self._hook(i)) for i, m in self.mlps.items()]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def _hook(self, i: int):
        def hook(m: GatedMLP, args, _out):
            (x,) = args
            act = F.silu(F.linear(x, m.gate_proj.weight))
            h = act * F.linear(x, m.up_proj.weight)
            scale_in, scale_mid = self.wina[i]
            for name, t in (
                ("in", x),
                ("gate", act),
                ("mid", h),
                ("wina-in", x * scale_in),
                ("wina-mid", h * scale_mid),
            ):
                self.acts[i][name].append(t.abs().flatten())

        return hook

    def threshold(self, i: int, name: str, sparsity: float) -> float:
        """The magnitude below which `sparsity` of this layer's activations fall (-1: off)."""
        if sparsity <= 0:
            return -1.0
        values = torch.cat(self.acts[i][name])
        if values.numel() > QUANTILE_SAMPLE:
            gen = torch.Generator().manual_seed(i)
            values = values[torch.randperm(values.numel(), generator=gen)[:QUANTILE_SAMPLE]]
        return float(torch.quantile(values, sparsity))


def configs(target: float) -> list[tuple[str, float, float, float]]:
    """(method, s_in, s_gate, s_mid) whose nominal FFN FLOPs skipped is `target`; the method's
    name starts with its score (teal: |x|, wina: |x| * weight column norm)."""
    out = [("teal-in", 1.5 * target, 0.0, 0.0), ("cats", 0.0, 1.5 * target, 0.0)]
    out.append(("teal-mid", 0.0, 0.0, 3 * target))
    for s_mid in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
        s_in = round((3 * target - s_mid) / 2, 6)  # 3 * 0.1 - 0.3 is 4e-17, not 0
        if 0 < s_in < 0.95:
            out += [("teal-in+mid", s_in, 0.0, s_mid), ("wina-in+mid", s_in, 0.0, s_mid)]
    return [c for c in out if max(c[1:]) < 0.99]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer calibration and held-out tokens")
    ap.add_argument(
        "--targets",
        type=lambda text: tuple(float(t) for t in text.split(",")),
        default=TARGETS,
        help="comma-separated fractions of FFN FLOPs to skip (default: 0.4,0.5,0.6)",
    )
    args = ap.parse_args()
    calib_tokens, heldout_tokens = (1024, 1024) if args.quick else (2048, 4096)

    llm = LLM(None, dtype="float32", enable_prefix_caching=False)
    layers = llm.model.model.layers
    mlps = {i: layer.mlp for i, layer in enumerate(layers)}
    calib = corpus_tokens(llm.tokenizer, "calibration", calib_tokens)
    held = corpus_tokens(llm.tokenizer, "heldout", heldout_tokens)
    windows = [held[i : i + WINDOW] for i in range(0, len(held) - 1, WINDOW)]
    x = torch.randn(5, llm.model.config.hidden_size)
    with torch.inference_mode():  # with every mask off it is the model's own FFN
        torch.testing.assert_close(MaskedMLP(mlps[0], -1, -1, -1)(x), mlps[0](x))
    with Recorder(mlps) as rec:
        for i in range(0, len(calib) - 1, WINDOW):
            teacher_forced_logits(llm, calib[i : i + WINDOW])
    dense_q, dense_logits = quality(llm, windows, None)
    print(f"dense held-out ppl {dense_q['ppl']:.3f}", flush=True)

    rows = []
    for target in args.targets:
        for method, s_in, s_gate, s_mid in configs(target):
            score = method.split("-")[0] if method.startswith("wina") else "teal"
            prefix = "wina-" if score == "wina" else ""
            for i, layer in enumerate(layers):
                layer.mlp = MaskedMLP(
                    mlps[i],
                    rec.threshold(i, prefix + "in", s_in),
                    rec.threshold(i, "gate", s_gate),
                    rec.threshold(i, prefix + "mid", s_mid),
                    score,
                )
            q, _ = quality(llm, windows, dense_logits)
            masked = [layer.mlp for layer in layers]
            skipped = sum(m.skipped for m in masked) / sum(m.num_tokens for m in masked)
            for i, layer in enumerate(layers):
                layer.mlp = mlps[i]
            row = {
                "target": target,
                "method": method,
                "s_in": s_in,
                "s_gate": s_gate,
                "s_mid": s_mid,
                "ffn_flops_skipped": skipped,
                "ppl_increase": q["ppl"] / dense_q["ppl"] - 1,
                **q,
            }
            rows.append(row)
            print(
                f"{method} in {s_in:.2f} gate {s_gate:.2f} mid {s_mid:.2f}: skipped "
                f"{skipped:.1%}, ppl {100 * row['ppl_increase']:+.2f}%",
                flush=True,
            )
    print_rows(
        ["target", "method", "s_in", "s_gate", "s_mid", "FFN skipped", "+ppl", "agree", "KL"],
        [
            (
                f"{r['target']:.0%}",
                r["method"],
                f"{r['s_in']:.2f}",
                f"{r['s_gate']:.2f}",
                f"{r['s_mid']:.2f}",
                f"{r['ffn_flops_skipped']:.1%}",
                f"{100 * r['ppl_increase']:+.2f}%",
                f"{r['greedy_agreement']:.3f}",
                f"{r['kl_per_token']:.4f}",
            )
            for r in rows
        ],
    )
    met = [r for r in rows if r["ppl_increase"] <= 0.01 and r["ffn_flops_skipped"] >= 0.4]
    print(f"{len(met)} configurations skip >= 40% of FFN FLOPs within +1% held-out perplexity")
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "quick": args.quick,
        "targets": args.targets,
        "calibration_tokens": len(calib),
        "heldout_tokens": len(held),
    }
    blob = {"meta": meta, "dense": dense_q, "rows": rows}
    name = "ffn_frontier.json" if args.targets == TARGETS else "ffn_frontier_low.json"
    (RESULTS / name).write_text(json.dumps(blob, indent=2))
    print(f"wrote {RESULTS / name}")


if __name__ == "__main__":
    main()
