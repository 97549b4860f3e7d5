"""Streaming detokenization with the real SmolLM2 byte-level BPE: multi-byte characters split
across tokens must come out whole."""

import pytest

from zcode.engine.detokenizer import IncrementalDetokenizer
from zcode.loader.checkpoint import resolve_model_path
from zcode.loader.gguf_file import load_gguf_tokenizer

TEXTS = [
    "Hello, world!",
    "Café au lait, naïve façade, Ærøskøbing, Straße.",
    "日本語のテキストと中文字符，还有한국어.",
    "Emoji: 🤖🚀 👩‍👩‍👧 🇫🇷 and ✨sparkles✨",
    "Mixed 😀 café 北京 ok\n\ttabs and  spaces  ",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_gguf_tokenizer(resolve_model_path(None))


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", ["Say something:", "é"])
def test_streamed_deltas_are_whole_characters(tokenizer, text, prompt):
    token_ids = tokenizer.encode(text)
    assert len(token_ids) > 1
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt))
    deltas = [detokenizer.add(t) for t in token_ids]
    assert "".join(deltas) == tokenizer.decode(token_ids) == text
    assert detokenizer.output_text == text
    assert not any("\ufffd" in delta for delta in deltas)


def test_a_character_split_across_tokens_is_held_back(tokenizer):
    token_ids = tokenizer.encode("🤖")
    assert len(token_ids) > 1  # byte-level BPE has no single token for it
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Robot:"))
    assert [detokenizer.add(t) for t in token_ids] == [""] * (len(token_ids) - 1) + ["🤖"]


def test_special_tokens_are_skipped_unless_asked_for(tokenizer):
    token_ids = tokenizer.encode("Hi<|im_end|>")
    prompt = tokenizer.encode("x")
    skipping = IncrementalDetokenizer(tokenizer, prompt)
    keeping = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=False)
    assert "".join(skipping.add(t) for t in token_ids) == "Hi"
    assert "".join(keeping.add(t) for t in token_ids) == "Hi<|im_end|>"
