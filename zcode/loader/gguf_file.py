"""GGUF files: the metadata and tensor table, the HF config (gguf_config.py) and the tokenizer.

The metadata and tensor table are read with transformers' GGUF reader, a struct walk over a memory
map (~0.01 s for SmolLM2). `gguf.GGUFReader` builds a numpy view per metadata element and takes
~3 s on a 49k-token vocabulary, and transformers' `load_gguf_checkpoint` and
`AutoTokenizer.from_pretrained(gguf_file=...)` each ran it again. gguf_weights.py puts the
tensors into the model.
"""

import ctypes
import hashlib
import json
import shutil
import struct
import tempfile
from math import prod
from pathlib import Path
from typing import NamedTuple

import numpy as np

from zcode.errors import CheckpointError
from zcode.loader.gguf_config import gguf_config_dict


class GgufTensor(NamedTuple):
    name: str
    shape: tuple[int, ...]  # torch order
    ggml_type: int
    start: int  # byte offset in the file
    nbytes: int


class GgufContents(NamedTuple):
    metadata: dict  # string arrays (the vocabulary) are left as their length
    tensors: list[GgufTensor]
    data: np.ndarray  # the whole file, memory-mapped uint8 (copy-on-write: torch can wrap it)


def read_gguf(path: Path) -> GgufContents:
    """Metadata and tensor table, checked against the file size so that a truncated file fails
    before any tensor is read, naming the first tensor that is cut off."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    # The pinned transformers' reader, below its GgufHeader: that one sizes tensors with
    # transformers' own block table, which lacks types gguf dequantizes (Q5_0, Q5_1, ...).
    from transformers.integrations.gguf import reader

    try:
        data = np.memmap(path, mode="c", dtype=np.uint8)
        metadata, num_tensors, pos = reader._read_metadata(data, str(path))
        entries, pos = reader._read_tensor_table(data, num_tensors, pos)
    except struct.error as e:
        raise CheckpointError(f"{path}: GGUF metadata is cut short (truncated file?): {e}") from e
    except Exception as e:  # ValueError, UnicodeDecodeError, ...: not a GGUF file we can read
        raise CheckpointError(f"{path}: not a readable GGUF file: {e}") from e
    alignment = metadata.get("general.alignment", 32)
    data_start = -(-pos // alignment) * alignment
    tensors = []
    for name, shape, ggml_type, offset in entries:
        try:
            block_size, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except ValueError as e:
            raise CheckpointError(
                f"{path}: tensor {name!r} has unknown ggml type {ggml_type}"
            ) from e
        if not shape or shape[-1] % block_size:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {shape}, not whole blocks")
        tensor = GgufTensor(
            name, shape, ggml_type, data_start + offset, prod(shape) // block_size * block_bytes
        )
        if tensor.start + tensor.nbytes > len(data):
            raise CheckpointError(
                f"{path}: tensor {name!r} ends at byte {tensor.start + tensor.nbytes} but the file "
                f"has {len(data)} bytes (truncated download?)"
            )
        tensors.append(tensor)
    return GgufContents(metadata, tensors, data)


def read_gguf_config(path: Path, contents: GgufContents | None = None):
    """The HF config of a GGUF file, from our own per-architecture tables (gguf_config.py)."""
    from transformers import AutoConfig

    metadata, tensors, _ = contents or read_gguf(path)
    config = gguf_config_dict(path, metadata, {t.name for t in tensors})
    model_type = config.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **config)
    except Exception as e:
        raise CheckpointError(f"{path}: metadata does not make a valid config: {e}") from e


def load_gguf_tokenizer(path: Path, cache_dir: Path | None = None, contents=None):
    """The tokenizer the file describes (with its chat template and special tokens), built by
    transformers' GGUF converters as `AutoTokenizer.from_pretrained(gguf_file=...)` does.
    `contents`: the file's read_gguf, where the caller has it.

    Building it walks the vocabulary in Python (Gemma 3's 262k tokens: ~7 s and ~470 MB of peak
    RSS, twice the weights'), so the result is saved under `cache_dir` (default: the user cache,
    zcode/tokenizers) keyed by a hash of the file's header, which holds the whole vocabulary,
    merges, template and special tokens; later loads read that (~0.3 s). The entry's
    tokenizer_config.json lists the added tokens (`added_tokens_decoder`): without them
    transformers parses the whole tokenizer.json in Python to find them (Gemma 3: +250 MB of
    peak RSS on top of the Rust parse's +355 MB).
    """
    from transformers import PreTrainedTokenizerFast

    cached = _tokenizer_cache_dir(path, cache_dir, contents)
    if cached is not None and (cached / "tokenizer.json").is_file():
        try:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(cached), local_files_only=True)
            return _released(tokenizer)
        except Exception:  # a damaged cache entry: build it again
            shutil.rmtree(cached, ignore_errors=True)
    tokenizer = _build_gguf_tokenizer(path)
    if cached is not None:
        staging = Path(tempfile.mkdtemp(prefix=cached.name, dir=cached.parent))
        tokenizer.save_pretrained(str(staging))
        _list_added_tokens(staging / "tokenizer_config.json", tokenizer)
        try:
            staging.rename(cached)  # atomic: another process may be filling the same entry
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return _released(tokenizer)


def _list_added_tokens(config_path: Path, tokenizer) -> None:
    """Writes the tokenizer's added tokens into its saved tokenizer_config.json, as transformers
    does for tokenizers without a tokenizers backend (it leaves them out for the others)."""
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = {
        str(index): token.__getstate__() for index, token in tokenizer.added_tokens_decoder.items()
    }
    config_path.write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")


def _released(tokenizer):
    """`tokenizer`, with the heap its parse freed given back to the system: glibc keeps freed
    small blocks mapped, and a 262k-token vocabulary's JSON parse left ~290 MB resident for
    ~100 MB alive (Gemma 3: RSS 290 -> 96 MB over the imports' after malloc_trim)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc: nothing to give back this way
        pass
    return tokenizer


def _tokenizer_cache_dir(path: Path, cache_dir: Path | None, contents=None) -> Path | None:
    """The cache entry of this file's tokenizer, or None where no cache can be written."""
    from zcode.hardware.probe import default_cache_dir

    data = np.memmap(path, mode="r", dtype=np.uint8)
    tensors = (contents or read_gguf(path)).tensors
    header_bytes = min((t.start for t in tensors), default=len(data))
    # v2: entries list their added tokens (load_gguf_tokenizer)
    key = hashlib.sha256(b"v2" + data[:header_bytes].tobytes()).hexdigest()[:32]
    root = (cache_dir or default_cache_dir()) / "tokenizers"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return root / key


def _build_gguf_tokenizer(path: Path):
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    try:
        architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
        backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot build the tokenizer from its metadata: {e}") from e
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)
