"""Pictures of precision: the sensitivity heatmap of a profile and the quality/speed Pareto plot.

matplotlib draws with the Agg backend (files only, no display needed).
"""

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

OUTSIDE_LAYERS = "head"  # heatmap row of the units outside the decoder layers (lm_head)


def draw_heatmap(profile: dict, path: str | Path) -> None:
    """One panel per format: rows are decoder layers (plus a last row for lm_head and other
    units outside the layers), columns are module kinds, colour is log10 of the KL."""
    modules = profile["modules"]
    kinds = list(dict.fromkeys(entry["kind"] for entry in modules.values()))
    layers = sorted({e["layer"] for e in modules.values() if e["layer"] is not None})
    rows = [str(layer) for layer in layers]
    if any(e["layer"] is None for e in modules.values()):
        rows.append(OUTSIDE_LAYERS)
    formats = profile["formats"]
    grids = {}
    for fmt in formats:
        grid = np.full((len(rows), len(kinds)), np.nan)
        for entry in modules.values():
            row = rows.index(OUTSIDE_LAYERS if entry["layer"] is None else str(entry["layer"]))
            kl = entry["formats"][fmt]["kl"]
            grid[row, kinds.index(entry["kind"])] = math.log10(max(kl, 1e-9))
        grids[fmt] = grid
    low = min(np.nanmin(g) for g in grids.values())
    high = max(np.nanmax(g) for g in grids.values())
    fig, axes = plt.subplots(
        1, len(formats), figsize=(2.2 + 1.9 * len(formats), 0.9 + 0.2 * len(rows)), squeeze=False
    )
    for ax, fmt in zip(axes[0], formats):
        image = ax.imshow(grids[fmt], aspect="auto", cmap="viridis", vmin=low, vmax=high)
        ax.set_title(fmt, fontsize=9)
        ax.set_xticks(range(len(kinds)), [k.split(".")[-1] for k in kinds], rotation=90, fontsize=7)
        ax.set_yticks(range(len(rows)), rows, fontsize=6)
    axes[0][0].set_ylabel("layer")
    fig.colorbar(image, ax=axes[0].tolist(), label="log10 KL(dense || quantized)")
    fig.suptitle(f"Sensitivity per module, {profile['num_tokens']} calibration tokens", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_pareto(points: list[dict], path: str | Path) -> None:
    """Perplexity against bytes per token and against decode tok/s.

    Each point: {"label", "kind" ("uniform" or "planned"), "ppl", "bytes_per_token",
    "decode_tok_s" (or None when not measured)}.
    """
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    styles = {
        "uniform": dict(marker="s", color="tab:blue"),
        "planned": dict(marker="o", color="tab:red"),
    }
    for ax, key, xlabel in (
        (axes[0], "bytes_per_token", "weight bytes read per token (MB)"),
        (axes[1], "decode_tok_s", "batch-1 decode tok/s (measured)"),
    ):
        for kind, style in styles.items():
            chosen = [p for p in points if p["kind"] == kind and p.get(key) is not None]
            chosen.sort(key=lambda p: p[key])
            scale = 1e-6 if key == "bytes_per_token" else 1.0
            xs = [p[key] * scale for p in chosen]
            ax.plot(xs, [p["ppl"] for p in chosen], linestyle=":", label=kind, **style)
            for p, x in zip(chosen, xs):
                ax.annotate(
                    p["label"], (x, p["ppl"]), fontsize=6, xytext=(3, 3), textcoords="offset points"
                )
        if key == "bytes_per_token":
            ax.set_xscale("log")  # fp32 reads ~6x the bytes of the int4 plans
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out perplexity")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("SmolLM2-135M: uniform and planned precision")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
