"""The offline Python API: `LLM(model).generate(prompts, SamplingParams(...))`."""

import dataclasses
import logging
import math
import time
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
from zcode.harness.executor import PlanExecutor
from zcode.harness.plan import ExecutionPlan
from zcode.harness.planner import Hints, Planner, Speculation
from zcode.harness.report import DecodeSteps, LatencyFeedback, PlanReport, plan_report
from zcode.harness.revision import PlanReviser
from zcode.kernels.cpp_build import build_all
from zcode.layers.moe import moe_layers
from zcode.loader import load_model
from zcode.sampling_params import SamplingParams
from zcode.spec.policy import engine_acceptance

logger = logging.getLogger(__name__)

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
        before the KV cache is sized, and which the hints plan from; with
        `per_request_depth=True`, its routing predictor (zcode.harness.router, when calibration
        fitted one) makes the planner also search skipped-layer sets, each request's at the
        loss the router predicts from its prompt.
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
            dtype = torch.float32  # sparse FFN kernels read fp32 rows (or int8 ones made from them)
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
        # zcode.quant.variants.attach_variants sets this: the planner's precision levels.
        self.precision_variants = None
        # The hardware cost model the planner predicts ms with (zcode.hardware.cost_model);
        # None: this machine's cached fit, read when a request first has hints.
        self.cost_model = None
        self._cost_model_read = False
        self._planner: tuple[tuple, Planner] | None = None
        # Measured over predicted ms of the latest planned requests: the planner's latency scale.
        self.latency_feedback = LatencyFeedback() if self.config.latency_feedback else None
        self.router = None
        routes = self.sparsity is not None and self.sparsity.router is not None
        if routes and self.config.per_request_depth:  # a router routes per-request depths
            from zcode.harness.router import Router

            self.router = Router.from_state(self.sparsity.router)
        if self.sparsity is not None or moe_layers(net):  # a MoE's experts per token are a plan's
            self.declare_default_plan()

    def planner(self) -> Planner:
        """The planner over what this LLM has: its precision variants, sparsity artifact, KV
        paging (per_request_depth) and the cost model."""
        if self.cost_model is None and not self._cost_model_read:
            from zcode.hardware.cost_model import CostModel
            from zcode.hardware.probe import probe

            self.cost_model, self._cost_model_read = CostModel.cached(probe()), True
            if self.cost_model is not None and self.cost_model.fitted_under_load:
                from zcode.hardware.cost_model import stale_note

                logger.warning(stale_note(self.cost_model))
        policy = self.engine.draft_policy
        inputs = (self.cost_model, self.precision_variants, self.sparsity, self.router, policy)
        key = tuple(map(id, inputs))
        if self._planner is None or self._planner[0] != key:  # its candidates are memoized
            speculation = None
            if policy is not None:
                totals = self.engine.spec_totals
                speculation = Speculation(
                    policy, self.config.num_draft_tokens, lambda: engine_acceptance(totals)
                )
            planner = Planner(
                self.model,
                self.cost_model,
                self.precision_variants,
                self.sparsity,
                kv_paged=self.engine.runner.pages is not None,
                router=self.router,
                speculation=speculation,
                compiled=self._prices_compiled_steps(),
            )
            self._planner = (key, planner)
        return self._planner[1]

    def _prices_compiled_steps(self) -> bool:
        """Whether the planner prices compiled steps: the engine compiles them and the cost
        model has their fit (else it prices eager steps, slower than this engine's, and says
        so)."""
        if self.engine.runner.graphs is None or self.cost_model is None:
            return False
        if self.cost_model.compiled_decode is None:
            logger.warning(
                "this engine compiles its decode steps, but the cost model has no fit of "
                "compiled steps: plans are priced as eager steps (zcode hw --fit-cost --compiled)"
            )
            return False
        return True

    def executor(self) -> PlanExecutor:
        default = Planner(self.model, None, self.precision_variants, self.sparsity).default_plan()
        return PlanExecutor(self.engine, self.precision_variants, self.sparsity, default)

    def declare_default_plan(self) -> None:
        """Moves the model to the plan it runs without hints, declares it, and lets requests
        name other plans (after loading a sparsity artifact or attaching precision variants)."""
        executor = self.executor()
        executor.apply(executor.default)
        self.engine.executor = executor

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.model

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | None = None,
        enable_thinking: bool | None = None,
        max_latency_ms: float | None | Sequence[float | None] = None,
        max_quality_loss: float | None | Sequence[float | None] = None,
        quality: str | None | Sequence[str | None] = None,
        max_kv_bytes: int | None | Sequence[int | None] = None,
        plan: ExecutionPlan | None | Sequence[ExecutionPlan | None] = None,
        experts_per_token: int | None | Sequence[int | None] = None,
        skip_layers: Sequence[int] = (),
        skip_kv_heads: Sequence[tuple[int, int]] = (),
    ) -> list[RequestOutput]:
        """Generates for one prompt or a batch; a prompt is text, token ids or chat messages.

        Always returns a list, one output per prompt, in order. Hints, in any combination, pick
        each request's plan (zcode.harness.planner): `max_latency_ms` (predicted decode ms per
        step, by the hardware cost model), `max_quality_loss` (predicted perplexity increase,
        %), `quality` ("max", "balanced", "fast": shorthand for quality-loss budgets),
        `max_kv_bytes` (KV cache bytes per token), `plan` (an explicit ExecutionPlan: an
        override), `experts_per_token` (a MoE model's routed experts per token, its router's
        first ones: fixed, the other dimensions still planned). Each of these is one value for
        every prompt or a list of one per prompt: requests with different plans share each
        step, every one running its own plan.
        `skip_layers` and `skip_kv_heads` (need `per_request_depth=True`) fix the decoder
        layers and (layer, KV head) pairs all these requests never run and keep no KV for; the
        other dimensions are still planned. With any hint, each output's `plan` is a
        PlanReport: the plan, predicted and measured ms per token, predicted quality loss, KV
        bytes per token, the binding constraint and whether the targets are met.
        """
        params = sampling_params or SamplingParams()
        token_lists = [self.encode(p, enable_thinking) for p in _as_batch(prompts)]
        per_prompt = _per_prompt(
            len(token_lists),
            max_latency_ms=max_latency_ms,
            max_quality_loss=max_quality_loss,
            quality=quality,
            max_kv_bytes=max_kv_bytes,
            plan=plan,
            experts_per_token=experts_per_token,
        )
        layers, heads = _skips(skip_layers, skip_kv_heads)
        hints = [Hints(**fields, skip_layers=layers, skip_kv_heads=heads) for fields in per_prompt]
        self.engine.validate_skips(layers, heads)
        for h in hints:
            if h.plan is not None:
                self.engine.validate_skips(h.plan.skip_layers, h.plan.skip_kv_heads)
        if all(h == Hints() for h in hints):  # the model's default plan
            return [out for out, _ in self._run(token_lists, params, [None] * len(token_lists))]
        context_len = planning_context_len([len(ids) for ids in token_lists], params.max_tokens)
        planner, choices = self.planner(), []
        scale = self.latency_feedback.scale() if self.latency_feedback else 1.0
        embeddings = self.model.model.embed_tokens
        reviser = PlanReviser(
            self.engine, planner, self.router, embeddings, len(token_lists), context_len, scale
        )
        for i, (ids, h) in enumerate(zip(token_lists, hints)):
            routed = None
            explicit = h.plan is not None or h.skip_layers or h.skip_kv_heads
            if self.router is not None and not explicit:
                routed = self.router.predict(embeddings, ids)
            choices.append(planner.choose(h, len(token_lists), context_len, routed, scale))
            if routed is not None:
                reviser.add(i, h, choices[-1])
        outputs, ran = [], self._run(token_lists, params, [c.plan for c in choices], reviser)
        for i, ((out, steps), h, choice) in enumerate(zip(ran, hints, choices)):
            choice = reviser.choice(i) or choice
            report = dataclasses.replace(
                plan_report(choice, h, steps), revisions=reviser.revisions(i)
            )
            if self.latency_feedback is not None:
                self.latency_feedback.record(report)
            out.plan = report if out.plan is None else replace_speculative(report, out.plan)
            outputs.append(out)
        return outputs

    def _run(
        self,
        token_lists: list[list[int]],
        params: SamplingParams,
        plans: list[ExecutionPlan | None],
        reviser: PlanReviser | None = None,
    ) -> list[tuple[RequestOutput, DecodeSteps]]:
        """The one generate loop: all requests or none added, each under its plan (None: the
        default), stepped to the end; after each step `reviser` may move a routed request to
        another plan. Returns each request's output, in order, and its decode steps (those
        after every prompt is in the cache)."""
        seqs = []
        try:
            for ids, plan in zip(token_lists, plans):
                skips = (
                    {}
                    if plan is None
                    else {
                        "skip_layers": plan.skip_layers,
                        "skip_kv_heads": plan.skip_kv_heads,
                        "plan": plan,
                    }
                )
                seqs.append(self.engine.add_request(ids, params, **skips))
        except ValidationError:
            for seq in seqs:  # all or none: a bad prompt leaves no request behind
                self.engine.abort(seq.request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        steps = {seq.request_id: DecodeSteps() for seq in seqs}
        prefilled = False
        if reviser is not None:
            reviser.bind(seqs)
        while self.engine.has_unfinished():
            start = time.perf_counter()
            outs = self.engine.step()
            if reviser is not None:
                reviser.after_step()
            ms = 1e3 * (time.perf_counter() - start)
            for out in outs:
                if out.request_id not in steps:
                    continue  # a request someone else added
                if prefilled and out.delta_token_ids:
                    steps[out.request_id].add(ms, len(out.delta_token_ids))
                if out.finished:
                    finished[out.request_id] = out
            prefilled = all(s.num_computed_tokens >= s.num_prompt_tokens for s in seqs)
        return [(finished[seq.request_id], steps[seq.request_id]) for seq in seqs]

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


def _per_prompt(num_prompts: int, **hints) -> list[dict]:
    """Each hint's value per prompt: one value for all, or a list (tuple) of one per prompt."""
    columns = {}
    for name, value in hints.items():
        if isinstance(value, (list, tuple)):
            if len(value) != num_prompts:
                raise ValidationError(
                    f"{name} has {len(value)} values for {num_prompts} prompts: pass one value "
                    "or one per prompt"
                )
            columns[name] = list(value)
        else:
            columns[name] = [value] * num_prompts
    return [{name: column[i] for name, column in columns.items()} for i in range(num_prompts)]


def _skips(skip_layers, skip_kv_heads) -> tuple[tuple, tuple]:
    for name, value in (("skip_layers", skip_layers), ("skip_kv_heads", skip_kv_heads)):
        if isinstance(value, (str, bytes)):
            raise ValidationError(f"{name} must be a list, not a string")
    try:
        heads = tuple(tuple(pair) for pair in skip_kv_heads)
    except TypeError:
        raise ValidationError("skip_kv_heads must be [layer, KV head] pairs") from None
    return tuple(skip_layers), heads


def replace_speculative(report: PlanReport, engine_report: PlanReport) -> PlanReport:
    """The planner's report with the engine's speculative decoding counts."""
    return dataclasses.replace(report, speculative=engine_report.speculative)


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


def planning_context_len(prompt_lens: list[int], max_tokens: int) -> int:
    """The context a batch's plans are predicted at: its mean halfway through decoding, up to a
    power of two (so the planner's memoized candidates serve many requests)."""
    mean_len = sum(prompt_lens) / len(prompt_lens) + max_tokens / 2
    return 1 << math.ceil(math.log2(max(mean_len, 1)))
