"""A GGUF file's weights in ggml.cpp's interleaved layout, cached on disk once.

The interleaved layout (zcode/kernels/ggml.cpp; `GgufWeight.interleaved`) puts the blocks of 16
rows side by side so one VNNI instruction advances 16 rows: the GEMVs of the quantized types
(Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K) run 1.3-1.9x faster from memory. It is
the same bytes reordered, so nothing changes in what the model computes. Reordering at every
load would put the weights in anonymous memory (resident for good, no longer pages the kernel
may drop, as expert offload needs), so the first load writes them once to a cache file that
later loads memory-map as they map the GGUF:

- the cache file has the GGUF file's size, and every tensor that interleaving pays for
  (`interleaving_pays`: its type has the layout, its matrices' rows fill groups of 16, and this
  CPU has the vector kernel) lies at its offset in the GGUF file; the rest of it is a hole (a
  sparse file: no disk space);
- it is keyed by the file's content: a hash of all of it up to 256 MiB; past that, of its size,
  modification time, header (metadata and tensor table) and 64 samples of 64 KiB spread over
  the data (hashing 70 GB at every load would cost a minute); by this layout's version and by
  which tensors it holds (a build that interleaves more types writes a new entry);
- it is written to a temporary name and renamed, so a crash or a concurrent load never leaves a
  partial entry; the rows are written in chunks and the GGUF file's pages let go after each, so
  writing it raises the resident memory by a chunk, not by the file.

`ZCODE_INTERLEAVE=0` turns it off (the file's rows as stored, the row-major kernels). A cache
that cannot be written (read-only home, disk full) logs a warning and loads the rows as stored.
"""

import hashlib
import logging
import os
import time
from math import prod
from pathlib import Path

import numpy as np
import torch

from zcode.loader import pages
from zcode.loader.gguf_file import GgufContents, GgufTensor
from zcode.quant.gguf import INTERLEAVE_ROWS, interleaving_pays

log = logging.getLogger(__name__)

VERSION = 2  # of the layout and this file's format: a new version is a new key
WHOLE_HASH_BYTES = 256 << 20
NUM_SAMPLES, SAMPLE_BYTES = 64, 64 << 10
CHUNK_BYTES = 16 << 20


def enabled() -> bool:
    return os.environ.get("ZCODE_INTERLEAVE", "1") != "0"


def interleaved_tensors(contents: GgufContents) -> list[GgufTensor]:
    """The file's tensors that run interleaved here: 2-D weights and stacked experts (a matrix
    per expert) whose matrices' rows fill groups of 16."""
    return [
        t
        for t in contents.tensors
        if len(t.shape) >= 2 and interleaving_pays(t.ggml_type, t.shape[-2])
    ]


def interleaved_file(path: Path, contents: GgufContents) -> tuple[torch.Tensor | None, set[str]]:
    """(uint8 [file bytes], a memory map of the cache entry of `path`, written first if there is
    none; the names of the tensors it holds interleaved at their offsets). (None, {}) when
    disabled, when no tensor runs interleaved here, or when the entry cannot be written."""
    tensors = interleaved_tensors(contents) if enabled() else []
    if not tensors:
        return None, set()
    entry = entry_path(path, contents, tensors)
    if not entry.exists():
        try:
            _write(entry, contents, tensors)
        except OSError as e:
            log.warning("%s: cannot cache its interleaved weights (%s); running its rows", path, e)
            return None, set()
    data = np.memmap(entry, mode="c", dtype=np.uint8)
    if len(data) != len(contents.data):
        log.warning("%s: cache entry %s has the wrong size; running the rows", path, entry)
        return None, set()
    return torch.from_numpy(data), {t.name for t in tensors}


def entry_path(path: Path, contents: GgufContents, tensors: list[GgufTensor] | None = None) -> Path:
    """Where the cache entry of this file (holding `tensors`, by default those that run
    interleaved here) lies; it may not exist."""
    from zcode.hardware.probe import default_cache_dir

    tensors = interleaved_tensors(contents) if tensors is None else tensors
    return default_cache_dir() / "gguf-interleaved" / f"{_key(path, contents, tensors)}.bin"


def _key(path: Path, contents: GgufContents, tensors: list[GgufTensor]) -> str:
    # Read with read(), not through the memory map: mapped pages would count as this process's.
    size = len(contents.data)
    digest = hashlib.sha256(f"zcode-interleaved-v{VERSION}:{size}".encode())
    digest.update(",".join(sorted(t.name for t in tensors)).encode())
    with open(path, "rb") as f:
        if size <= WHOLE_HASH_BYTES:
            while chunk := f.read(SAMPLE_BYTES):
                digest.update(chunk)
            return digest.hexdigest()[:32]
        header_bytes = min(t.start for t in contents.tensors)
        digest.update(f":{os.fstat(f.fileno()).st_mtime_ns}".encode())
        digest.update(f.read(header_bytes))
        for i in range(NUM_SAMPLES):
            f.seek(header_bytes + (size - header_bytes - SAMPLE_BYTES) * i // (NUM_SAMPLES - 1))
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:32]


def _write(entry: Path, contents: GgufContents, tensors: list[GgufTensor]) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = entry.with_suffix(f".{os.getpid()}.tmp")
    total = sum(t.nbytes for t in tensors)
    log.info("interleaving %.2f GB of GGUF weights into %s (once)", total / 1e9, entry)
    start_s = time.perf_counter()
    file = torch.from_numpy(contents.data)
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, len(contents.data))  # a hole wherever no tensor is written
        for t in tensors:
            in_features, row_bytes = t.shape[-1], t.nbytes // prod(t.shape[:-1])
            rows = file[t.start : t.start + t.nbytes].view(-1, row_bytes)
            group = INTERLEAVE_ROWS
            chunk = max(group, CHUNK_BYTES // row_bytes // group * group)  # whole groups
            for r0 in range(0, rows.shape[0], chunk):
                src = rows[r0 : r0 + chunk]
                out = torch.ops.zcode.ggml_interleave(src, t.ggml_type, in_features)
                _write_all(fd, out.numpy(), t.start + r0 * row_bytes)
                pages.drop(src)  # the file's pages, read once
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        staging.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(staging, entry)
    log.info("interleaved in %.1f s", time.perf_counter() - start_s)


def _write_all(fd: int, array: np.ndarray, offset: int) -> None:
    view = memoryview(array).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
