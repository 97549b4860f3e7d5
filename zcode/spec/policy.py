"""How many tokens each request drafts in a step: as many as pay, by the acceptance measured so
far and the hardware cost model; none where speculation does not pay (e.g. large batches).

A step of B sampling sequences that verifies k_i drafts for request i computes N0 + sum k_i
tokens (N0: the step's tokens without drafts) and is expected to yield B + sum_i E_i(k_i)
tokens, E_i(k) the drafts request i is expected to keep of a run of k (below). The policy picks
the k_i that maximise expected tokens per ms,

    (B + sum_i E_i(k_i)) / (step_ms(N0 + sum_i k_i) + draft_ms(k))

step_ms from the cost model's decode coefficients (`CostModel.predict_step_ms`), draft_ms the
drafter's: a draft step over the rows still drafting, costed as the decode step of the
drafter's `cost_plan()` (n-gram lookup: free). In an engine that compiles its steps, a step is
priced as the graph that runs it: by the coefficients fitted on compiled steps, its rows padded
to the batch bucket and each row to the step's query width (a power of two at least 1 + the
most drafts of a row), so a third draft costs what a fourth does. A graph shape the engine has
run is priced by its measured time instead (the median of its latest steps, forward to
outputs: LLMEngine.step_times; a self-draft's steps: SelfDrafter.step_times): the fit
extrapolates from a few layers and shapes, and a few percent off on the plain and the
verifying step made drafting look like a gain where it lost (n-gram at batch 4: +25%
predicted, -4% measured; at batch 16 the fit priced a 4-wide graph at 69 ms, which took
111-124, its 64 rows past the GEMV's 16 on oneDNN). A shape not run yet is priced by the fit,
scaled by what the plain step of its rows measured over its price; if that flatters it, a few
steps' drafting measure it.
Where a verifying shape has run and the plain one not (an engine that drafted from its first
step), steps run without drafts until the plain one is measured too.

Drafts are added one at a time, the one that adds most expected tokens first (request i's
next draft adds E_i(k_i + 1) - E_i(k_i)); the best rate seen along that path wins, so a draft
cost that pays only from the second draft on is not refused at the first.

A free drafter (n-gram lookup: `draft_plan` None) drafts before the policy chooses
(LLMEngine._draft), so each request's most drafts are those it got: a lookup finds a match or
none, and a request without one costs the step nothing.
E_i(k): what request i's own runs of k drafts kept on average, shrunk toward what the engine's
runs of k kept (zcode.spec.acceptance.RunYields), itself shrunk toward E(a, k) = a + a^2 + ...
+ a^k of the engine's acceptance rate a: its accepted tokens per draft position tried
(`LLMEngine.spec_totals["num_draft_trials"]`: the accepted drafts and, in each step, the
rejected draft where their run ended), shrunk toward PRIOR_ACCEPTANCE before much was
measured, and taken EXPLORE_Z standard errors high (an upper confidence bound, as a bandit
explores): a drafter whose acceptance is not yet known gets tried (a W4A8 self-draft pays only
from a ~ 0.85 on, and a new engine knows 0.5), and the optimism fades as trials accumulate.
A request held at no drafts still drafts one token every PROBE_EVERY steps, so its estimate can
recover when its text turns predictable; less often where a probe costs more than PROBE_BUDGET
of the plain steps between probes (at batch 16 a step verifying one draft a row costs ~2 plain
steps, so probing every 16th step costs ~6% of the decode time). The held requests probe
together, in one step: a compiled step verifies every row at one width, so one request's probe
widens the whole step, and 16 requests probing in 16 different steps cost 16 widened steps.
"""

import heapq
import math
from collections.abc import Callable

from torch import nn

from zcode.engine.graph_cache import graph_width
from zcode.engine.scheduler import ScheduledSeq
from zcode.harness.plan import ExecutionPlan
from zcode.spec.acceptance import RunYields, geometric

PRIOR_ACCEPTANCE = 0.5
PRIOR_TOKENS = 8
PROBE_EVERY = 16
PROBE_BUDGET = 0.02  # the most a held request's probes cost, over the plain steps between them
EXPLORE_Z = 2.0
MAX_ACCEPTANCE = 0.98  # E(a, k) grows without bound as a -> 1: no estimate is that sure
CONTEXT_BUCKET = 256  # contexts are costed rounded up to this many tokens


def expected_accepted(acceptance: float, num_drafts: int) -> float:
    """E(a, k) = a + a^2 + ... + a^k: the expected accepted drafts of k."""
    return geometric(acceptance, num_drafts)[-1]


class DraftPolicy:
    def __init__(
        self,
        cost_model,
        model: nn.Module,
        draft_plan: ExecutionPlan | None,
        plan=None,
        graph_buckets: list[int] | None = None,
        measured_step_ms: Callable[[int, int], float | None] | None = None,
        measured_draft_ms: Callable[[int], float | None] | None = None,
        kv_paged: bool = False,
    ) -> None:
        """`cost_model`: a fitted zcode.hardware.cost_model.CostModel; `draft_plan`: the plan
        whose decode step costs what one draft step does (None: drafting is free); `plan`: the
        plan the verifying steps run (None: the model as loaded); `graph_buckets`: the batch
        buckets of an engine whose decode, verifying and draft steps are compiled graphs
        (GraphCache.buckets; the cost model then needs its compiled fit), None: eager steps.
        `measured_step_ms(rows, width)`, `measured_draft_ms(rows)`: the measured ms of the
        verifying (or plain) graph and of the draft graph at that shape, None where not run yet
        (zcode.engine.step_times; None: nothing measured); `kv_paged`: the engine keeps KV
        per head (its steps gather each layer's pages)."""
        self.cost, self.model, self.kv_paged = cost_model, model, kv_paged
        self.draft_plan, self.plan = draft_plan, plan
        self.graph_buckets = graph_buckets
        self.measured_step_ms = measured_step_ms or _not_measured
        self.measured_draft_ms = measured_draft_ms or _not_measured
        self.steps_without_drafts: dict[int, int] = {}  # seq_id -> steps since it last drafted
        self.steps_since_probes = 0  # steps since the last step in which held requests probed
        self._ms: dict[tuple, float] = {}
        self._signatures: dict[int, tuple] = {}  # id(plan) -> (plan, its signature)

    def limit(
        self,
        scheduled: list[ScheduledSeq],
        engine_totals: dict[str, int],
        compiled: bool = False,
        engine_yields: RunYields | None = None,
    ) -> list[ScheduledSeq]:
        """`scheduled` with each adaptive request's draft slots cut to the number that pays
        (requests that set num_draft_tokens keep theirs). `engine_totals`: the engine's
        num_draft_trials / num_accepted_tokens so far; `compiled`: the step runs as one compiled
        graph (ModelRunner.runs_compiled); `engine_yields`: what the engine's runs of drafts
        kept (None: nothing measured)."""
        adaptive = [
            i
            for i, s in enumerate(scheduled)
            if s.num_lookahead_tokens and s.seq.params.num_draft_tokens is None
        ]
        if not adaptive:
            return scheduled
        prior = geometric(
            exploring_acceptance(engine_totals), max(s.num_lookahead_tokens for s in scheduled)
        )
        if engine_yields is not None:
            prior = engine_yields.expected(prior)
        curves = [scheduled[i].seq.draft_yields.expected(prior) for i in adaptive]
        others = [s for i, s in enumerate(scheduled) if i not in adaptive]
        fixed_drafts = [s.num_lookahead_tokens for s in others if s.num_lookahead_tokens]
        context_len = max(s.seq.num_tokens for s in scheduled)
        drafts = self.choose(
            curves,
            [scheduled[i].num_lookahead_tokens for i in adaptive],
            num_tokens=sum(s.num_new_tokens for s in scheduled) + sum(fixed_drafts),
            num_seqs=len(scheduled),
            context_len=context_len,
            base_yield=sum(s.completes_prompt for s in scheduled)
            + sum(prior[k] for k in fixed_drafts),
            fixed_drafts=fixed_drafts,
            compiled=compiled,
        )
        self.steps_since_probes += 1
        out, probing = list(scheduled), None
        for i, k in zip(adaptive, drafts):
            seq_id = scheduled[i].seq.seq_id
            idle = self.steps_without_drafts.get(seq_id, 0)
            if k == 0 and idle + 1 >= PROBE_EVERY:
                if probing is None:  # is this the probe step?
                    every = self.probe_every(len(scheduled), context_len, compiled)
                    probing = self.steps_since_probes >= every
                if probing:
                    k = 1  # a probe: without drafts, nothing would ever be measured again
            self.steps_without_drafts[seq_id] = 0 if k else idle + 1
            out[i] = ScheduledSeq(scheduled[i].seq, scheduled[i].num_new_tokens, k)
        if probing:
            self.steps_since_probes = 0
        return out

    def probe_every(self, num_seqs: int, context_len: int, compiled: bool = False) -> int:
        """Steps between the probes of a request held at no drafts, in a step of `num_seqs`
        sequences: PROBE_EVERY, or as many more as keep a probe's extra time (a step verifying
        one draft a row, and its draft step, over a plain step) within PROBE_BUDGET of the
        plain steps between probes."""
        compiled = compiled and self.graph_buckets is not None
        context = _bucket(context_len)
        width, plain_width = (2, 1) if compiled else (None, None)
        plain_ms = self._step_ms(num_seqs, num_seqs, context, width=plain_width, measured=True)
        probe_ms = self._step_ms(2 * num_seqs, num_seqs, context, width=width, measured=True)
        probe_ms += self._draft_ms([num_seqs], context, compiled, measured=True)
        return max(PROBE_EVERY, math.ceil((probe_ms - plain_ms) / (PROBE_BUDGET * plain_ms)))

    def forget(self, seq_id: int) -> None:
        self.steps_without_drafts.pop(seq_id, None)

    def choose(
        self,
        curves: list[list[float]],
        max_drafts: list[int],
        *,
        num_tokens: int,
        num_seqs: int,
        context_len: int,
        base_yield: float,
        fixed_drafts: list[int] = (),
        compiled: bool = False,
    ) -> list[int]:
        """Drafts per adaptive request (at most `max_drafts` each; curves[i][k]: the drafts
        request i is expected to keep of a run of k, k = 0 .. max_drafts[i]) that maximise
        expected tokens per ms in a step that, without them, computes `num_tokens` tokens over
        `num_seqs` sequences and yields `base_yield` tokens; `fixed_drafts`: the draft counts
        of requests that set theirs (their drafting costs too); `compiled`: the step and the
        drafts run as compiled graphs (priced so where graph_buckets is set)."""
        compiled = compiled and self.graph_buckets is not None
        context = _bucket(context_len)
        drafts = [0] * len(curves)
        if compiled and not fixed_drafts and self._plain_step_unmeasured(num_seqs):
            return drafts  # a plain step, measured, before drafts are weighed against it
        # rows[j]: the requests drafting a j-th token, which draft step j runs
        rows = [0] * max([*max_drafts, *fixed_drafts, 0])
        for k in fixed_drafts:
            for j in range(k):
                rows[j] += 1
        tokens, num_drafted = base_yield, 0

        def tokens_per_ms() -> float:
            width = 1 + max([*drafts, *fixed_drafts, 0]) if compiled else None
            ms = self._step_ms(
                num_tokens + num_drafted, num_seqs, context, width=width, measured=True
            )
            return tokens / (ms + self._draft_ms(rows, context, compiled, measured=True))

        best, best_rate = list(drafts), tokens_per_ms()

        def next_gain(i: int) -> float:  # what request i's next draft adds to its expected yield
            return curves[i][drafts[i] + 1] - curves[i][drafts[i]]

        heap = [(-next_gain(i), i) for i in range(len(curves)) if max_drafts[i] > 0]
        heapq.heapify(heap)
        while heap:
            neg_gain, i = heapq.heappop(heap)
            rows[drafts[i]] += 1
            drafts[i] += 1
            tokens, num_drafted = tokens - neg_gain, num_drafted + 1
            if drafts[i] < max_drafts[i]:
                heapq.heappush(heap, (-next_gain(i), i))
            if (rate := tokens_per_ms()) > best_rate:
                best, best_rate = list(drafts), rate
        return best

    def predicted_gain(
        self,
        acceptance: float,
        num_drafts: int,
        *,
        num_seqs: int = 1,
        context_len: int = 512,
        plan: ExecutionPlan | None = None,
        modules: dict | None = None,
    ) -> float:
        """Predicted decode speed with `num_drafts` drafts per request at this acceptance rate,
        over plain decoding's, for a batch of `num_seqs` decoding requests (compiled steps
        where the engine compiles). `plan`, `modules`: the verifying steps' plan and the
        precision modules it runs (CostModel.predict_step_ms; default: the policy's plan)."""
        compiled = self.graph_buckets is not None
        verify = (plan, modules)
        context = _bucket(context_len)
        accepted = expected_accepted(min(acceptance, MAX_ACCEPTANCE), num_drafts)
        width, plain_width = (1 + num_drafts, 1) if compiled else (None, None)
        ms = self._step_ms(num_seqs * (1 + num_drafts), num_seqs, context, *verify, width=width)
        ms += self._draft_ms([num_seqs] * num_drafts, context, compiled)
        plain_ms = self._step_ms(num_seqs, num_seqs, context, *verify, width=plain_width)
        return (1 + accepted) * plain_ms / ms

    def best_gain(self, acceptance: float, max_drafts: int, **step) -> tuple[int, float]:
        """(drafts per step, predicted gain) of the draft count up to `max_drafts` the
        predictions favour at this acceptance; (0, 1.0) where no drafting pays. `step`:
        predicted_gain's keyword arguments."""
        gains = [(k, self.predicted_gain(acceptance, k, **step)) for k in range(1, max_drafts + 1)]
        return max([(0, 1.0), *gains], key=lambda kg: kg[1])

    def _draft_ms(
        self, rows: list[int], context_len: int, compiled: bool = False, measured: bool = False
    ) -> float:
        """Draft step j runs the rows[j] requests drafting a j-th token (none: no step);
        `measured`: a compiled draft step's measured time where there is one."""
        if self.draft_plan is None:
            return 0.0
        return sum(self._draft_step_ms(n, context_len, compiled, measured) for n in rows if n)

    def _step_ms(
        self,
        num_tokens: int,
        num_seqs: int,
        context_len: int,
        plan=None,
        modules=None,
        width: int | None = None,
        measured: bool = False,
    ) -> float:
        """A verifying (or plain) step's ms; `width`: the step is a compiled graph whose rows
        each hold 1 + the most drafts of a row (None: eager, `num_tokens` tokens); `measured`:
        a graph of the policy's plan at a shape the engine has run costs its measured time."""
        plan = plan or self.plan
        if width is not None:  # the graph's shape: rows in their bucket, a power-of-two width
            rows, width = self._graph_rows(num_seqs), graph_width(width)
            ms = self._predict(plan, rows * width, rows, context_len, modules, compiled=True)
            if not measured:
                return ms
            return self._measured(self.measured_step_ms(rows, width), ms, rows, context_len)

        def exact(tokens: int) -> float:
            return self._predict(plan, tokens, num_seqs, context_len, modules)

        return _interpolated(exact, num_tokens, num_seqs)

    def _draft_step_ms(
        self, num_rows: int, context_len: int, compiled: bool, measured: bool
    ) -> float:
        if compiled:
            rows = self._graph_rows(num_rows)
            ms = self._predict(self.draft_plan, rows, rows, context_len, compiled=True)
            if not measured:
                return ms
            return self._measured(self.measured_draft_ms(rows), ms, rows, context_len)

        def exact(rows: int) -> float:
            return self._predict(self.draft_plan, rows, rows, context_len)

        return _interpolated(exact, num_rows, 1)

    def _measured(
        self, measured_ms: float | None, predicted_ms: float, rows: int, context_len: int
    ) -> float:
        """A graph's measured ms where it has run; else its predicted ms scaled by what the
        plain step of `rows` rows measured over its prediction (the fit was made another time,
        perhaps under another load: a prediction is not compared with a measurement as it is)."""
        if measured_ms is not None:
            return measured_ms
        if (plain_ms := self.measured_step_ms(rows, 1)) is None:
            return predicted_ms
        return (
            predicted_ms
            * plain_ms
            / self._predict(self.plan, rows, rows, context_len, compiled=True)
        )

    def _plain_step_unmeasured(self, num_seqs: int) -> bool:
        """Whether a verifying graph of these rows has run and the plain one not: the verifying
        step then costs its measured time and the plain one the fit's price, which are not
        comparable (an engine that drafted from its first step, SmolLM2 bf16 at batch 16: the
        plain step priced at 27 ms by a fit, verifying measured at 25 ms and run at every
        step, though the plain step took 15.5)."""
        rows = self._graph_rows(num_seqs)
        if self.measured_step_ms(rows, 1) is not None:
            return False
        return any(self.measured_step_ms(rows, width) is not None for width in (2, 4, 8))

    def _graph_rows(self, num_seqs: int) -> int:
        """The batch bucket a compiled graph of `num_seqs` rows runs at (GraphCache.bucket)."""
        return next((b for b in self.graph_buckets if b >= num_seqs), num_seqs)

    def _predict(
        self,
        plan,
        num_tokens: int,
        num_seqs: int,
        context_len: int,
        modules=None,
        compiled: bool = False,
    ) -> float:
        """The cost model's step ms, remembered (its features walk every linear of the model)."""
        # The plan by its signature (skips in it; the name and drafts not), computed once per
        # plan object: this runs for every draft the policy weighs.
        if (known := self._signatures.get(id(plan))) is None or known[0] is not plan:
            known = self._signatures[id(plan)] = (plan, plan and plan.signature())
        shape = (num_tokens, num_seqs, context_len, compiled)
        key = (known[1], id(modules) if modules else None, *shape)
        if key not in self._ms:
            self._ms[key] = self.cost.predict_step_ms(
                self.model, plan, num_tokens=num_tokens, num_seqs=num_seqs,
                context_len=context_len, modules=modules, compiled=compiled,
                kv_paged=self.kv_paged,
            )  # fmt: skip
        return self._ms[key]


def _not_measured(*shape: int) -> None:
    return None


def _interpolated(exact: Callable[[int], float], x: int, base: int) -> float:
    """exact(x), from its values at base * 2^i around x, linearly in between: a step's predicted
    work is linear in its tokens (but for the routed experts a MoE step touches, which grow
    more slowly), and so a shape costs a few cost-model calls, not one per token count."""
    lo = base
    while lo * 2 <= x:
        lo *= 2
    if lo == x:
        return exact(x)
    share = (x - lo) / lo  # toward hi = 2 lo
    return (1 - share) * exact(lo) + share * exact(2 * lo)


def _bucket(context_len: int) -> int:
    return -(-context_len // CONTEXT_BUCKET) * CONTEXT_BUCKET


def engine_acceptance(totals: dict[str, int]) -> float:
    """The engine's acceptance rate, accepted tokens per draft trial over all requests so far
    (LLMEngine.spec_totals), shrunk toward PRIOR_ACCEPTANCE: the planner's expected acceptance
    (the policy drafts new requests by exploring_acceptance, above it)."""
    return _shrunk(totals["num_accepted_tokens"], totals["num_draft_trials"], PRIOR_ACCEPTANCE)


def exploring_acceptance(totals: dict[str, int]) -> float:
    """engine_acceptance plus EXPLORE_Z standard errors of it (its trials counted with the
    prior's PRIOR_TOKENS): the prior the policy drafts new requests by."""
    rate = engine_acceptance(totals)
    error = math.sqrt(rate * (1 - rate) / (totals["num_draft_trials"] + PRIOR_TOKENS))
    return min(rate + EXPLORE_Z * error, MAX_ACCEPTANCE)


def _shrunk(accepted: int, tried: int, prior: float) -> float:
    """accepted / tried, shrunk toward `prior` by PRIOR_TOKENS pseudo-trials."""
    return (accepted + PRIOR_TOKENS * prior) / (tried + PRIOR_TOKENS)
