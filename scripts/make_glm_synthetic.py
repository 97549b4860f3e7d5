"""Deterministic random checkpoints shaped like GLM-4.5-Air or GLM-5, scaled to a target size.

    python scripts/make_glm_synthetic.py glm45-air 1.3B out/air-1.3b
    python scripts/make_glm_synthetic.py glm5 12B out/glm5-12b --types bf16 q8_0 q4_0 q4_k_m

The shape is the published config shipped in zcode/configs/ (glm4_moe, or glm_moe_dsa: MLA + DSA
+ MoE), scaled by one width factor w: hidden size, FFN and expert FFN widths, LoRA ranks and the
number of attention (and indexer) heads by w, the number of layers by w, routed experts by
sqrt(w) (at least twice the experts per token); the experts per token, shared experts, head dims
(until there are too few heads to scale) and the dense-prefix fraction stay as published. w is
chosen by bisection so that the parameter count (embedding and head included) lands closest to
the target.

Saved as a HF directory (bf16 safetensors shards, config.json, tokenizer): per tensor, weights
are drawn from a generator seeded by (seed, tensor name) and written shard by shard, so a 12B
model is made in a few GiB of RAM and the same arguments give the same bytes. The tokenizer is
SmolLM2's with GLM's special tokens added (what llama.cpp's GLM vocab writer looks up), or for a
vocabulary of at most 272 tokens scripts/make_gguf.py's tiny byte-level one. GGUF files come from
make_gguf.py's `convert` (llama.cpp's converter: bf16, q8_0) and `quantize` (from the bf16 file:
q4_0, q4_k_m, ...).

Initialisation keeps routing realistic: embedding rows N(0, 1), every linear N(0, 1/fan_in) so
the residual stream stays O(1), and the router N(0, 1/hidden) so router logits are ~N(0, 1)
across tokens. (A 0.02 std everywhere gives near-constant router scores: one token repeats and
the same few experts win every step.) The script then greedy-decodes a few tokens with ZCode and
reports how many distinct routed experts each MoE layer touched.
"""

import argparse
import functools
import json
import math
import re
import sys
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # run as a script or imported as scripts.*
import make_gguf  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "zcode" / "configs"
SHAPES = {"glm45-air": "glm-4.5-air", "glm5": "glm-5"}
TINY_VOCAB_MAX = 272  # make_gguf.write_tokenizer: 256 bytes + 6 merges + 10 special tokens
SHARD_BYTES = 1 << 30


def parse_count(text: str) -> int:
    """'1.3B' -> 1_300_000_000; '800M', '12e9' and plain integers too."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([KMBT]?)\s*", text.upper())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (e.g. 1.3B, 800M)")
    try:
        value = float(match.group(1))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r}") from e
    scale = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}[match.group(2)]
    if value * scale < 1e5:
        raise argparse.ArgumentTypeError(f"{text!r}: too small for a GLM shape (at least 100K)")
    return int(value * scale)


def published_config(shape: str) -> dict:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    return json.loads((CONFIGS / SHAPES[shape] / "config.json").read_text())


def _width(x: float) -> int:
    """A scaled width: whole 256-blocks (K-quant rows) when wide, else 32-blocks (Q4_0/Q8_0)."""
    quantum = 256 if x >= 384 else 32
    return max(32, quantum * round(x / quantum))


def _multiple(x: float, quantum: int, minimum: int) -> int:
    return max(minimum, quantum * round(x / quantum))


def scaled_config(shape: str, w: float, vocab_size: int) -> dict:
    """The published config of `shape` with widths and depth scaled by w, experts by sqrt(w)."""
    base = published_config(shape)
    c = dict(base)
    layers = max(2, round(base["num_hidden_layers"] * w))
    top_k = base["num_experts_per_tok"]
    c.update(
        vocab_size=vocab_size,
        hidden_size=_width(base["hidden_size"] * w),
        intermediate_size=_width(base["intermediate_size"] * w),
        moe_intermediate_size=_width(base["moe_intermediate_size"] * w),
        num_hidden_layers=layers,
        first_k_dense_replace=max(
            1, round(base["first_k_dense_replace"] * layers / base["num_hidden_layers"])
        ),
        n_routed_experts=_multiple(base["n_routed_experts"] * math.sqrt(w), 8, 2 * top_k),
        num_nextn_predict_layers=0,  # no MTP weights are made
        max_position_embeddings=min(base["max_position_embeddings"], 8192),
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    if shape == "glm45-air":
        ratio = base["num_attention_heads"] // base["num_key_value_heads"]
        kv_heads = max(1, round(base["num_key_value_heads"] * w))
        heads = ratio * kv_heads
        # keep the query width / hidden ratio: head_dim shrinks once the heads cannot
        head_dim = base["head_dim"] * w * base["num_attention_heads"] / heads
        c.update(
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=min(base["head_dim"], _multiple(head_dim, 16, 16)),
        )
    else:
        heads = max(2, round(base["num_attention_heads"] * w))
        f = min(1.0, base["num_attention_heads"] * w / heads)  # head dims, once heads floor
        rope = _multiple(base["qk_rope_head_dim"] * f, 16, 16)
        c.update(
            num_attention_heads=heads,
            num_key_value_heads=heads,  # MLA: one latent, per-head keys
            q_lora_rank=_width(base["q_lora_rank"] * w),
            kv_lora_rank=_width(base["kv_lora_rank"] * w),
            qk_nope_head_dim=_multiple(base["qk_nope_head_dim"] * f, 16, 16),
            qk_rope_head_dim=rope,
            v_head_dim=_multiple(base["v_head_dim"] * f, 16, 16),
            # A power of two: llama.cpp's glm-dsa indexer departs from transformers otherwise
            # (the tiny DSA F32 file with 5 indexer heads: 6% of max |logit| from position 29;
            # 8 or 16 heads: within 6e-5 at every position).
            index_n_heads=2 ** max(1, round(math.log2(base["index_n_heads"] * w))),
            # llama.cpp rotates the indexer's q and k by a Hadamard matrix of at least 64 x 64
            index_head_dim=max(rope, _multiple(base["index_head_dim"] * f, 64, 64)),
            # llama.cpp's glm-dsa loader wants the whole qk_rope_head_dim rotated
            rope_parameters={**base["rope_parameters"], "partial_rotary_factor": 1.0},
        )
        c["qk_head_dim"] = c["qk_nope_head_dim"] + rope
    return c


def hf_config(fields: dict):
    from transformers import AutoConfig

    drop = ("transformers_version", "torch_dtype")
    return AutoConfig.for_model(**{k: v for k, v in fields.items() if k not in drop})


def checkpoint_tensors(config) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every tensor a save_pretrained of this config writes, experts
    one by one (the published checkpoints' layout), from transformers' model on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out = []
    for name, t in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):  # [E, 2 * I, H] -> gate_proj, up_proj [I, H]
            stem = name.removesuffix("gate_up_proj")
            num_experts, two_i, hidden = t.shape
            for j in range(num_experts):
                for proj in ("gate_proj", "up_proj"):
                    out.append((f"{stem}{j}.{proj}.weight", (two_i // 2, hidden), t.dtype))
        elif name.endswith("experts.down_proj"):  # [E, H, I]
            stem = name.removesuffix("down_proj")
            for j in range(t.shape[0]):
                out.append((f"{stem}{j}.down_proj.weight", tuple(t.shape[1:]), t.dtype))
        else:
            out.append((name, tuple(t.shape), t.dtype))
    return out


def count_params(config) -> int:
    return sum(math.prod(shape) for _, shape, _ in checkpoint_tensors(config))


def fit_config(
    shape: str, target_params: int, vocab_size: int, overrides: dict | None = None
) -> tuple[dict, int]:
    """The scaled config (with `overrides` on top) whose parameter count is closest to the
    target, and that count."""

    def count(fields: dict) -> int:
        return count_params(hf_config(fields))

    def at(w: float) -> dict:
        return {**scaled_config(shape, w, vocab_size), **(overrides or {})}

    lo, hi = 1e-3, 1.0
    if count(at(hi)) < target_params:
        raise ValueError(f"{shape} at full scale has {count(at(hi)):,} parameters, below target")
    if count(at(lo)) > target_params:
        raise ValueError(f"{target_params:,} parameters is below the smallest {shape} shape")
    for _ in range(16):  # the count is non-decreasing in w (every scaled dim is); hi/lo -> 1.0005
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if count(at(mid)) < target_params else (lo, mid)
    fields = min((at(lo), at(hi)), key=lambda f: abs(count(f) - target_params))
    # Widths move in whole blocks and layers one at a time (steps of up to ~10% of the count);
    # the number of routed experts, the finest knob, brings the count the rest of the way.
    num_experts = fields["n_routed_experts"]
    base = count(fields)
    per_expert = count({**fields, "n_routed_experts": num_experts + 1}) - base
    num_experts += round((target_params - base) / per_expert)
    fields["n_routed_experts"] = max(2 * fields["num_experts_per_tok"], num_experts)
    return fields, count(fields)


def init_std(name: str, shape: tuple[int, ...], hidden_size: int) -> tuple[float, float]:
    """(mean, std) of a tensor's random values (module docstring: realistic routing)."""
    if name.endswith("embed_tokens.weight"):
        return 0.0, 1.0
    if name.endswith("e_score_correction_bias"):
        return 0.05, 0.02
    if "norm" in name.rsplit(".", 2)[-2] or "layernorm" in name:
        return (1.0, 0.1) if name.endswith("weight") else (0.0, 0.1)  # norm weights ~1
    if name.endswith("mlp.gate.weight"):
        return 0.0, hidden_size**-0.5
    if name.endswith("bias"):
        return 0.0, 0.1
    return 0.0, shape[-1] ** -0.5  # a linear [out, in]


def random_tensor(name: str, shape, dtype, seed: int, hidden_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    mean, std = init_std(name, shape, hidden_size)
    values = torch.randn(shape, generator=generator) * std + mean
    # the router's correction bias is fp32 in the published checkpoints, everything else bf16
    return values.to(torch.float32 if name.endswith("e_score_correction_bias") else dtype)


def write_weights(config, out_dir: Path, seed: int) -> int:
    """Random weights as bf16 safetensors shards of ~SHARD_BYTES plus their index; returns the
    number of parameters written."""
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total_bytes = num_params = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(shard, out_dir / file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            shard, shard_bytes = {}, 0

    for name, shape, dtype in checkpoint_tensors(config):
        t = random_tensor(name, shape, dtype, seed, config.hidden_size)
        shard[name] = t
        shard_bytes += t.nbytes
        total_bytes += t.nbytes
        num_params += t.numel()
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return num_params


@functools.cache
def smollm2_tokenizer():
    """SmolLM2's tokenizer (from the default model's GGUF file) with GLM's special tokens."""
    from transformers import AutoTokenizer

    from zcode.loader.checkpoint import resolve_model_path

    path = resolve_model_path(None)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # llama.cpp's GLM vocab writer looks up [gMASK], <|user|>, <|endoftext|>, <|observation|>
    specials = list(make_gguf.SPECIAL_TOKENS)
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.chat_template = make_gguf.CHAT_TEMPLATE
    tokenizer.eos_token = "<|endoftext|>"
    tokenizer.pad_token = "<|endoftext|>"
    return tokenizer


def smollm2_vocab_size() -> int:
    """The embedding rows a SmolLM2 + GLM tokenizer needs, rounded up to a multiple of 64."""
    return 64 * math.ceil(len(smollm2_tokenizer()) / 64)


def write_tokenizer(out_dir: Path, vocab_size: int) -> None:
    if vocab_size <= TINY_VOCAB_MAX:
        make_gguf.write_tokenizer(out_dir, vocab_size)
    else:
        smollm2_tokenizer().save_pretrained(out_dir)


def make_checkpoint(
    shape: str, target_params: int, out_dir: Path, vocab_size: int | None = None, seed: int = 0,
    overrides: dict | None = None,
) -> dict:  # fmt: skip
    """A random HF checkpoint of `shape` at ~target_params in out_dir; returns its facts."""
    vocab_size = vocab_size or smollm2_vocab_size()
    fields, _ = fit_config(shape, target_params, vocab_size, overrides)
    config = hf_config(fields)
    out_dir.mkdir(parents=True, exist_ok=True)
    num_params = write_weights(config, out_dir, seed)
    config.save_pretrained(out_dir)
    write_tokenizer(out_dir, vocab_size)
    dims = ("hidden_size", "num_hidden_layers", "n_routed_experts", "moe_intermediate_size")
    return {
        "path": str(out_dir),
        "params": num_params,
        "target_params": target_params,
        "config": {key: fields[key] for key in dims},
    }


def make_gguf_files(hf_dir: Path, types: list[str]) -> dict[str, Path]:
    """{type: GGUF file} beside hf_dir: bf16 / q8_0 by llama.cpp's converter, the rest
    quantized from the bf16 file by llama-quantize."""
    stem = hf_dir.parent / hf_dir.name
    converted = [t for t in types if t in make_gguf.CONVERTER_OUTTYPES]
    quantized = [t for t in types if t not in make_gguf.CONVERTER_OUTTYPES]
    if quantized and "bf16" not in converted:
        converted.append("bf16")
    paths = {t: Path(f"{stem}-{t}.gguf") for t in converted + quantized}
    make_gguf.convert(hf_dir, {t: paths[t] for t in converted})
    for t in quantized:
        make_gguf.quantize(paths["bf16"], paths[t], t)
    return paths


def experts_touched(model_path: Path, num_tokens: int = 32) -> dict:
    """Greedy-decodes num_tokens with ZCode and counts, per MoE layer, the distinct routed
    experts the decode steps (not the prompt) chose."""
    from zcode import LLM, SamplingParams
    from zcode.layers.moe import TopkRouter

    llm = LLM(str(model_path), dtype="bfloat16", kv_cache_bytes=64 << 20)
    touched: dict[str, set[int]] = {}

    def record(name: str):
        def hook(module, inputs, output) -> None:
            if inputs[0].shape[0] == 1:  # one decode row
                touched.setdefault(name, set()).update(output[1].flatten().tolist())

        return hook

    routers = {n: m for n, m in llm.model.named_modules() if isinstance(m, TopkRouter)}
    for name, router in routers.items():
        router.register_forward_hook(record(name))
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    output = llm.generate("The history of the printing press begins", params)[0]
    token_ids = list(output.token_ids)
    per_layer = [len(touched.get(name, ())) for name in routers]
    num_experts = next(iter(routers.values())).num_experts
    return {
        "decode_tokens": len(token_ids),
        "distinct_tokens": len(set(token_ids)),
        "experts": num_experts,
        "distinct_experts_per_layer": per_layer,
        "mean_distinct_experts": sum(per_layer) / max(1, len(per_layer)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("params", type=parse_count, help="target parameter count: 1.3B, 12B, ...")
    parser.add_argument("out_dir", type=Path, help="the HF directory; GGUF files go beside it")
    parser.add_argument("--types", nargs="*", default=["bf16", "q8_0", "q4_0", "q4_k_m"])
    parser.add_argument("--vocab", type=int, help="vocabulary size (default: SmolLM2 + GLM)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decode-tokens", type=int, default=32, help="0: skip the routing check")
    args = parser.parse_args()
    try:
        facts = make_checkpoint(args.shape, args.params, args.out_dir, args.vocab, args.seed)
    except ValueError as e:
        parser.error(str(e))
    if args.types:
        gguf = make_gguf_files(args.out_dir, args.types)
        facts["gguf"] = {t: str(p) for t, p in gguf.items()}
    if args.decode_tokens:
        facts["routing"] = experts_touched(args.out_dir, args.decode_tokens)
    print(json.dumps(facts, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
