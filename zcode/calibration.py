"""Real text for calibration and for held-out quality measurements: Python standard-library
sources, which no one here wrote and every machine with Python has.

The two splits share no file, so a method calibrated on one split is judged on the other.
"""

import sysconfig
from pathlib import Path

SPLITS = {
    "calibration": ("textwrap.py", "argparse.py", "difflib.py", "heapq.py", "functools.py"),
    "heldout": ("json/decoder.py", "shlex.py", "fractions.py", "string.py", "calendar.py"),
}


def corpus_text(split: str) -> str:
    """The concatenated source files of one split ("calibration" or "heldout")."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "\n\n".join((stdlib / name).read_text(encoding="utf-8") for name in SPLITS[split])


def corpus_tokens(tokenizer, split: str, num_tokens: int) -> list[int]:
    """The first `num_tokens` token ids of a split (fewer if the split is shorter)."""
    return tokenizer.encode(corpus_text(split))[:num_tokens]
