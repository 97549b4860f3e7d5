"""Reasoning split at <think>/</think>: whole output and streams over any chunking agree."""

import random

import pytest

from zcode.chat.reasoning_parser import ReasoningParser, prompt_opens_reasoning

# (output, starts_in_reasoning, reasoning, content)
CASES = [
    ("<think>plan</think>answer", False, "plan", "answer"),
    ("\n<think>\nplan\n</think>\n\nanswer", False, "\nplan\n", "answer"),  # GLM-4.5 style
    ("plan</think>answer", True, "plan", "answer"),  # GLM-4.7/5: template opened <think>
    ("plan</think>\n answer\n", True, "plan", "answer\n"),
    ("</think>answer", True, None, "answer"),  # thinking off after an opened <think>
    ("</think>\nanswer", False, None, "answer"),  # GLM-4.7 thinking-off prompt ends with </think>
    ("<think></think>answer", False, None, "answer"),  # GLM-4.5 /nothink
    ("\n<think></think>\n\nanswer", False, None, "answer"),
    ("answer", False, None, "answer"),  # a model without thinking
    ("  answer", False, None, "  answer"),
    ("still thinking", True, "still thinking", ""),  # no </think>: R1-style, all reasoning
    ("<think>cut off", False, "cut off", ""),
    ("plan</think>", True, "plan", ""),
    ("plan</think>\n\n", True, "plan", ""),
    ("say <think> and </think>", False, None, "say <think> and </think>"),  # not leading: text
    ("plan</think>a </think> b", True, "plan", "a </think> b"),
    ("plan<think>more</think>x", True, "plan<think>more", "x"),
    ("<thinking>", False, None, "<thinking>"),
    ("</thin", False, None, "</thin"),  # a partial tag at the very end is flushed as text
    ("plan</thin", True, "plan</thin", ""),
    ("\n\n", False, None, "\n\n"),
    ("", False, None, ""),
    ("", True, None, ""),
]
SEEDS = range(5)


def stream(chunks: list[str], starts_in_reasoning: bool) -> tuple[str, str]:
    parser = ReasoningParser(starts_in_reasoning)
    reasoning, content = "", ""
    for chunk in chunks:
        r, c = parser.feed(chunk)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


def random_chunks(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    chunks, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        chunks.append(text[i : i + n])
        i += n
    return chunks


@pytest.mark.parametrize(("text", "starts_in_reasoning", "reasoning", "content"), CASES)
def test_split(text, starts_in_reasoning, reasoning, content):
    assert ReasoningParser.split(text, starts_in_reasoning) == (reasoning, content)


@pytest.mark.parametrize(("text", "starts_in_reasoning", "reasoning", "content"), CASES)
def test_stream_equals_split_for_any_chunking(text, starts_in_reasoning, reasoning, content):
    expected = (reasoning or "", content)
    assert stream(list(text), starts_in_reasoning) == expected
    assert stream([text], starts_in_reasoning) == expected
    for seed in SEEDS:
        assert stream(random_chunks(text, seed), starts_in_reasoning) == expected


def test_a_split_end_tag_is_held_back_then_resolved():
    parser = ReasoningParser(starts_in_reasoning=True)
    assert parser.feed("plan </th") == ("plan ", "")
    assert parser.feed("ink>") == ("", "")
    assert parser.feed("\n") == ("", "")  # whitespace after </think> waits, then is dropped
    assert parser.feed("ans") == ("", "ans")
    assert parser.feed("wer</thi") == ("", "wer</thi")  # in the content, tags are text
    assert parser.finish() == ("", "")


def test_a_false_alarm_is_released_at_once():
    parser = ReasoningParser(starts_in_reasoning=True)
    assert parser.feed("a </") == ("a ", "")
    assert parser.feed("b") == ("</b", "")


def test_a_leading_tag_is_awaited_before_choosing_a_mode():
    parser = ReasoningParser(starts_in_reasoning=False)
    assert parser.feed("\n<th") == ("", "")
    assert parser.feed("ink>") == ("", "")
    assert parser.feed("hm") == ("hm", "")
    parser = ReasoningParser(starts_in_reasoning=False)
    assert parser.feed("\n<th") == ("", "")
    assert parser.feed("e") == ("", "\n<the")


def test_custom_tags():
    assert ReasoningParser.split("a[/R]b", True, start="[R]", end="[/R]") == ("a", "b")


@pytest.mark.parametrize(
    ("prompt", "opens"),
    [
        ("[gMASK]<sop><|user|>hi<|assistant|><think>", True),  # GLM-4.7/5, thinking on
        ("[gMASK]<sop><|user|>hi<|assistant|></think>", False),  # GLM-4.7, thinking off
        ("[gMASK]<sop><|user|>\nhi<|assistant|>\n<think></think>", False),  # GLM-4.5 off
        ("[gMASK]<sop><|user|>\nhi<|assistant|>", False),  # GLM-4.5: the model writes <think>
        ("<|user|>a<|assistant|><think>r</think>b<|user|>c<|assistant|><think>", True),
        ("<|user|>a<|assistant|><think>r</think>b<|user|>c<|assistant|>", False),
        ("<|user|>what does <think> do?<|assistant|>", False),  # quoted by the user
        ("<|user|>a<|assistant|><think>prefilled thoughts", True),  # continue_final_message
        ("<|im_start|>assistant\n<think>\n", True),
        ("plain prompt", False),
    ],
)
def test_prompt_opens_reasoning(prompt, opens):
    assert prompt_opens_reasoning(prompt) is opens
