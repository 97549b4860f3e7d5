"""Input routing against the best static plan, on SmolLM2-135M in fp32 (issue 17, item 5).

    .venv/bin/python bench/bench_router.py [--quick] [--window 128] [--num-cal N] [--num-held N]

The router (zcode.harness.router) is fitted on calibration windows of stdlib source (by default
all of the calibration split's, ~500 of 128 tokens: the router has a weight per embedding
dimension and depth, and fitted on random draws of ~250 windows it does not always beat the
static plans at one skipped layer) and judged on held-out windows (other files, all ~180 by
default): for each depth (the k least important layers skipped), each held-out window's measured
log-perplexity increase, and each depth's measured batch-1 decode ms/token (min and median of
--repeats runs of 64 tokens, depths round-robin; the comparisons use a least-squares line
through the medians over the number of skipped layers). Then, over held-out windows:

- static: every window at depth k: mean ms/token and mean perplexity increase;
- static mix: the same policies with every window at its depth's calibration mean (so without
  reading the requests): static depths alone or two of them split over requests;
- routed: each window at the depth minimizing its predicted loss + lambda * ms, every lambda;
  at the static plan's mean ms, the least routed mean perplexity increase one such policy or
  two mixed over requests attain (the policies' lower convex hull);
- oracle: the same with each window's measured loss in place of the prediction (the bound).

Then what revising a plan during decoding (zcode.harness.revision) buys: each held-out window
read as a prompt (its first PROMPT tokens) and a continuation, the depth the rest of the window
after CHECKPOINT runs at chosen from the prompt alone (admission) or from the text at the
checkpoint (PROMPT + the 32 tokens after which the reviser reads again), each at equal mean ms
against static plans, on the measured loss of those last tokens.

Writes bench/results/router.json, and the measured losses, predictions and ms/token to
bench/results/router_losses.pt (the tables can be recomputed from them).
"""

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from table_format import print_rows  # noqa: E402

from zcode import LLM  # noqa: E402
from zcode.calibration import corpus_tokens  # noqa: E402
from zcode.harness.plan import ExecutionPlan  # noqa: E402
from zcode.harness.revision import REVISE_EVERY  # noqa: E402
from zcode.harness.router import fit, layer_order, prompt_features, window_log_losses  # noqa: E402
from zcode.sampling_params import SamplingParams  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SKIP_COUNTS = (0, 1, 2, 3, 4, 6, 8)
ALL = 10**9  # tokens: a whole split
PROMPT, CHECKPOINT = 32, 32 + REVISE_EVERY  # tokens of a window read at admission, at revision


def windows(ids: list[int], width: int) -> list[list[int]]:
    return [ids[i : i + width] for i in range(0, len(ids) - width + 1, width)]


def decode_ms(llm: LLM, depths, prompt: list[int], num_tokens: int, repeats: int) -> list[list]:
    """Per depth, `repeats` measurements of batch-1 decode ms/token (depths round-robin)."""
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    runs = [[] for _ in depths]
    for _ in range(repeats):
        for i, depth in enumerate(depths):
            plan = ExecutionPlan(skip_layers=depth)
            (out,) = llm.generate(prompt, params, plan=plan)
            runs[i].append(out.plan.measured_ms_per_token)
    return runs


def frontier(loss_for_choice, measured, ms: torch.Tensor) -> list[tuple[float, float]]:
    """loss_for_choice, measured [N, K], ms [K]: (mean ms, mean measured log-loss) of every
    policy "each window at the depth minimizing loss_for_choice + lam * ms", lam >= 0. A
    window's choice between depths a and b flips only at lam = (l_b - l_a) / (ms_a - ms_b), so
    one lam between each two consecutive flips (and past the last) gives every policy."""
    ms = ms.double()  # the means of equal ms compare equal to ms_limit (at_ms)
    flips = (loss_for_choice[:, None, :] - loss_for_choice[:, :, None]) / (ms[:, None] - ms)
    flips = flips[torch.isfinite(flips) & (flips > 0)].unique()  # sorted
    lams = torch.cat([torch.zeros(1), (flips[1:] + flips[:-1]) / 2, flips[-1:] * 2])
    choice = (loss_for_choice + lams[:, None, None] * ms).argmin(2)  # [L, N]
    mean_loss = measured.gather(1, choice.T).mean(0)  # [L]
    return sorted(set(zip(ms[choice].mean(1).tolist(), mean_loss.tolist())))


def at_ms(points: list[tuple[float, float]], ms_limit: float) -> float | None:
    """The least mean loss at no more than `ms_limit` mean ms that a frontier's policies
    attain, alone or two of them mixed over requests (its lower convex hull there); None
    below its fastest."""
    pts = torch.tensor(points, dtype=torch.float64)  # [P, 2]
    below, above = pts[pts[:, 0] <= ms_limit + 1e-9], pts[pts[:, 0] > ms_limit + 1e-9]
    if not len(below):
        return None
    best = below[:, 1].min()
    if len(above):
        (ms0, loss0), (ms1, loss1) = below.T[:, :, None], above.T[:, None, :]  # [B, 1], [1, A]
        best = min(best, (loss0 + (loss1 - loss0) * (ms_limit - ms0) / (ms1 - ms0)).min())
    return best.item()


def pct(log_loss: float | None) -> float | None:
    return None if log_loss is None else 100 * math.expm1(log_loss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--num-cal", type=int, help="calibration windows (default: all)")
    parser.add_argument("--num-held", type=int, help="held-out windows (default: all)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.quick:
        args.num_cal, args.num_held, args.repeats = 16, 12, 1
    start = time.time()
    llm = LLM(None, dtype="float32", per_request_depth=True, kv_cache_bytes=512 << 20)
    cal = windows(corpus_tokens(llm.tokenizer, "calibration", ALL), args.window)[: args.num_cal]
    held = windows(corpus_tokens(llm.tokenizer, "heldout", ALL), args.window)[: args.num_held]
    print(f"{len(cal)} calibration and {len(held)} held-out windows", flush=True)
    order = layer_order(llm, cal[:8])
    depths = [tuple(sorted(order[:k])) for k in SKIP_COUNTS]
    print(f"layers, least important first: {order[:8]} ({time.time() - start:.0f} s)", flush=True)
    (cal_losses,) = window_log_losses(llm, cal, depths)  # [N, K]
    # the whole windows, and their tokens after CHECKPOINT (revision_rows)
    held_losses, tail = window_log_losses(llm, held, depths, starts=(1, CHECKPOINT))
    print(f"losses measured ({time.time() - start:.0f} s)", flush=True)
    embed = llm.model.model.embed_tokens
    router = fit(prompt_features(embed, cal), cal_losses, depths)
    predicted = router.predict_features(prompt_features(embed, held))  # [N, K]
    runs = decode_ms(llm, depths, held[0][:32], 64, args.repeats)
    # Each layer skipped saves about the same time; a least-squares line over the depths'
    # median ms smooths run-to-run noise (here as large as one layer's time), which would
    # otherwise rank the depths out of order and skew the comparison at equal ms.
    skipped = torch.tensor([float(len(d)) for d in depths])
    medians = torch.tensor([statistics.median(r) for r in runs])
    slope, intercept = (
        torch.linalg.lstsq(torch.stack([skipped, torch.ones_like(skipped)], 1), medians[:, None])
        .solution[:, 0]
        .tolist()
    )
    ms = intercept + slope * skipped  # [K]
    num_params = sum(p.numel() for p in llm.model.parameters())

    routed = frontier(predicted, held_losses, ms)
    # the static plans' mixes: every window predicted at the calibration mean of each depth
    static_mix = frontier(cal_losses.mean(0).expand_as(held_losses), held_losses, ms)
    oracle = frontier(held_losses, held_losses, ms)
    rows, record = [], []
    for k, depth in enumerate(depths):
        static_loss = held_losses[:, k].mean().item()
        entry = {
            "skipped_layers": len(depth),
            "ms_min": min(runs[k]),
            "ms_median": statistics.median(runs[k]),
            "ms_fit": ms[k].item(),
            "static_loss_pct": pct(static_loss),
            "static_mix_loss_pct": pct(at_ms(static_mix, ms[k].item())),
            "routed_loss_pct": pct(at_ms(routed, ms[k].item())),
            "oracle_loss_pct": pct(at_ms(oracle, ms[k].item())),
            "predicted_mean_pct": pct(predicted[:, k].mean().item()),
        }
        record.append(entry)
        rows.append(
            [
                str(len(depth)),
                f"{entry['ms_min']:.1f} / {entry['ms_median']:.1f} / {entry['ms_fit']:.1f}",
                f"{entry['static_loss_pct']:.2f}",
                _fmt(entry["static_mix_loss_pct"]),
                _fmt(entry["routed_loss_pct"]),
                _fmt(entry["oracle_loss_pct"]),
            ]
        )
    print_rows(
        [
            "skipped",
            "ms/token min / median / line",
            "static ppl +%",
            "static mix",
            "routed",
            "oracle",
        ],
        rows,
    )
    revision = revision_rows(router, embed, held, depths, tail, ms)
    error = (predicted - held_losses).abs().mean().item()
    spread = held_losses.std(0).mean().item()
    print(
        f"router: {router.num_parameters} parameters "
        f"({100 * router.num_parameters / num_params:.4f}% "
        f"of the model); held-out mean |predicted - measured| {error:.4f} nats/token, "
        f"per-depth spread across windows {spread:.4f}"
    )
    RESULTS.mkdir(exist_ok=True)
    blob = {
        "window": args.window,
        "num_cal": len(cal),
        "num_held": len(held),
        "layer_order": order,
        "rows": record,
        "router_parameters": router.num_parameters,
        "model_parameters": num_params,
        "heldout_mean_abs_error": error,
        "revision": {"prompt": PROMPT, "checkpoint": CHECKPOINT, "rows": revision},
    }
    (RESULTS / "router.json").write_text(json.dumps(blob, indent=2) + "\n")
    measured = {"cal_losses": cal_losses, "held_losses": held_losses, "tail_losses": tail}
    torch.save(
        measured | {"predicted": predicted, "ms": ms, "depths": depths},
        RESULTS / "router_losses.pt",
    )
    print(f"wrote {RESULTS / 'router.json'} ({time.time() - start:.0f} s)")


def revision_rows(router, embed, held, depths, tail, ms: torch.Tensor) -> list[dict]:
    """Per depth: the static plan's loss over each held-out window's tokens after CHECKPOINT
    (tail [N, K]), and at its ms the routed ones' with the depth chosen from the first PROMPT
    tokens, from the first CHECKPOINT tokens (revised), and from the measured loss (oracle)."""
    fronts = {
        "admission": frontier(
            router.predict_features(prompt_features(embed, [w[:PROMPT] for w in held])), tail, ms
        ),
        "revised": frontier(
            router.predict_features(prompt_features(embed, [w[:CHECKPOINT] for w in held])),
            tail,
            ms,
        ),
        "oracle": frontier(tail, tail, ms),
    }
    record, rows = [], []
    for k, depth in enumerate(depths):
        entry = {"skipped_layers": len(depth), "static_loss_pct": pct(tail[:, k].mean().item())}
        entry |= {
            f"{name}_loss_pct": pct(at_ms(front, ms[k].item())) for name, front in fronts.items()
        }
        record.append(entry)
        rows.append(
            [str(len(depth)), f"{entry['static_loss_pct']:.2f}"]
            + [_fmt(entry[f"{n}_loss_pct"]) for n in fronts]
        )
    print(
        f"tokens {CHECKPOINT}.. of each window, the depth chosen from its first {PROMPT} tokens "
        f"(admission) or its first {CHECKPOINT} (revised):"
    )
    print_rows(["skipped", "static ppl +%", "admission", "revised", "oracle"], rows)
    return record


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
