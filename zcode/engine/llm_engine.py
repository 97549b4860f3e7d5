"""The engine: a request queue and a step loop of schedule -> run -> update."""

import atexit
import dataclasses
import functools
import gc
import logging
import time
from collections.abc import Callable, Iterable

import torch
from torch import nn

from zcode.config import EngineConfig
from zcode.engine.block_manager import BlockManager, join_salts
from zcode.engine.detokenizer import IncrementalDetokenizer
from zcode.engine.expert_cache import build_expert_cache
from zcode.engine.kv_cache import KVCache, resolve_kv_dtype
from zcode.engine.model_runner import ModelRunner
from zcode.engine.request_output import RequestOutput
from zcode.engine.sampler import Sampler, top_logprobs
from zcode.engine.scheduler import ScheduledSeq, Scheduler
from zcode.engine.sequence import Sequence
from zcode.engine.step_times import StepTimes
from zcode.engine.structured_output import GrammarCompiler
from zcode.errors import RankFailure, ValidationError
from zcode.harness.plan import ExecutionPlan
from zcode.harness.report import PlanReport
from zcode.sampling_params import SamplingParams
from zcode.spec.acceptance import RunYields
from zcode.spec.drafter import make_drafter
from zcode.spec.policy import DraftPolicy

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, model: nn.Module, tokenizer, config: EngineConfig, cost_model=None) -> None:
        """`cost_model`: this machine's zcode.hardware.cost_model.CostModel for the adaptive
        draft policy (default: the one cached here, if any)."""
        self.model, self.tokenizer, self.config = model, tokenizer, config
        hf = model.config
        self.vocab_size = hf.vocab_size
        self.max_model_len = config.max_model_len or hf.max_position_embeddings
        layers = model.attention_layers()
        # The KV cache holds activations: the dtype the model computes in, whatever its weights,
        # or a narrower one (EngineConfig.kv_cache_dtype).
        dtype = resolve_kv_dtype(config.kv_cache_dtype, model)
        # Before the runner: MoE layers count routed experts in the graphs it compiles.
        self.expert_cache = build_expert_cache(model, config)
        self.drafter = None
        if config.speculative == "mtp":  # its caches share the KV's blocks and its budget
            from zcode.spec.mtp import MtpDrafter

            self.drafter = MtpDrafter(model)
            layers = layers + self.drafter.cache_owners()
        num_blocks = KVCache.num_blocks_for(config.kv_cache_bytes, layers, config.block_size, dtype)
        self.runner = ModelRunner(
            model,
            num_blocks,
            config.block_size,
            dtype,
            compile=config.compile,
            max_num_seqs=config.max_num_seqs,
            per_request_depth=config.per_request_depth,
        )
        # With pages, what fits depends on what a request skips: the scheduler checks that.
        num_blocks = self.runner.num_blocks
        self.max_model_len = min(self.max_model_len, num_blocks * config.block_size)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching, self.runner.pages
        )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens
        )
        self.sampler = Sampler()
        self.grammars = GrammarCompiler(tokenizer)
        self.eos_token_ids = _eos_ids(hf, tokenizer)
        self.sequences: dict[str, Sequence] = {}
        # zcode.harness.executor.PlanExecutor, set by LLM when the model has plans other than
        # its default (precision variants, FFN levels): requests may then name one, and each
        # step runs its rows grouped by plan, moving the model to each group's plan.
        self.executor = None
        if self.drafter is not None:
            self.drafter.attach(self.runner)
        elif config.speculative is not None:
            self.drafter = make_drafter(self.runner, config)
        self.step_times = StepTimes()  # ms of steps of one compiled graph, by its shape
        self.draft_policy, self.draft_policy_name = self._draft_policy(cost_model)
        # vLLM's spec-decode counters, running totals: steps that verified drafts, drafted
        # tokens, accepted tokens, and accepted tokens by draft position.
        self.spec_totals = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        # Draft positions verification tried: each accepted draft, and the rejected draft where
        # a step's run of them ended. Under the geometric model (each draft accepted with
        # probability a once those before it were), accepted / tried is the maximum-likelihood
        # a (the draft policy's prior for runs of drafts not yet measured); accepted per draft
        # would understate it (3 drafts at a = 0.95: 0.90 per draft).
        self.spec_totals["num_draft_trials"] = 0
        self.spec_accepted_per_pos = [0] * config.num_draft_tokens
        self.spec_yields = RunYields()  # what runs of k drafts kept, by k: the policy's prior
        self._frozen_at_compiles = -1
        self._freeze_heap()

    @property
    def num_compiles(self) -> int:
        """Graphs inductor built so far for this engine's steps and its drafter's (a self-draft
        compiles its own, zcode.spec.self_draft)."""
        caches = (self.runner.graphs, getattr(self.drafter, "graphs", None))
        return sum(graphs.num_compiles for graphs in caches if graphs is not None)

    def _freeze_heap(self) -> None:
        """Takes every object alive now (the model, its compiled graphs, the tokenizer: ~0.5M
        objects) out of the garbage collector's walks (gc.freeze, as vLLM does after start-up).
        Else each full collection walks them all: on SmolLM2's compiled decode that was ~20% of
        the main thread's time (5.3 ms a token frozen, 7.3 not). Again after a step that
        compiled graphs (its own or its drafter's). Objects that die later are freed as ever
        (reference counts); only a reference cycle among frozen objects stays, until exit (they
        are unfrozen then, so the interpreter's last collection frees them: extension types
        report leaks otherwise), or until the next freeze: it first unfreezes and collects, so an
        engine dropped since (another LLM's) is freed then."""
        compiles = self.num_compiles
        if compiles != self._frozen_at_compiles:
            gc.unfreeze()
            gc.collect()
            gc.freeze()
            self._frozen_at_compiles = compiles
            _unfreeze_at_exit()

    def _draft_policy(self, cost_model) -> tuple[DraftPolicy | None, str]:
        """The adaptive draft policy (None: every request drafts its num_draft_tokens) and how
        its reports name it."""
        if self.drafter is None or self.config.draft_policy == "fixed":
            return None, "fixed"
        if cost_model is None:
            from zcode.hardware.cost_model import CostModel

            cost_model = CostModel.cached()
        buckets = self.runner.graphs.buckets if self.runner.compiles_drafts else None
        note = None
        if cost_model is None:
            note = "fixed: no cost model is fitted on this machine (zcode hw --fit-cost)"
        elif buckets is not None and cost_model.compiled_decode is None:
            note = (
                "fixed: no cost fit of compiled steps on this machine "
                "(zcode hw --fit-cost --compiled)"
            )
        if note is not None:
            logger.info("speculative decoding drafts %s", note)
            return None, note
        draft_plan = self.drafter.cost_plan(len(self.model.model.layers))
        measured_step_ms = measured_draft_ms = None
        if buckets is not None:  # the policy prices a graph shape it has seen run by its time

            def measured_step_ms(rows: int, width: int) -> float | None:
                return self.step_times.median_ms((self.runner.plan_signature, rows, width))

            if (draft_times := getattr(self.drafter, "step_times", None)) is not None:
                measured_draft_ms = draft_times.median_ms

        policy = DraftPolicy(
            cost_model,
            self.model,
            draft_plan,
            graph_buckets=buckets,
            measured_step_ms=measured_step_ms,
            measured_draft_ms=measured_draft_ms,
            kv_paged=self.runner.pages is not None,
        )
        return policy, "adaptive"

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        skip_layers: Iterable[int] = (),
        skip_kv_heads: Iterable[tuple[int, int]] = (),
        plan: ExecutionPlan | None = None,
    ) -> Sequence:
        """cache_salt: this request shares prefix-cache blocks only with requests of the same
        salt (and of the same plan). skip_layers: decoder layers this request never runs;
        skip_kv_heads: (layer, KV head) pairs whose heads add nothing to this request's
        attention (the query heads of that group included); it keeps no KV for either (both
        need `per_request_depth`). plan: the precision and FFN level its forwards run under
        and the drafts it verifies at most (its skips are ignored: pass them as skip_layers /
        skip_kv_heads); None: the default."""
        self._validate(prompt_token_ids, params)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValidationError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        layers, heads = self.validate_skips(skip_layers, skip_kv_heads)
        plan_drafts = plan.num_draft_tokens if isinstance(plan, ExecutionPlan) else None
        num_lookahead_tokens = self._num_lookahead_tokens(params, plan_drafts)
        plan = self._request_plan(plan)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammars.matcher(params.structured_outputs)
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens
            )
        salt = _salt(plan, cache_salt, layers, heads)
        seq = Sequence(prompt_token_ids, params, detokenizer, request_id, salt, layers, heads, plan)
        seq.request_salt = cache_salt
        seq.grammar = grammar
        seq.num_lookahead_tokens = num_lookahead_tokens
        if seq.request_id in self.sequences:
            raise ValidationError(f"request id {seq.request_id!r} is already in use")
        self.sequences[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def revise(self, seq: Sequence, plan: ExecutionPlan) -> None:
        """Moves an unfinished request to `plan`, its skipped layers and KV heads included: the
        KV it holds was computed under its old plan, so it is dropped and the request's tokens
        so far, prompt and output, are computed again under the new one before it decodes on
        (as after a preemption: ahead of the waiting requests); its output stays."""
        if seq.is_finished:
            raise ValidationError(f"request {seq.request_id!r} has finished: no plan to revise")
        layers, heads = self.validate_skips(plan.skip_layers, plan.skip_kv_heads)
        num_lookahead_tokens = self._num_lookahead_tokens(seq.params, plan.num_draft_tokens)
        request_plan = self._request_plan(plan)
        if seq in self.scheduler.running:
            self.scheduler.requeue(seq)  # frees its blocks: num_computed_tokens 0
        seq.skip_layers, seq.skip_kv_heads, seq.plan = layers, heads, request_plan
        seq.cache_salt = _salt(request_plan, seq.request_salt, layers, heads)
        seq.block_hashes, seq.num_hashed_blocks = [], 0  # chained from the new salt
        seq.num_lookahead_tokens, seq.spec_token_ids = num_lookahead_tokens, []

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValidationError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValidationError(
                f"token ids out of vocabulary (size {self.vocab_size}): {bad[:5]}"
            )
        bad = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise ValidationError(
                f"logit_bias token ids out of vocabulary (size {self.vocab_size}): {bad[:5]}"
            )
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValidationError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{total} were requested ({len(prompt_token_ids)} in the prompt, "
                f"{params.max_tokens} to generate)"
            )

    def _num_lookahead_tokens(self, params: SamplingParams, plan_drafts: int | None) -> int:
        """Draft slots per step: the fewest of the engine's, the request's and its plan's."""
        limits = [params.num_draft_tokens, plan_drafts]
        limits = [n for n in limits if n is not None]
        if self.drafter is None:
            if any(limits):
                raise ValidationError(
                    "num_draft_tokens needs an engine built with speculative decoding "
                    "(speculative='ngram', 'skip_layers' or 'mtp')"
                )
            return 0
        for n in limits:
            if n > self.config.num_draft_tokens:
                raise ValidationError(
                    f"num_draft_tokens {n} is more than the engine's {self.config.num_draft_tokens}"
                )
        return min([self.config.num_draft_tokens, *limits])

    @property
    def default_plan(self) -> ExecutionPlan:
        """The plan of requests that name none (skips excluded)."""
        return ExecutionPlan() if self.executor is None else self.executor.default.without_skips()

    def _request_plan(self, plan: ExecutionPlan | None) -> ExecutionPlan | None:
        """`plan`'s model state, checked runnable; None when it is the default's."""
        if plan is None:
            return None
        if not isinstance(plan, ExecutionPlan):
            raise ValidationError(f"plan must be an ExecutionPlan, got {type(plan).__name__}")
        plan = plan.without_skips()
        if plan.signature() == self.default_plan.signature():
            return None
        if self.executor is None:
            raise ValidationError(
                "this model runs only its default plan: attach precision variants or load a "
                "sparsity artifact for others"
            )
        self.executor.check(plan)
        return plan

    def validate_skips(
        self, skip_layers: Iterable[int], skip_kv_heads: Iterable[tuple[int, int]]
    ) -> tuple[frozenset[int], frozenset[tuple[int, int]]]:
        for name, value in (("skip_layers", skip_layers), ("skip_kv_heads", skip_kv_heads)):
            if isinstance(value, (str, bytes)):
                raise ValidationError(f"{name} must be a list, not a string")
        layers = frozenset(skip_layers)
        try:
            heads = frozenset(tuple(pair) for pair in skip_kv_heads)
        except TypeError:
            raise ValidationError("skip_kv_heads must be [layer, KV head] pairs") from None
        if not layers and not heads:
            return layers, heads
        pages = self.block_manager.pages
        if pages is None:
            raise ValidationError(
                "skip_layers and skip_kv_heads need an engine built with per_request_depth=True"
            )
        num_layers = pages.num_layers
        bad = sorted(i for i in layers if not _is_index(i, num_layers))
        if bad:
            raise ValidationError(f"skip_layers out of range (the model has {num_layers}): {bad}")
        bad_heads = [
            p
            for p in heads
            if len(p) != 2
            or not _is_index(p[0], num_layers)
            or not _is_index(p[1], pages.heads_per_layer[p[0]])
        ]
        if bad_heads:
            raise ValidationError(
                f"skip_kv_heads names no (layer, KV head) of this model: {sorted(bad_heads)[:5]}"
            )
        if not pages.units(layers, heads):
            raise ValidationError("the request skips every layer or KV head: it must keep one")
        return layers, heads

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> dict:
        """A snapshot for metrics; the prefix-cache and preemption counts are running totals."""
        bm = self.block_manager
        optional = self.expert_cache.stats() if self.expert_cache is not None else {}
        if bm.pages is not None:
            optional |= {
                "num_kv_pages": bm.pages.num_pages - 1,
                "num_free_kv_pages": bm.pages.num_free_pages,
            }
        stats = optional | {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_usage": bm.usage,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_free_blocks": bm.num_free_blocks,
            "num_cached_free_blocks": bm.num_evictable_blocks,
            "num_blocks": bm.num_blocks,
            "num_graph_compiles": self.runner.num_graph_compiles,
        }
        for key, total in self.spec_totals.items():
            stats[f"spec_decode_{key}"] = total
        stats["spec_decode_num_accepted_tokens_per_pos"] = list(self.spec_accepted_per_pos)
        return stats

    def abort(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")
            self._release(seq)

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns an output for every sequence that made progress.

        A sequence whose forward pass, sampling or output fails is finished with reason "error"
        and the others carry on, so one bad request cannot wedge the engine.
        """
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        scheduled = self._draft(scheduled)
        start, compiles = time.perf_counter(), self.num_compiles
        ran, failed = [], []
        groups = self._by_plan(scheduled)
        for plan, rows in groups:
            model_state = plan.without_skips().signature()
            if self.executor is not None and model_state != self.runner.plan_signature:
                self.executor.apply(plan)  # without an executor the model runs as it is
            self._keep_decode_kernels(rows)
            rows_ran, rows_failed = _isolating_failures(self._execute, rows, lambda s: s.seq)
            ran += rows_ran
            failed += rows_failed
        if self.expert_cache is not None:
            self.expert_cache.after_step([(s.seq, s.num_new_tokens) for s in scheduled])
        outputs = [self._fail(s.seq) for s in failed] + self._update(ran)
        self._time_step(len(groups), start, compiles)
        self._freeze_heap()  # only after a step that compiled graphs
        return outputs

    def _time_step(self, num_forwards: int, start: float, compiles_before: int) -> None:
        """A step of one compiled graph (not one that compiled it) is timed by its shape, from
        its forward to its outputs: the draft policy prices steps it has seen run so, their
        verification and bookkeeping with them."""
        shape = self.runner.graph_shape
        if num_forwards == 1 and shape is not None and self.num_compiles == compiles_before:
            ms = 1e3 * (time.perf_counter() - start)
            self.step_times.record((self.runner.plan_signature, *shape), ms)

    def _by_plan(self, scheduled: list[ScheduledSeq]) -> list[tuple[ExecutionPlan, list]]:
        """The step's rows grouped by what of their plans is model state (precision; without an
        executor there is one plan), each group with its first row's plan: one forward per
        group, so requests with different plans share a step and each runs its own (the group
        of the runner's current plan first, saving a move)."""
        groups: dict[str, tuple[ExecutionPlan, list]] = {}
        default = self.default_plan
        key = ExecutionPlan.signature if self.executor is None else self.executor.group_key
        for s in scheduled:
            plan = s.seq.plan or default
            groups.setdefault(key(plan), (plan, []))[1].append(s)
        return sorted(groups.values(), key=lambda g: key(g[0]) != key(self.runner.plan))

    def _execute(self, rows: list[ScheduledSeq]) -> list[torch.Tensor]:
        """One forward of rows of one group; their FFN levels and experts per token where they
        differ."""
        settings = None
        if self.executor is not None:
            settings = self.executor.row_settings([s.seq.plan or self.default_plan for s in rows])
        return self.runner.execute(rows, settings)

    def _keep_decode_kernels(self, rows: list[ScheduledSeq]) -> None:
        """Cuts the rows' drafts to what `_kernel_keeping_drafts` allows, under the plan the
        rows run (its linears set the limit)."""
        most = self._kernel_keeping_drafts(rows, [len(s.seq.spec_token_ids) for s in rows])
        for s in rows if most is not None else ():
            del s.seq.spec_token_ids[most:]

    def _kernel_keeping_drafts(self, rows: list[ScheduledSeq], drafts: list[int]) -> int | None:
        """The most drafts a row may verify (row i would verify drafts[i]) for the verifying
        forward to run its linears on the kernel the plain step of the same rows would (the
        float GEMV up to ModelRunner.gemv_row_limit rows, F.linear above), None where any count
        does: each kernel gives a row the same bits at any row count, so greedy tokens stay
        those of plain decoding. Batch 16 of a bf16 model verifies one draft a row at most (32
        rows); 16 rows with 3 drafts each (64) had changed 9 of 16 outputs (SmolLM2 bf16,
        bench_spec's prompts, 48 tokens)."""
        limit, runner = self.runner.gemv_row_limit, self.runner
        most = max(drafts, default=0)
        if limit is None or most == 0 or runner.step_rows(rows, [0] * len(rows)) > limit:
            return None
        while most and runner.step_rows(rows, [min(d, most) for d in drafts]) > limit:
            most -= 1
        return most

    def _draft(self, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Drafts for the rows scheduled with room for them, as many as the draft policy finds
        pay; each row's lookahead slots cut to the drafts it verifies. Free drafts (n-gram
        lookup) are made first, so the policy prices the drafts a step would verify: a lookup
        finds a match or none, and a row without one costs the step nothing."""
        # The slots a row may fill: no more than the verifying step keeps on the plain step's
        # kernels (checked again per plan once the plan is applied), so neither the drafter
        # nor the policy weighs drafts that would be cut.
        most = self._kernel_keeping_drafts(scheduled, [s.num_lookahead_tokens for s in scheduled])
        if most is not None:
            scheduled = [
                dataclasses.replace(s, num_lookahead_tokens=min(s.num_lookahead_tokens, most))
                for s in scheduled
            ]
        policy = self.draft_policy
        if policy is None:
            return self._propose_drafts(scheduled)
        compiled = self.runner.runs_compiled(scheduled)
        if policy.draft_plan is not None:
            limited = policy.limit(scheduled, self.spec_totals, compiled, self.spec_yields)
            return self._propose_drafts(limited)
        scheduled = self._propose_drafts(scheduled)
        scheduled = policy.limit(scheduled, self.spec_totals, compiled, self.spec_yields)
        for s in scheduled:
            del s.seq.spec_token_ids[s.num_lookahead_tokens :]
        return scheduled

    def _propose_drafts(self, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Fills `spec_token_ids` of the sequences scheduled with room for drafts; returns
        `scheduled` with each row's slots cut to the drafts it got. Drafting is an
        optimisation: if the drafter fails, this step runs without drafts."""
        wanting = [s for s in scheduled if s.num_lookahead_tokens]
        if not wanting:
            return scheduled
        seqs = [s.seq for s in wanting]
        try:
            drafts = self.drafter.propose(seqs, [s.num_lookahead_tokens for s in wanting])
        except Exception:
            logger.exception("the drafter failed; this step runs without drafts")
            drafts = [[] for _ in wanting]
        for s, tokens in zip(wanting, drafts):
            s.seq.spec_token_ids = list(tokens[: s.num_lookahead_tokens])
        return [
            ScheduledSeq(s.seq, s.num_new_tokens, len(s.seq.spec_token_ids))
            if s.num_lookahead_tokens
            else s
            for s in scheduled
        ]

    def _update(self, ran: list[tuple[ScheduledSeq, torch.Tensor]]) -> list[RequestOutput]:
        verifying = []
        for s, seq_logits in ran:
            seq = s.seq
            if seq.wants_prompt_logprobs:
                self._record_prompt_logprobs(seq, seq_logits)
            completes = s.completes_prompt
            seq.num_computed_tokens += s.num_new_tokens  # drafts count once accepted
            if completes:
                verifying.append((seq, seq_logits[-1 - len(seq.spec_token_ids) :]))
        new_token_ids, outputs = self._accept(verifying)
        for seq, _ in verifying:
            drafts, seq.spec_token_ids = seq.spec_token_ids, []
            new = new_token_ids[seq.seq_id]
            if drafts:  # tokens stop at the first one that is not its draft
                accepted = sum(t == d for t, d in zip(new, drafts))
                self._record_acceptance(seq, len(drafts), accepted)
            if seq.finish_reason == "error":  # its output is among the failures
                continue
            if not seq.is_finished:
                self.block_manager.trim(seq)  # blocks that held only rejected drafts
            outputs.append(self._output(seq, new))
        return outputs

    def _accept(
        self, verifying: list[tuple[Sequence, torch.Tensor]]
    ) -> tuple[dict[int, list[int]], list[RequestOutput]]:
        """Samples each sequence's next tokens from its logits [1 + num_drafts, V] position by
        position, as plain decoding would (penalties, grammar and stop checks see the tokens
        kept before), keeping drafts while the sampled token is the draft, then the token
        sampled where that ended. Returns the tokens appended per sequence (seq_id) and the
        outputs of the sequences that failed."""
        new_token_ids: dict[int, list[int]] = {seq.seq_id: [] for seq, _ in verifying}
        failures = []
        active, position = verifying, 0
        while active:
            rows = [(seq, logits[position], _draft_at(seq, position)) for seq, logits in active]
            sampled, failed = _isolating_failures(self._sample, rows, lambda row: row[0])
            failures += [self._fail(seq) for seq, _, _ in failed]
            kept = set()
            for (seq, _, draft), (token, logprobs) in sampled:
                try:
                    self._append(seq, token, logprobs)
                except Exception:
                    logger.exception("request %s failed", seq.request_id)
                    failures.append(self._fail(seq))
                    continue
                new_token_ids[seq.seq_id].append(token)
                if token == draft and not seq.is_finished:
                    seq.num_computed_tokens += 1  # the draft's KV, computed this step, holds
                    kept.add(seq.seq_id)
            active = [(seq, logits) for seq, logits in active if seq.seq_id in kept]
            position += 1
        return new_token_ids, failures

    def _record_acceptance(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """A step verified `num_drafts` drafts of `seq` and kept `num_accepted`."""
        # Tried: the accepted drafts and the rejected one where their run ended (none if all
        # were kept).
        self.spec_totals["num_draft_trials"] += num_accepted + (num_accepted < num_drafts)
        seq.num_spec_steps += 1
        seq.num_draft_tokens += num_drafts
        seq.num_accepted_tokens += num_accepted
        seq.draft_yields.record(num_drafts, num_accepted)
        self.spec_yields.record(num_drafts, num_accepted)
        self.spec_totals["num_drafts"] += 1
        self.spec_totals["num_draft_tokens"] += num_drafts
        self.spec_totals["num_accepted_tokens"] += num_accepted
        for position in range(num_accepted):
            self.spec_accepted_per_pos[position] += 1

    def _sample(
        self, rows: list[tuple[Sequence, torch.Tensor, int | None]]
    ) -> list[tuple[int, dict[int, float] | None]]:
        """rows: (sequence, its logits [V], the draft at this position or None)."""
        seqs = [seq for seq, _, _ in rows]
        logits = torch.stack([logits for _, logits, _ in rows])  # [B, V]
        for row, seq in zip(logits, seqs):
            if seq.grammar is not None:
                seq.grammar.mask_(row)
        drafts = [draft for _, _, draft in rows]
        if any(draft is not None for draft in drafts):
            tokens, logprobs = self.sampler(logits, seqs, drafts)
        else:
            tokens, logprobs = self.sampler(logits, seqs)
        return list(zip(tokens, logprobs))

    def _fail(self, seq: Sequence) -> RequestOutput:
        self.scheduler.finish(seq, "error")
        self._release(seq)
        self.sequences.pop(seq.request_id, None)
        return self._output(seq, [])

    def _release(self, seq: Sequence) -> None:
        """Drops what the sampler and the draft policy keep for a finished sequence."""
        self.sampler.release(seq)
        if self.draft_policy is not None:
            self.draft_policy.forget(seq.seq_id)

    def _record_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor) -> None:
        # logits row i predicts the token after position (computed + i)
        logprobs = torch.log_softmax(logits, dim=-1)
        start = seq.num_computed_tokens
        for i in range(logits.shape[0]):
            position = start + i + 1
            # After a preemption the prompt is recomputed; record each position only once.
            if position < seq.num_prompt_tokens and position == len(seq.prompt_logprobs):
                token = seq.token_ids[position]
                seq.prompt_logprobs.append(
                    top_logprobs(logprobs[i], token, seq.params.prompt_logprobs)
                )

    def _append(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> None:
        seq.token_ids.append(token)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        if seq.detokenizer is not None:
            seq.detokenizer.add(token)
        if seq.grammar is not None:
            seq.grammar.accept(token)
        reason, stop_reason = self._stop_check(seq, token)
        if (anomaly := self.sampler.anomaly(seq)) is not None:
            reason, stop_reason = "anomaly", anomaly  # the guard's kind, in /metrics too
        if reason is not None:
            seq.stop_reason = stop_reason
            self.scheduler.finish(seq, reason)
            self._release(seq)
            self.sequences.pop(seq.request_id, None)

    def _stop_check(self, seq: Sequence, token: int) -> tuple[str | None, int | str | None]:
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop", None
        if token in p.stop_token_ids:
            return "stop", token
        if seq.grammar is not None and seq.grammar.is_finished:
            return "stop", None
        if p.stop and seq.detokenizer is not None:
            text = seq.detokenizer.output_text
            for stop in p.stop:
                index = text.find(stop)
                if index >= 0:
                    end = index + len(stop) if p.include_stop_str_in_output else index
                    seq.detokenizer.truncate(end)
                    return "stop", stop
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def _output(self, seq: Sequence, delta_token_ids: list[int]) -> RequestOutput:
        text = seq.output_text
        # While running, hold back what could still turn out to be the start of a stop string.
        hold = 0 if seq.is_finished else max((len(s) for s in seq.params.stop), default=1) - 1
        emitted = seq.emitted_text_len
        end = max(emitted, len(text) - hold)
        seq.emitted_text_len = end
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            text=text,
            token_ids=seq.output_token_ids,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            delta_text=text[emitted:end],
            delta_token_ids=delta_token_ids,
            logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
            prompt_logprobs=(
                list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None
            ),
            ttft_s=seq.first_token_time - seq.arrival_time if seq.first_token_time else None,
            expert_cache=(
                self.expert_cache.request_report(seq) if self.expert_cache is not None else None
            ),
            plan=self._spec_report(seq) if seq.num_lookahead_tokens else None,
        )

    def _spec_report(self, seq: Sequence) -> PlanReport:
        """Speculation so far; mean accepted length as vLLM's: 1 + accepted per verify step."""
        drafted, accepted, steps = seq.num_draft_tokens, seq.num_accepted_tokens, seq.num_spec_steps
        plan = seq.plan or self.default_plan
        return PlanReport(
            plan=plan.name,
            signature=plan.signature(),
            speculative={
                "method": self.config.speculative,
                "policy": self.draft_policy_name,
                "num_drafts": steps,
                "num_draft_tokens": drafted,
                "num_accepted_tokens": accepted,
                "acceptance_rate": accepted / drafted if drafted else None,
                "mean_accepted_length": 1 + accepted / steps if steps else None,
            },
        )


def _isolating_failures(fn: Callable[[list], list], items: list, seq_of: Callable) -> tuple:
    """Applies `fn` (one result per item) to all items; if that raises, to each item alone.

    Returns ([(item, result)], [items it failed on]); each failure is logged with its request.
    """
    if not items:
        return [], []
    try:
        return list(zip(items, fn(items))), []
    except RankFailure:  # the ranks no longer agree: no request can run
        raise
    except Exception:
        if len(items) == 1:
            logger.exception("request %s failed", seq_of(items[0]).request_id)
            return [], items
    done, failed = [], []
    for item in items:
        item_done, item_failed = _isolating_failures(fn, [item], seq_of)
        done += item_done
        failed += item_failed
    return done, failed


def _draft_at(seq: Sequence, position: int) -> int | None:
    drafts = seq.spec_token_ids
    return drafts[position] if position < len(drafts) else None


@functools.cache
def _unfreeze_at_exit() -> None:
    atexit.register(gc.unfreeze)


def _eos_ids(hf_config, tokenizer) -> set[int]:
    ids = getattr(hf_config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _is_index(i, size: int) -> bool:
    return isinstance(i, int) and not isinstance(i, bool) and 0 <= i < size


def _salt(
    plan: ExecutionPlan | None,
    cache_salt: str | None,
    layers: frozenset[int],
    heads: frozenset[tuple[int, int]],
) -> str:
    """A request's prefix-cache salt: KV computed under another plan or other skips is neither
    reused by nor published to it."""
    skips_salt = f"skip layers {sorted(layers)} heads {sorted(heads)}" if layers or heads else None
    plan_salt = None if plan is None else f"plan {plan.kv_signature()}"
    return join_salts(plan_salt, cache_salt, skips_salt)
