"""ZCode: an adaptive inference harness for the GLM model family.

The public names load on first use, so `import zcode` (and `zcode --help`, and a Ctrl-C during
start-up) does not wait for torch and the engine.
"""

import importlib

__all__ = ["LLM", "RequestOutput", "SamplingParams"]

_HOMES = {
    "LLM": "zcode.llm",
    "RequestOutput": "zcode.engine.request_output",
    "SamplingParams": "zcode.sampling_params",
}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'zcode' has no attribute {name!r}")
