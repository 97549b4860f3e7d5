"""Prompt lookup (n-gram) drafting: the tokens that followed the latest earlier occurrence of a
sequence's last n tokens (Saxena's prompt lookup decoding; vLLM's `ngram` method).

Free to run and deterministic; it pays where outputs copy their context, as in code editing.
"""

import numpy as np

from zcode.engine.sequence import Sequence
from zcode.spec.drafter import Drafter


class NgramDrafter(Drafter):
    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        """Matches of the last `max_n` tokens are tried first, down to `min_n`."""
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], max_num_tokens: list[int]) -> list[list[int]]:
        return [
            self.lookup(seq.token_ids, n) if n > 0 else [] for seq, n in zip(seqs, max_num_tokens)
        ]

    def lookup(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens after the latest earlier match of the longest suffix."""
        ids = np.asarray(token_ids, dtype=np.int64)
        # Ends of earlier matches of the last n tokens, n = 1, 2, ...: each n keeps the ends
        # of n - 1 whose n-th token back matches too (one compare over the context, then only
        # the candidates: ~15-20 us a row of 600 tokens, where comparing every window for each n
        # took ~95).
        ends = np.flatnonzero(ids[:-1] == ids[-1])
        latest = ends[-1] if self.min_n == 1 and ends.size else None
        for n in range(2, min(self.max_n, len(ids) - 1) + 1):
            ends = ends[ends >= n - 1]
            ends = ends[ids[ends - (n - 1)] == ids[-n]]
            if not ends.size:
                break
            if n >= self.min_n:
                latest = ends[-1]
        if latest is None:
            return []
        return ids[latest + 1 : latest + 1 + num_tokens].tolist()
