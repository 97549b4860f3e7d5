"""The loader rejects damaged checkpoints with a CheckpointError naming the file and tensor, keeps
MTP weights, and reads GGUF metadata the way transformers does."""

import json
import shutil
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_checkpoint

from zcode.engine.kv_cache import KVCache
from zcode.forward_batch import ForwardBatch
from zcode.loader import CheckpointError, load_model, resolve_model_path
from zcode.loader.checkpoint import read_config
from zcode.loader.gguf_file import load_gguf_tokenizer


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    make_checkpoint("llama", path)
    return path


@pytest.fixture
def ckpt(llama_dir, tmp_path) -> Path:
    """A fresh copy of the tiny llama checkpoint, free to damage."""
    return Path(shutil.copytree(llama_dir, tmp_path / "ckpt"))


def _rewrite(file: Path, edit) -> None:
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _load_error(path: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        load_model(path)
    return str(info.value)


def test_intact_checkpoint_loads(ckpt):
    net, _ = load_model(ckpt)
    assert net.config.model_type == "llama"


def test_truncated_safetensors(ckpt):
    file = ckpt / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    assert str(file) in _load_error(ckpt)


def test_garbage_safetensors_header(ckpt):
    file = ckpt / "model.safetensors"
    header = b"{this is not json"
    file.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 64)
    message = _load_error(ckpt)
    assert str(file) in message and "not a readable safetensors file" in message


def test_index_names_missing_shard(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    names = sorted(tensors)
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file({n: tensors[n] for n in names[:5]}, ckpt / first)  # the second is never written
    weight_map = {n: first if i < 5 else second for i, n in enumerate(names)}
    index = ckpt / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    message = _load_error(ckpt)
    assert str(index) in message and second in message


def test_wrong_shape(ckpt):
    name = "model.layers.0.mlp.up_proj.weight"
    _rewrite(ckpt / "model.safetensors", lambda t: t.__setitem__(name, torch.zeros(3, 5)))
    message = _load_error(ckpt)
    assert str(ckpt / "model.safetensors") in message and repr(name) in message
    assert "(3, 5)" in message and "(128, 64)" in message


def test_missing_tensor(ckpt):
    name = "model.layers.1.self_attn.q_proj.weight"
    _rewrite(ckpt / "model.safetensors", lambda t: t.pop(name))
    message = _load_error(ckpt)
    assert str(ckpt) in message and name in message and "lacks 1 tensors" in message


def test_non_finite_tensor(ckpt):
    name = "model.norm.weight"

    def poison(tensors):
        tensors[name][3] = float("nan")

    _rewrite(ckpt / "model.safetensors", poison)
    message = _load_error(ckpt)
    assert repr(name) in message and "NaN or Inf" in message


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text("{ not json")
    assert str(ckpt / "config.json") in _load_error(ckpt)


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "vocab_size"])
def test_config_without_a_shape_key(ckpt, key):
    """transformers would fill the key from its class default and build some other model."""
    config = json.loads((ckpt / "config.json").read_text())
    del config[key]
    (ckpt / "config.json").write_text(json.dumps(config))
    message = _load_error(ckpt)
    assert str(ckpt / "config.json") in message and key in message


def test_unsupported_model_type(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(config | {"model_type": "bert"}))
    message = _load_error(ckpt)
    assert str(ckpt) in message and "'bert'" in message


@pytest.fixture(scope="module")
def default_gguf() -> Path:
    return resolve_model_path(None)


def test_truncated_gguf_fails_before_reading_tensors(default_gguf, tmp_path, monkeypatch):
    data = default_gguf.read_bytes()
    path = tmp_path / "model.gguf"
    path.write_bytes(data[: int(len(data) * 0.6)])

    def no_dequantize(*args):
        raise AssertionError("the truncation must be found before any tensor is read")

    monkeypatch.setattr(gguf, "dequantize", no_dequantize)
    message = _load_error(path)
    assert str(path) in message and "tensor 'blk." in message and "truncated" in message


@pytest.mark.parametrize(
    "content",
    [b"", b"hello, this is not a GGUF file\n" * 40, b"GGUF\x03\x00\x00\x00" + b"\x01" * 40],
    ids=["empty", "text", "cut-header"],
)
def test_not_a_gguf_file(tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    assert str(path) in _load_error(path)


def test_gguf_header_cut_short(default_gguf, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(default_gguf.read_bytes()[:4096])
    assert "cut short" in _load_error(path)


def test_gguf_tokenizer_keeps_template_and_special_tokens(default_gguf):
    tokenizer = load_gguf_tokenizer(default_gguf)
    assert "<|im_start|>" in tokenizer.chat_template
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer.encode("<|im_start|>user", add_special_tokens=False)[0] == 1
    text = "Hello world, café 日本語 🤖"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_gguf_tokenizer_cache_gives_back_the_built_tokenizer(default_gguf, tmp_path):
    built = load_gguf_tokenizer(default_gguf, cache_dir=tmp_path)
    [entry] = (tmp_path / "tokenizers").iterdir()
    cached = load_gguf_tokenizer(default_gguf, cache_dir=tmp_path)
    assert cached.backend_tokenizer.to_str() == built.backend_tokenizer.to_str()
    assert cached.chat_template == built.chat_template and "<|im_start|>" in cached.chat_template
    assert cached.special_tokens_map == built.special_tokens_map
    assert cached.added_tokens_decoder == built.added_tokens_decoder
    text = "Hello world, café 日本語 🤖\n<|im_start|>user"
    assert cached.encode(text) == built.encode(text)
    # A damaged entry is rebuilt, not trusted.
    (entry / "tokenizer.json").write_text("{")
    again = load_gguf_tokenizer(default_gguf, cache_dir=tmp_path)
    assert again.encode(text) == built.encode(text)
    assert again.backend_tokenizer.to_str() == built.backend_tokenizer.to_str()


def test_a_cached_tokenizer_is_not_parsed_in_python(default_gguf, tmp_path, monkeypatch):
    """The entry lists its added tokens, so transformers does not json.load the whole
    tokenizer.json to find them (Gemma 3's 262k tokens: +250 MB of peak RSS); the Rust parse
    is the only one."""
    load_gguf_tokenizer(default_gguf, cache_dir=tmp_path)
    parsed, load = [], json.load

    def spy(file, *args, **kwargs):
        parsed.append(Path(file.name).name)
        return load(file, *args, **kwargs)

    monkeypatch.setattr(json, "load", spy)
    cached = load_gguf_tokenizer(default_gguf, cache_dir=tmp_path)
    assert "tokenizer_config.json" in parsed and "tokenizer.json" not in parsed
    assert cached.encode("<|im_start|>user", add_special_tokens=False)[0] == 1


# The two below run transformers' own GGUF path, which parses the file with gguf.GGUFReader (~10 s).
@pytest.mark.slow
def test_gguf_config_matches_transformers(default_gguf):
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    reference = load_gguf_checkpoint(str(default_gguf), return_tensors=False)["config"]
    reference.pop("_model_name_or_path")
    expected = AutoConfig.for_model(reference.pop("model_type"), **reference)
    assert read_config(default_gguf).to_dict() == expected.to_dict()


@pytest.mark.slow
def test_gguf_tokenizer_matches_transformers(default_gguf):
    from transformers import AutoTokenizer

    ours = load_gguf_tokenizer(default_gguf)
    expected = AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)
    assert ours.backend_tokenizer.to_str() == expected.backend_tokenizer.to_str()
    assert ours.chat_template == expected.chat_template and "<|im_start|>" in ours.chat_template
    assert ours.special_tokens_map == expected.special_tokens_map
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_id == expected.eos_token_id
    text = "Hello world, café 日本語 🤖\n<|im_start|>user"
    assert ours.encode(text) == expected.encode(text)


def _logits(net, token_ids: list[int]) -> torch.Tensor:
    """Our model's logits for every position of one prompt, run through a fresh KV cache."""
    block_size = 16
    num_blocks = -(-len(token_ids) // block_size)
    KVCache(net.attention_layers(), num_blocks, block_size, torch.float32)
    batch = ForwardBatch.build(
        [len(token_ids)], [len(token_ids)], [list(range(num_blocks))], block_size, [len(token_ids)]
    )
    with torch.inference_mode():
        return net(torch.tensor(token_ids), batch)


def test_mtp_layer_weights_are_kept(tmp_path):
    oracle = make_checkpoint("glm_moe_dsa", tmp_path)
    num_layers = oracle.config.num_hidden_layers
    last, mtp = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    extra: dict[str, torch.Tensor] = {}

    def add_mtp_layer(tensors):
        # A decoder layer's tensors plus the MTP-only ones, as GLM checkpoints ship them.
        generator = torch.Generator().manual_seed(1)
        for name, tensor in tensors.items():
            if name.startswith(last):
                noise = torch.randn(tensor.shape, generator=generator)
                extra[mtp + name[len(last) :]] = tensor + noise
        hidden = oracle.config.hidden_size
        extra[mtp + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator)
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            extra[mtp + norm + ".weight"] = torch.randn(hidden, generator=generator)
        tensors.update(extra)

    _rewrite(tmp_path / "model.safetensors", add_mtp_layer)
    net, _ = load_model(tmp_path)
    assert set(net.mtp_weights) == set(extra)
    for name, tensor in extra.items():
        torch.testing.assert_close(net.mtp_weights[name], tensor, rtol=0, atol=0)

    token_ids = torch.randint(0, oracle.config.vocab_size, (12,), generator=torch.Generator())
    with torch.no_grad():
        expected = oracle(token_ids[None]).logits[0]
    torch.testing.assert_close(_logits(net, token_ids.tolist()), expected, rtol=1e-4, atol=1e-4)


def _write_tiny_gguf(oracle, path: Path, quantized: dict[str, gguf.GGMLQuantizationType]) -> None:
    """The tiny llama as llama.cpp's converter writes it: gguf names, q/k rows permuted for the
    interleaved RoPE, fp32 except the tensors named in `quantized`; a 256-byte vocabulary."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    c = oracle.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([bytes_to_unicode()[b] for b in range(256)])
    writer.add_token_types([1] * 256)
    writer.add_token_scores([0.0] * 256)  # no merges: transformers derives none from these
    writer.add_eos_token_id(c.eos_token_id)
    writer.add_bos_token_id(c.bos_token_id)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    for hf_name, tensor in oracle.state_dict().items():
        stem, suffix = hf_name.rsplit(".", 1)
        name = f"{name_map.get_name(stem)}.{suffix}"
        weights = tensor.numpy()
        heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}
        for proj, num_heads in heads.items():
            if proj in hf_name:  # convert_hf_to_gguf.py's LlamaModel.permute
                rows = weights.shape[0] // num_heads // 2
                weights = weights.reshape(num_heads, 2, rows, -1).swapaxes(1, 2)
                weights = weights.reshape(tensor.shape)
        if name in quantized:
            qtype = quantized[name]
            writer.add_tensor(name, gguf.quantize(weights, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_gguf_matches_transformers(llama_dir, tmp_path):
    oracle = make_checkpoint("llama", tmp_path / "hf")
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(oracle, path, quantized={})
    net, tokenizer = load_model(path)
    assert net.config.head_dim == 16 and not net.config.tie_word_embeddings
    assert tokenizer.decode(tokenizer.encode("héllo")) == "héllo"
    token_ids = list(range(3, 40, 3))
    with torch.no_grad():
        expected = oracle(torch.tensor([token_ids])).logits[0]
    torch.testing.assert_close(_logits(net, token_ids), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1", "Q8_0", "Q4_1"])
def test_gguf_quantized_tensors_are_dequantized_by_gguf(tmp_path, qtype):
    oracle = make_checkpoint("llama", tmp_path / "hf")
    qtype = gguf.GGMLQuantizationType[qtype]
    _write_tiny_gguf(oracle, tmp_path / "q.gguf", quantized={"blk.0.ffn_down.weight": qtype})
    weights = oracle.model.layers[0].mlp.down_proj.weight.detach().numpy()
    expected = torch.from_numpy(gguf.dequantize(gguf.quantize(weights, qtype), qtype))
    net, _ = load_model(tmp_path / "q.gguf", torch.float32)
    loaded = net.model.layers[0].mlp.down_proj.weight
    torch.testing.assert_close(loaded, expected, rtol=0, atol=0)
    assert not torch.equal(loaded, oracle.model.layers[0].mlp.down_proj.weight)
    native, _ = load_model(tmp_path / "q.gguf")
    packed = native.model.layers[0].mlp.down_proj.packed
    assert packed.type_name == qtype.name
    torch.testing.assert_close(packed.dequantize(), expected, rtol=0, atol=0)


def test_safetensors_load_as_views_of_the_file(ckpt):
    """dtype None keeps the stored dtype, and the weights are the file's (copy-on-write) pages."""
    net, _ = load_model(ckpt)
    weight = net.model.layers[0].self_attn.q_proj.weight
    assert weight.dtype == torch.float32
    target = str((ckpt / "model.safetensors").resolve())
    maps = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == target:
            maps.append(tuple(int(x, 16) for x in fields[0].split("-")))
    assert any(lo <= weight.data_ptr() < hi for lo, hi in maps)
    bf16, _ = load_model(ckpt, torch.bfloat16)
    assert bf16.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16


def _rss_file_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise KeyError("RssFile")


def test_released_pages_leave_a_file_views_bytes_and_anonymous_memory_alone(tmp_path):
    """zcode.loader.pages: a view of a copy-on-write file map gives its pages back (the
    process's file RSS falls) and reads the same bytes after; a copy in anonymous memory, which
    the same advice would zero, is skipped."""
    import numpy as np

    from zcode.loader import pages

    data = torch.arange(2 << 20, dtype=torch.float32)  # 8 MiB
    path = tmp_path / "weights.bin"
    data.numpy().tofile(path)
    mapped = torch.from_numpy(np.memmap(path, mode="c", dtype=np.float32))
    copy = data.clone()
    assert torch.equal(mapped, data)  # every page mapped in
    resident = _rss_file_bytes()
    pages.release([mapped, copy])
    assert _rss_file_bytes() <= resident - data.nbytes * 3 // 4
    assert torch.equal(mapped, data) and torch.equal(copy, data)
