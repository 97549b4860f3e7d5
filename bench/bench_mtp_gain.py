"""The cost model's predicted gain of MTP drafting on real GLM shapes, beside published figures.

    .venv/bin/python bench/bench_mtp_gain.py [--model glm-4.5-air] [--dtype bfloat16]
        [--context 2048]

The model is built on the meta device from a shipped config (no weights), the adaptive draft
policy (zcode/spec/policy.py) is given this machine's fitted cost model and the MTP drafter's
cost plan (one decoder layer with the embedding and head per draft step), and prints its
predicted decode speed with k drafts per request over plain decoding, for acceptance rates a
real MTP layer reaches, at batch 1, 4 and 16; and the draft count the policy would choose.
MoE verifying steps read the experts of every token they verify, which the cost model's
routed-expert term counts: that is why drafts pay less on a MoE than on a dense model.

Published, for comparison (issue 18): GLM-4.5-Air MTP 1.17-1.20x with one draft in llama.cpp;
GLM-4.7-Flash 1.38x with one draft, 0.78x with three; GLM-5 with CPU offload 15-37% slower in
ik_llama.cpp. Predictions, not measurements: this machine cannot hold these models.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from table_format import print_rows  # noqa: E402

from zcode.configs import CONFIGS_DIR  # noqa: E402
from zcode.hardware.cost_model import CostModel, format_cost  # noqa: E402
from zcode.loader.checkpoint import build_model, read_config  # noqa: E402
from zcode.spec.acceptance import geometric  # noqa: E402
from zcode.spec.mtp import mtp_cost_plan  # noqa: E402
from zcode.spec.policy import DraftPolicy  # noqa: E402

ACCEPTANCE = (0.5, 0.6, 0.7, 0.8, 0.9)
DRAFTS = (1, 2, 3)
BATCHES = (1, 4, 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="glm-4.5-air", help="a shipped config's name")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=2048)
    args = parser.parse_args()
    config = read_config(CONFIGS_DIR / args.model / "config.json")
    net = build_model(config, device="meta").to(getattr(torch, args.dtype))
    cost = CostModel.load_or_fit()
    print(format_cost(cost))
    policy = DraftPolicy(cost, net, mtp_cost_plan(len(net.model.layers)))
    rows = []
    for batch in BATCHES:
        for acceptance in ACCEPTANCE:
            gains = [
                policy.predicted_gain(acceptance, k, num_seqs=batch, context_len=args.context)
                for k in DRAFTS
            ]
            chosen = policy.choose(
                [geometric(acceptance, max(DRAFTS))] * batch, [max(DRAFTS)] * batch,
                num_tokens=batch, num_seqs=batch,
                context_len=args.context, base_yield=batch,
            )  # fmt: skip
            rows.append(
                (
                    str(batch),
                    f"{acceptance:.1f}",
                    *(f"{g:.2f}x" for g in gains),
                    f"{sum(chosen) / batch:.2f}",
                )
            )
    print(f"{args.model} ({args.dtype}, context {args.context}): predicted MTP gain over plain")
    headers = ["batch", "acceptance", *(f"{k} draft{'s' * (k > 1)}" for k in DRAFTS)]
    print_rows([*headers, "policy drafts/request"], rows)


if __name__ == "__main__":
    main()
