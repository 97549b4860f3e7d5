"""Prompt lookup (zcode/spec/ngram.py) against a brute-force search written from its definition:
the tokens after the latest earlier occurrence of the longest suffix of max_n .. min_n tokens."""

import random

import pytest

from zcode.spec.ngram import NgramDrafter


def brute_force(ids: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        suffix = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):  # the match ends before the last token
            if ids[start : start + n] == suffix:
                return ids[start + n : start + n + num_tokens]
    return []


@pytest.mark.parametrize(("min_n", "max_n"), [(2, 4), (1, 3), (3, 3), (1, 1)])
def test_lookup_finds_the_latest_match_of_the_longest_suffix(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    drafter = NgramDrafter(min_n, max_n)
    for _ in range(500):
        vocab = rng.choice([2, 3, 5, 50])  # small vocabularies: many, overlapping matches
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        num_tokens = rng.randrange(1, 5)
        assert drafter.lookup(ids, num_tokens) == brute_force(ids, num_tokens, min_n, max_n), ids


def test_lookup_without_a_match_drafts_nothing():
    drafter = NgramDrafter()
    assert drafter.lookup([7], 3) == []
    assert drafter.lookup([1, 2, 3, 4], 3) == []
    assert drafter.lookup([1, 2, 9, 1, 2], 3) == [9, 1, 2]
    assert drafter.propose([], []) == []
