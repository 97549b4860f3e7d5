"""The offline Python API: `LLM(model).generate(prompts, SamplingParams(...))`."""

from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from zcode.chat.template import render_chat
from zcode.config import EngineConfig
from zcode.distributed.config import ParallelConfig
from zcode.distributed.pipeline import split_pipeline
from zcode.distributed.shard import shard_model
from zcode.distributed.steps import join, start_rank
from zcode.engine.llm_engine import LLMEngine
from zcode.engine.request_output import RequestOutput
from zcode.errors import ValidationError
from zcode.kernels.cpp_build import build_all
from zcode.loader import load_model
from zcode.sampling_params import SamplingParams

Messages = list[dict]
Prompt = str | list[int] | Messages


class LLM:
    """A model loaded for offline generation.

    `model` is a HF directory or a .gguf file; None loads the embedded default
    (SmolLM2-135M-Instruct, Q4_1 GGUF). `dtype="auto"` (the default) runs the weights as stored:
    a GGUF file's quantized blocks memory-mapped, safetensors in their stored dtype; "float32" or
    "bfloat16" converts them at load (what the adaptive features that rewrite weights need).
    `expert_cache_gb` or `expert_cache_fraction` (MoE models loaded as stored) keeps only the most
    used routed experts in RAM; each output's `expert_cache` reports its hit rate and disk bytes
    per token (zcode.engine.expert_cache).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        sparsity: str | Path | None = None,
        tensor_parallel_size: int | None = None,
        expert_parallel: bool = False,
        pipeline_parallel_size: int | None = None,
        **engine_args,
    ) -> None:
        """`sparsity`: a calibration artifact (`zcode calibrate`) whose default plan is applied
        before the KV cache is sized, and which `max_latency_ms` plans from.
        `tensor_parallel_size`: the number of torchrun processes that split the model; on
        ranks other than 0 this constructor follows rank 0's steps and exits the process when
        rank 0 ends (zcode.distributed). `expert_parallel`: those processes hold whole MoE
        experts, a range each, instead of a slice of every expert. `pipeline_parallel_size`:
        torchrun processes that each run a range of the layers instead (same behaviour)."""
        if (tensor_parallel_size, expert_parallel, pipeline_parallel_size) != (None, False, None):
            engine_args["parallel"] = ParallelConfig(
                tensor_parallel_size=tensor_parallel_size or 1,
                expert_parallel=expert_parallel,
                pipeline_parallel_size=pipeline_parallel_size or 1,
            )
        self.config = EngineConfig(**engine_args)
        group = join(self.config, sparsity)
        dtype = self.config.torch_dtype
        if dtype is None and sparsity is not None:
            dtype = torch.float32  # sparse FFN kernels read rows of float weights
        net, self.tokenizer = load_model(model, dtype)
        if group is not None and self.config.parallel.pipeline_parallel_size > 1:
            split_pipeline(net, group)
        elif group is not None:
            shard_model(net, group, self.config.parallel.expert_parallel)
        if group is not None:
            # Now, not inside the first step: a pipeline stage waits for the earlier stages'
            # whole forward under the collective timeout, and a first build takes minutes.
            build_all()
        self.sparsity = None
        if sparsity is not None:
            from zcode.sparsity.apply import apply_default_plan

            self.sparsity = apply_default_plan(net, sparsity)
        self.engine = LLMEngine(net, self.tokenizer, self.config)
        if group is not None:
            start_rank(self.engine, group)
        # zcode.quant.variants.attach_variants sets this; generate(quality=) selects among them.
        self.precision_variants = None

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.model

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | None = None,
        enable_thinking: bool | None = None,
        max_latency_ms: float | None = None,
        quality: str | None = None,
        skip_layers: Sequence[int] = (),
        skip_kv_heads: Sequence[tuple[int, int]] = (),
    ) -> list[RequestOutput]:
        """Generates for one prompt or a batch; a prompt is text, token ids or chat messages.

        Always returns a list, one output per prompt, in order. `max_latency_ms` (needs a
        `sparsity` artifact) runs the FFN sparsity level whose predicted ms per decode step meets
        the target at the least calibrated quality loss; each output's `plan` reports the plan,
        predicted and measured ms per step. `quality` ("max", "balanced", "fast"; needs
        precision variants, zcode.quant.variants.attach_variants) runs the precision variant of
        that level for the most sensitive units; each output's `plan` names the plan that ran.
        `skip_layers` and `skip_kv_heads` (need `per_request_depth=True`) name decoder layers and
        (layer, KV head) pairs these requests never run and keep no KV for.
        """
        params = sampling_params or SamplingParams()
        token_lists = [self.encode(p, enable_thinking) for p in _as_batch(prompts)]
        skips = {"skip_layers": skip_layers, "skip_kv_heads": skip_kv_heads}
        if any(skips.values()) and (quality is not None or max_latency_ms is not None):
            raise ValidationError(
                "skip_layers and skip_kv_heads cannot be combined with quality or max_latency_ms"
            )
        if quality is not None:
            if max_latency_ms is not None:
                raise ValidationError("pass quality or max_latency_ms, not both")
            from zcode.quant.variants import generate_with_quality

            return generate_with_quality(self, token_lists, params, quality)
        if max_latency_ms is not None:
            from zcode.sparsity.planner import generate_within

            return generate_within(self, token_lists, params, max_latency_ms)
        seqs = []
        try:
            for ids in token_lists:
                seqs.append(self.engine.add_request(ids, params, **skips))
        except ValidationError:
            for seq in seqs:  # all or none: a bad prompt leaves no request behind
                self.engine.abort(seq.request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        return [finished[seq.request_id] for seq in seqs]

    def stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        enable_thinking: bool | None = None,
        **skips,
    ) -> Iterator[RequestOutput]:
        """Yields outputs for a single prompt as tokens arrive (use `delta_text`); `skips`:
        add_request's skip_layers / skip_kv_heads."""
        seq = self.engine.add_request(
            self.encode(prompt, enable_thinking), sampling_params or SamplingParams(), **skips
        )
        try:
            while not seq.is_finished:
                for out in self.engine.step():
                    if out.request_id == seq.request_id:
                        yield out
        finally:
            self.engine.abort(seq.request_id)

    def encode(self, prompt: Prompt, enable_thinking: bool | None = None) -> list[int]:
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and prompt:
            return list(prompt)
        if self.tokenizer is None:
            raise ValidationError("this checkpoint has no tokenizer: pass token ids")
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        text = self.apply_chat_template(prompt, enable_thinking=enable_thinking)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def apply_chat_template(self, messages: Messages, **kwargs) -> str:
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValidationError("this model has no chat template")
        special = {k: v for k, v in self.tokenizer.special_tokens_map.items() if isinstance(v, str)}
        return render_chat(template, messages, special_tokens=special, **kwargs)


def _as_batch(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], dict):
        return [prompts]  # one conversation
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        return [prompts]  # one tokenized prompt
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValidationError(
            "prompts must be a string, token ids, messages, or a non-empty list of them"
        )
    return list(prompts)
