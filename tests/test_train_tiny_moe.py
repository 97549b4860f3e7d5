"""scripts/train_tiny_moe.py: a small GLM-4.5-shaped MoE trained on standard-library text.

transformers is the oracle: the trained checkpoint gives ZCode transformers' logits, as the
random ones of make_glm_synthetic do.
"""

import argparse
import sysconfig
from pathlib import Path

import torch
from paged_runner import PagedRunner
from test_parity import TIE_GAP, oracle_logits

from scripts import train_tiny_moe as script
from zcode.calibration import SPLITS
from zcode.loader import load_model

PREFILL_LEN, DECODE_STEPS = 24, 8
LOGIT_TOL = 1e-4  # relative to the largest logit, as for the random checkpoints


def _args(out_dir: Path) -> argparse.Namespace:
    return argparse.Namespace(
        out_dir=out_dir, params=400_000, layers=2, hidden=64, steps=12, batch=4, seq_len=64,
        lr=3e-3, train_tokens=20_000, seed=0,
    )  # fmt: skip


def test_the_held_out_and_calibration_files_are_not_trained_on():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = set(script.training_files())
    assert len(files) > 100
    for names in SPLITS.values():
        for name in names:
            assert stdlib / name not in files


def test_the_bias_moves_towards_the_experts_below_the_mean_load():
    class Router:
        e_score_correction_bias = torch.zeros(4)

    router, load = Router(), torch.tensor([10.0, 2.0, 4.0, 0.0])  # mean 4
    script.balance_routers({router: load})
    sign = torch.tensor([-1.0, 1.0, 0.0, 1.0])
    assert torch.equal(router.e_score_correction_bias, script.BIAS_RATE * sign)
    assert torch.equal(load, torch.zeros(4))  # counted afresh each step


def test_training_lowers_the_loss_and_zcode_runs_what_it_saves(tmp_path):
    from transformers import AutoModelForCausalLM

    trained = script.train(_args(tmp_path))
    losses = trained["losses"]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
    biases = [b for name, b in trained["model"].named_buffers() if name.endswith("correction_bias")]
    assert biases and all(b.abs().sum() > 0 for b in biases)  # the balancing ran
    trained["model"].save_pretrained(tmp_path)
    oracle = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = trained["tokenizer"].encode("def mean(values):\n    return sum(values) / len(v")
    ids = ids[: PREFILL_LEN + DECODE_STEPS]
    assert len(ids) == PREFILL_LEN + DECODE_STEPS
    want, min_gap = oracle_logits(oracle, ids)
    assert min_gap > TIE_GAP, f"prompt sits on a top-k tie (gap {min_gap:.2e})"
    net, _ = load_model(tmp_path, torch.float32)
    got = PagedRunner(net).prefill_then_decode("seq", ids, PREFILL_LEN)
    assert (got - want).abs().max().item() <= LOGIT_TOL * want.abs().max().item()
