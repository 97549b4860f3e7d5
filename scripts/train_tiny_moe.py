"""A small GLM-4.5-shaped MoE trained on CPU: a checkpoint whose experts mean something.

    python scripts/train_tiny_moe.py out/moe-tiny [--steps 200] [--params 19M]

The random checkpoints of make_glm_synthetic.py measure speed; their quality under a plan is
noise (a plan that runs fewer experts a token changes random outputs into other random outputs).
This trains one so that the planner's experts dimension has a quality cost to measure
(bench/bench_plan.py --model): the published GLM-4.5-Air config scaled down by
make_glm_synthetic.fit_config (`glm4_moe`: one dense layer first, then MoE layers of routed
experts with sigmoid scores and one shared expert), a byte-level tokenizer (make_gguf's: 256
bytes, a few merges and GLM's special tokens; a 49K-token vocabulary would spend most of a small
model's training on its output layer), next-token prediction on Python standard-library
sources. The files of both splits of zcode.calibration (what `zcode calibrate` profiles and what
perplexity is held out on) are left out of training.

Routing is kept balanced as GLM-4.5 and DeepSeek-V3 do, without an auxiliary loss: after each
step, each layer's score-correction bias moves by BIAS_RATE towards the experts that received
fewer tokens than the mean (it steers which experts are chosen, not their weights).

Deterministic for a given --seed and thread count: the data order is seeded, the model
initialised by transformers from the seed. Saved as HF safetensors (fp32) with its tokenizer,
ready for `zcode generate` and the GGUF converter.
"""

import argparse
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import make_glm_synthetic as synth  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIAS_RATE = 1e-3  # DeepSeek-V3's bias update speed


def training_files() -> list[Path]:
    """Standard-library sources, sorted, without the calibration and held-out splits."""
    from zcode.calibration import SPLITS

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    excluded = {stdlib / name for names in SPLITS.values() for name in names}
    return sorted(
        p
        for p in stdlib.rglob("*.py")
        if p not in excluded and not {"test", "tests", "site-packages", "idlelib"} & set(p.parts)
    )


def training_tokens(tokenizer, num_tokens: int) -> torch.Tensor:
    """The first num_tokens tokens of the training files, joined: int64 [num_tokens]."""
    ids: list[int] = []
    for path in training_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids += tokenizer.encode(text + "\n\n", add_special_tokens=False)
        if len(ids) >= num_tokens:
            break
    if len(ids) < num_tokens:
        raise ValueError(f"the standard library has {len(ids):,} tokens, fewer than {num_tokens:,}")
    return torch.tensor(ids[:num_tokens], dtype=torch.int64)


def balance_routers(loads: dict) -> None:
    """Moves each router's correction bias towards its under-loaded experts (see docstring)."""
    for router, load in loads.items():
        router.e_score_correction_bias += BIAS_RATE * torch.sign(load.mean() - load)
        load.zero_()


def train(args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    synth.write_tokenizer(args.out_dir, synth.TINY_VOCAB_MAX)
    tokenizer = AutoTokenizer.from_pretrained(args.out_dir)
    overrides = {
        "num_hidden_layers": args.layers,
        "first_k_dense_replace": 1,
        "hidden_size": args.hidden,
        "intermediate_size": 3 * args.hidden,
        "moe_intermediate_size": args.hidden // 2,
    }
    fields, num_params = synth.fit_config("glm45-air", args.params, len(tokenizer), overrides)
    config = synth.hf_config(fields)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    routers = [m for m in model.modules() if type(m).__name__ == "Glm4MoeTopkRouter"]
    loads = {r: torch.zeros(r.num_experts) for r in routers}

    def count(router, _inputs, outputs) -> None:
        loads[router] += torch.bincount(outputs[2].flatten(), minlength=router.num_experts)

    for router in routers:
        router.register_forward_hook(count)

    tokens_per_step = args.batch * args.seq_len
    data = training_tokens(tokenizer, args.train_tokens)
    num_windows = len(data) // args.seq_len
    generator = torch.Generator().manual_seed(args.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1
    )
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))

    print(
        f"{num_params / 1e6:.1f}M parameters ({fields['num_hidden_layers']} layers, hidden "
        f"{fields['hidden_size']}, {fields['n_routed_experts']} experts of "
        f"{fields['moe_intermediate_size']}, {fields['num_experts_per_tok']} a token); "
        f"{len(data):,} training tokens, {args.steps} steps of {tokens_per_step} tokens"
    )
    model.train()
    start, losses = time.perf_counter(), []
    for step in range(args.steps):
        starts = torch.randint(0, num_windows, (args.batch,), generator=generator) * args.seq_len
        batch = torch.stack([data[s : s + args.seq_len] for s in starts.tolist()])
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=batch, labels=batch).loss  # transformers shifts the labels
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        with torch.no_grad():
            balance_routers(loads)
        losses.append(loss.item())
        if step % 25 == 0 or step == args.steps - 1:
            rate = (step + 1) * tokens_per_step / (time.perf_counter() - start)
            mean_loss = sum(losses[-25:]) / len(losses[-25:])
            print(f"step {step}: loss {mean_loss:.3f} ({rate:.0f} tok/s)", flush=True)
    return {"model": model, "tokenizer": tokenizer, "params": num_params, "losses": losses}


@torch.no_grad()
def heldout_perplexity(model, tokenizer, num_tokens: int = 4096, window: int = 512) -> float:
    """Perplexity on zcode.calibration's held-out split, disjoint windows (transformers)."""
    from zcode.calibration import corpus_tokens

    model.eval()
    ids = torch.tensor(corpus_tokens(tokenizer, "heldout", num_tokens))
    nll, count = 0.0, 0
    for s in range(0, len(ids) - 1, window):
        chunk = ids[s : s + window][None]
        if chunk.shape[1] < 2:
            break
        loss = model(input_ids=chunk, labels=chunk).loss
        nll += loss.item() * (chunk.shape[1] - 1)
        count += chunk.shape[1] - 1
    return math.exp(nll / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--params", type=synth.parse_count, default=synth.parse_count("19M"))
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--train-tokens", type=int, default=4_000_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        trained = train(args)
    except ValueError as e:
        parser.error(str(e))
    model, tokenizer = trained["model"], trained["tokenizer"]
    ppl = heldout_perplexity(model, tokenizer)
    print(f"held-out perplexity (transformers, 4096 tokens, windows of 512): {ppl:.2f}")
    model.save_pretrained(args.out_dir)
    print(f"saved to {args.out_dir}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
