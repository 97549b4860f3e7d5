"""Pages of the checkpoint files the loaders memory-map: madvise on whole pages, and letting go
of a tensor's pages once a loader or a tensor-parallel shard is done with them.

The loaders map files copy-on-write and never write to the mapping, so its pages hold exactly the
file's bytes: MADV_DONTNEED loses nothing there. This process's page-table entries go (its RSS
drops), the page cache keeps the data (another rank reading the same file shares it), and a later
touch maps the page again. On anonymous memory the same advice zeroes the data, so `release`
advises only tensors that lie wholly inside a private file mapping (/proc/self/maps).
"""

import bisect
import ctypes
import os
from collections.abc import Iterable

import torch

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
MADV_RANDOM, MADV_WILLNEED, MADV_DONTNEED = 1, 3, 4  # <sys/mman.h> on Linux
MLOCK_ONFAULT = 1
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
libc.mlock2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def whole_pages(address: int, num_bytes: int) -> tuple[int, int]:
    """[start, end) of the pages wholly inside the range: a page shared with a neighbouring
    tensor is left alone."""
    start = -(-address // PAGE_BYTES) * PAGE_BYTES
    end = (address + num_bytes) // PAGE_BYTES * PAGE_BYTES
    return start, max(start, end)


def madvise(address: int, num_bytes: int, advice: int) -> None:
    """The advice on the whole pages of the range."""
    start, end = whole_pages(address, num_bytes)
    if end > start and libc.madvise(start, end - start, advice) != 0:
        raise OSError(ctypes.get_errno(), f"madvise({advice}) on a checkpoint's pages")


def drop(tensor: torch.Tensor) -> None:
    """Lets go of this process's pages of `tensor`, which must be a view of a private file
    mapping that nothing wrote to (the caller knows it is)."""
    start, end = _extent(tensor)
    madvise(start, end - start, MADV_DONTNEED)


def release(tensors: Iterable[torch.Tensor]) -> None:
    """`drop` for each of `tensors` that lies wholly inside a private file mapping; the others
    (copies, in anonymous memory) are left alone."""
    spans = _private_file_mappings()
    starts = [start for start, _ in spans]
    for tensor in tensors:
        start, end = _extent(tensor)
        i = bisect.bisect_right(starts, start) - 1
        if end > start and i >= 0 and end <= spans[i][1]:
            madvise(start, end - start, MADV_DONTNEED)


def _extent(tensor: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte addresses of the elements of `tensor` (any strides >= 0)."""
    if tensor.numel() == 0:
        return 0, 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.data_ptr(), tensor.data_ptr() + (last + 1) * tensor.element_size()


def _private_file_mappings() -> list[tuple[int, int]]:
    """[start, end) of this process's private mappings of files, sorted."""
    spans = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[1][3] == "p" and fields[4] != "0":
                start, end = (int(x, 16) for x in fields[0].split("-"))
                spans.append((start, end))
    return sorted(spans)
