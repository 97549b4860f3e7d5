"""Each tensor-parallel rank loads only its shard: its peak resident memory, against one process's.

A fresh process per measurement loads the model as a rank of `LLM(..., tensor_parallel_size=2)`
does (`load_model` as stored, then `shard_model` for its rank; cutting a model makes no
collective call, so no other process joins) and then reads every byte it keeps, as its forward
passes will. The figures are its peak RSS (VmHWM, reset after a first, unmeasured load that
imports everything) and its RSS right after loading, above what it held before. One process
reading the whole model is the oracle for the model's resident bytes: each of two ranks must
peak at no more than half of it plus ALLOWANCE_BYTES. Before each rank let go of the file pages
it had sliced, a rank peaked at the whole model plus its shard (1.5x).

The tokenizer is left out (every rank holds it whole: it is not weights; SmolLM2's takes ~44 MB).
"""

import ctypes
import gc
import multiprocessing
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # six processes, each loading ~100 MB twice (in .ci/run)

# The vocabulary matrices in flight while they are cut (a rank touches its rows and copies them),
# one layer's whole weights, the fp32 norms and allocator slack.
ALLOWANCE_BYTES = 16 << 20
TIMEOUT_S = 300  # a hang guard


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _load(path: str, world_size: int, rank: int) -> torch.nn.Module:
    from zcode.distributed.group import TPGroup
    from zcode.distributed.shard import shard_model
    from zcode.loader import load_model

    net, _ = load_model(path)
    if world_size > 1:
        shard_model(net, TPGroup(rank, world_size, compute=None, control=None, join=None))
    return net


def _measure(path: str, world_size: int, rank: int, queue) -> None:
    from zcode.distributed.shard import _tensors_of
    from zcode.loader import checkpoint

    checkpoint.load_gguf_tokenizer = lambda path, **_: None  # not weights (see the module's note)
    torch.set_num_threads(1)
    _load(path, world_size, rank)
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_bytes("VmRSS")
    net = _load(path, world_size, rank)
    after = _status_bytes("VmRSS")
    for tensor in _tensors_of(net):
        tensor.max()  # every page the rank keeps, as a forward pass reads it (no copy)
    queue.put((world_size, rank, _status_bytes("VmHWM") - before, after - before))


def _figures(path: Path) -> dict[tuple[int, int], tuple[int, int]]:
    """{(world_size, rank): (peak bytes, bytes after loading)} for one process and two ranks."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    runs = [(1, 0), (2, 0), (2, 1)]
    procs = [context.Process(target=_measure, args=(str(path), *run, queue)) for run in runs]
    for p in procs:
        p.start()
    figures = {}
    for _ in runs:
        world_size, rank, peak, after = queue.get(timeout=TIMEOUT_S)
        figures[world_size, rank] = (peak, after)
    for p in procs:
        p.join(TIMEOUT_S)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    return figures


@pytest.fixture(scope="module")
def safetensors_checkpoint(tmp_path_factory) -> Path:
    """A random bf16 llama of ~97 MB: 8 layers of 512, a 16k vocabulary, lm_head untied."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama-97mb")
    config = LlamaConfig(
        hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=16384, tie_word_embeddings=False, dtype="bfloat16",
    )  # fmt: skip
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    tensors = {k: (torch.randn(s, generator=g) * 0.02).bfloat16() for k, s in shapes.items()}
    save_file(tensors, str(path / "model.safetensors"))
    config.save_pretrained(path)
    return path


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_each_rank_peaks_at_half_the_model(fmt, request):
    if fmt == "gguf":  # SmolLM2-135M, Q4_1: 9 query heads in 3 KV groups split 6 + 3
        path = request.getfixturevalue("default_model_path")
    else:
        path = request.getfixturevalue("safetensors_checkpoint")
    figures = _figures(path)
    print(f"{fmt}: {{(world_size, rank): (peak bytes, bytes after load)}} = {figures}")
    one_peak = figures[1, 0][0]
    file_bytes = sum(f.stat().st_size for f in ([path] if path.is_file() else path.iterdir()))
    assert one_peak >= 0.9 * file_bytes, "one process must hold (about) the whole model"
    for rank in (0, 1):
        peak, after = figures[2, rank]
        assert after <= peak <= one_peak / 2 + ALLOWANCE_BYTES, (rank, figures)
