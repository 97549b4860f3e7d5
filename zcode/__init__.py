"""ZCode: an adaptive inference harness for the GLM model family."""

from zcode.engine.request_output import RequestOutput
from zcode.llm import LLM
from zcode.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
