"""GGUF files as users have them, from small random GLM checkpoints.

    python scripts/make_gguf.py glm4 out/ --types f32 f16 q8_0 q4_k_m
    python scripts/make_gguf.py glm4_moe out/ --kquant-dims --types q4_k_m
    python scripts/make_gguf.py glm4 out/ --hidden 1024 --layers 8 --types q4_k_m

1. A random HF checkpoint from tests/tiny_models.py's configs (transformers' own config classes),
   with a small byte-level BPE tokenizer holding the GLM special tokens llama.cpp's GLM vocab
   writer looks up ([gMASK], <sop>, <|endoftext|>, <|user|>, ...), vocabulary size = the config's.
2. llama.cpp's `convert_hf_to_gguf.py` (from the llama-cpp-python 0.3.36 sdist) writes F32 / F16 /
   Q8_0. Its pre-tokenizer check hashes the tokenization of a fixed text to recognise a known
   tokenizer; ours is unknown, so the converter runs with that check answering 'glm4'.
3. `llama_cpp.llama_model_quantize` turns the F32 file into Q4_K_M, Q4_0, ...

K-quants hold rows of whole 256-value blocks; llama-quantize falls back to another type for a
tensor whose rows are not (the tiny configs' 64-wide hidden). `kquant_dims` widens the config so
that most weights are whole blocks; `tensor_types(path)` reports what each file really holds.
"""

import argparse
import json
import os
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LCP_VERSION = "0.3.36"
SDIST_DIRS = (
    Path("/tmp/lcp") / f"llama_cpp_python-{LCP_VERSION}",
    Path.home() / ".cache" / "zcode" / "llama-cpp-python" / f"llama_cpp_python-{LCP_VERSION}",
)
CONVERTER_OUTTYPES = ("f32", "f16", "bf16", "q8_0")
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
)
CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Wider dims so that K-quant files hold Q4_K / Q6_K tensors: most rows are whole 256-blocks.
KQUANT_DIMS = {
    "glm4": dict(hidden_size=256, intermediate_size=512, head_dim=64),
    "glm4_moe": dict(
        hidden_size=256, intermediate_size=512, head_dim=64, moe_intermediate_size=256
    ),
    "glm_moe_dsa": dict(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=256,
        v_head_dim=64,
        # llama.cpp rotates the indexer's q and k by a Hadamard matrix of at least 64 x 64
        index_head_dim=64,
        # GlmMoeDsaConfig defaults to 0.5, which the converter writes as a rope dimension count
        # that llama.cpp's glm-dsa loader refuses (kv_a_mqa rows = kv_lora_rank + rope dims)
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 1.0,
        },
    ),
}


def llama_cpp_dir() -> Path:
    """The llama.cpp tree of the llama-cpp-python sdist, downloaded and unpacked if need be."""
    for path in SDIST_DIRS:
        if (path / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").is_file():
            return path / "vendor" / "llama.cpp"
    cache = SDIST_DIRS[-1].parent
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        + ["-d", str(cache), f"llama-cpp-python=={LCP_VERSION}"],
        check=True,
    )
    with tarfile.open(cache / f"llama_cpp_python-{LCP_VERSION}.tar.gz") as tar:
        tar.extractall(cache, filter="data")
    return SDIST_DIRS[-1] / "vendor" / "llama.cpp"


def model_config(name: str, kquant_dims: bool = False, hidden=None, layers=None):
    """tests/tiny_models.py's config `name`, optionally widened or resized."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import configs

    config = configs()[name]
    overrides = dict(KQUANT_DIMS.get(config.model_type, {})) if kquant_dims else {}
    if hidden is not None:
        heads = config.num_attention_heads
        overrides.update(hidden_size=hidden, intermediate_size=4 * hidden)
        if config.model_type != "glm_moe_dsa":
            overrides["head_dim"] = hidden // heads
        if hasattr(config, "moe_intermediate_size"):
            overrides["moe_intermediate_size"] = hidden
    if layers is not None:
        overrides["num_hidden_layers"] = layers
    if not overrides:
        return config
    fields = config.to_dict()
    if layers is not None:
        for key in ("layer_types", "mlp_layer_types", "indexer_types"):
            fields.pop(key, None)
    return type(config)(**{**fields, **overrides})


def write_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A byte-level BPE of `vocab_size` tokens: bytes, a few merges, the GLM special tokens last."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r")]
    num_chars = vocab_size - len(SPECIAL_TOKENS) - len(merges)
    chars = pre_tokenizers.ByteLevel.alphabet()
    # Printable ASCII (and the byte-level space 'Ġ') first, so that plain text stays in the vocab.
    chars = sorted(chars, key=lambda c: (not (c.isascii() or c == "Ġ"), ord(c)))[:num_chars]
    vocab = {c: i for i, c in enumerate(chars)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(out_dir)


def make_hf_checkpoint(config, out_dir: Path, seed: int = 0):
    """Random weights (norms and router bias perturbed, as tiny_models does) + tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand_like(buf) * 0.1)
        for name, param in model.named_parameters():
            if "layernorm" in name or "norm" in name.split(".")[-2]:
                param.add_(torch.randn_like(param) * 0.1)
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    write_tokenizer(out_dir, config.vocab_size)
    return model


_CONVERT = """
import sys
sys.path.insert(0, sys.argv.pop(1))
import convert_hf_to_gguf
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "glm4"
convert_hf_to_gguf.main()
"""


def convert(hf_dir: Path, outputs: dict[str, Path]) -> None:
    """llama.cpp's converter on an HF directory, once per {outtype: file}, the runs in parallel."""
    if bad := set(outputs) - set(CONVERTER_OUTTYPES):
        raise ValueError(f"the converter writes {CONVERTER_OUTTYPES}, not {sorted(bad)}")
    src = llama_cpp_dir()
    # without NO_LOCAL_GGUF the converter uses the sdist's own gguf-py, the one it was written for
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", _CONVERT, str(src), str(hf_dir)]
            + ["--outtype", outtype, "--outfile", str(path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for outtype, path in outputs.items()
    ]
    errors = [run.communicate()[1] for run in runs]
    for run, err in zip(runs, errors, strict=True):
        if run.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf failed:\n{err[-4000:]}")


def quantize(src: Path, out_path: Path, qtype: str) -> Path:
    """llama-quantize (through llama_cpp) to `qtype`, e.g. 'q4_k_m', 'q4_0'."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype.upper()}")
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out_path).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {src} -> {qtype} failed ({rc})")
    return out_path


def tensor_types(path: Path) -> dict[str, int]:
    """ggml type name -> number of tensors of that type in the file."""
    from gguf import GGUFReader

    return dict(Counter(t.tensor_type.name for t in GGUFReader(path).tensors))


def make_gguf_files(
    name: str,
    out_dir: Path,
    types: tuple[str, ...] = ("f32", "f16"),
    kquant_dims: bool = False,
    hidden: int | None = None,
    layers: int | None = None,
) -> dict[str, Path]:
    """HF checkpoint `out_dir/hf` and one GGUF file per type; returns {'hf': dir, type: file}."""
    config = model_config(name, kquant_dims, hidden, layers)
    out_dir = Path(out_dir)
    paths: dict[str, Path] = {"hf": out_dir / "hf"}
    make_hf_checkpoint(config, paths["hf"])
    converted = [t for t in types if t in CONVERTER_OUTTYPES]
    quantized = [t for t in types if t not in CONVERTER_OUTTYPES]
    if quantized and "f32" not in converted:
        converted.append("f32")
    paths.update({t: out_dir / f"{name}-{t}.gguf" for t in converted + quantized})
    convert(paths["hf"], {t: paths[t] for t in converted})
    for t in quantized:
        quantize(paths["f32"], paths[t], t)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="a tests/tiny_models.py config: glm4, glm4_moe, glm_moe_dsa")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--types", nargs="+", default=["f32", "f16", "q8_0", "q4_k_m"])
    parser.add_argument("--kquant-dims", action="store_true", help="widen dims for K-quants")
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--layers", type=int)
    args = parser.parse_args()
    paths = make_gguf_files(
        args.name, args.out_dir, tuple(args.types), args.kquant_dims, args.hidden, args.layers
    )
    report = {k: (str(p), tensor_types(p) if k != "hf" else None) for k, p in paths.items()}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
