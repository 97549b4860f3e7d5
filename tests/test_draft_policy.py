"""The adaptive draft policy: how many tokens each request drafts per step, from its measured
acceptance and a cost model (zcode/spec/policy.py).

The policy's choice is checked against brute force over every draft count vector, under cost
models written out here (a fixed cost per step plus a cost per token: bandwidth-bound when the
fixed part dominates, compute-bound when the per-token part does); in the engine, outputs stay
those of plain decoding whatever the policy picks, and the drafts it makes follow the cost
model it is given.
"""

import dataclasses
import itertools
import statistics

import pytest
from test_spec_decode import prompts, run

from zcode.engine.llm_engine import LLMEngine
from zcode.engine.scheduler import ScheduledSeq
from zcode.engine.sequence import Sequence
from zcode.engine.step_times import MEASURED_RUNS
from zcode.errors import ValidationError
from zcode.harness.plan import ExecutionPlan
from zcode.llm import LLM
from zcode.sampling_params import SamplingParams
from zcode.spec.acceptance import PRIOR_RUNS, RunYields, geometric
from zcode.spec.drafter import Drafter
from zcode.spec.policy import (
    PROBE_BUDGET,
    PROBE_EVERY,
    DraftPolicy,
    expected_accepted,
    exploring_acceptance,
)

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
PROBES = GREEDY.max_tokens // PROBE_EVERY + 1  # the most drafts a request held at none makes


@dataclasses.dataclass
class LinearCost:
    """ms = fixed_ms + ms_per_token * tokens for the verifying step; a draft step (any plan
    but None) costs draft_ms whatever its rows. Compiled steps are priced by `compiled`'s
    numbers (None: no fit of compiled steps); `shapes` records every step asked."""

    fixed_ms: float
    ms_per_token: float
    draft_ms: float = 0.0
    compiled: "LinearCost | None" = None
    shapes: list = dataclasses.field(default_factory=list)  # (plan, tokens, seqs, compiled)
    kv_paged: set = dataclasses.field(default_factory=set)  # every kv_paged asked

    @property
    def compiled_decode(self):
        return self.compiled

    def predict_step_ms(
        self,
        model,
        plan,
        *,
        num_tokens,
        num_seqs,
        context_len,
        modules=None,
        compiled=False,
        kv_paged=False,
    ) -> float:
        self.shapes.append((plan, num_tokens, num_seqs, compiled))
        self.kv_paged.add(kv_paged)
        prices = self.compiled if compiled else self
        if plan is not None:
            return prices.draft_ms
        return prices.fixed_ms + prices.ms_per_token * num_tokens


def tokens_per_ms(cost: LinearCost, rates, drafts, num_seqs: int) -> float:
    """The oracle's objective, written from the definition: expected tokens over step time."""
    tokens = num_seqs + sum(expected_accepted(a, k) for a, k in zip(rates, drafts))
    ms = cost.fixed_ms + cost.ms_per_token * (num_seqs + sum(drafts))
    ms += cost.draft_ms * max(drafts, default=0)  # a draft step per position, rows batched
    return tokens / ms


def choose(cost: LinearCost, rates: list[float], max_drafts: int, draft_plan=None) -> list[int]:
    policy = DraftPolicy(cost, model=None, draft_plan=draft_plan)
    num_seqs = len(rates)
    curves = [geometric(a, max_drafts) for a in rates]
    return policy.choose(
        curves, [max_drafts] * num_seqs, num_tokens=num_seqs, num_seqs=num_seqs, context_len=100,
        base_yield=num_seqs,
    )  # fmt: skip


@pytest.mark.parametrize(
    "cost",
    [LinearCost(10.0, 0.2), LinearCost(10.0, 1.0), LinearCost(2.0, 1.0), LinearCost(0.0, 1.0)],
)
@pytest.mark.parametrize("rates", [[0.9], [0.3], [0.95, 0.5, 0.1], [0.7, 0.7, 0.6, 0.2]])
def test_free_drafts_are_chosen_as_brute_force_chooses_them(cost, rates):
    max_drafts = 3
    chosen = choose(cost, rates, max_drafts)
    best = max(
        itertools.product(range(max_drafts + 1), repeat=len(rates)),
        key=lambda drafts: tokens_per_ms(cost, rates, drafts, len(rates)),
    )
    assert tokens_per_ms(cost, rates, chosen, len(rates)) == pytest.approx(
        tokens_per_ms(cost, rates, best, len(rates))
    ), (chosen, best)


def test_speculation_is_off_where_the_step_is_compute_bound_and_on_where_it_is_not():
    """A cost per token only: each draft costs a whole token's time and yields less than one
    token. A fixed cost per step (the weights read once): drafts ride along at batch 1, and
    stop paying as the batch grows."""
    assert choose(LinearCost(0.0, 1.0), [0.9], 3) == [0]
    assert choose(LinearCost(10.0, 1.0), [0.7], 3) == [3]
    batch = [0.7] * 64
    assert choose(LinearCost(10.0, 1.0), batch, 3) == [0] * 64


def test_a_costly_draft_needs_a_high_acceptance():
    draft = ExecutionPlan(skip_layers=(1,))  # the cost model prices its steps at draft_ms
    cost = LinearCost(10.0, 0.1, draft_ms=5.0)
    assert choose(cost, [0.3], 4, draft_plan=draft) == [0]
    assert choose(cost, [0.95], 4, draft_plan=draft) == [4]
    assert sum(choose(cost, [0.95], 4)) == 4  # free drafts at the same rate


def test_compiled_steps_are_priced_as_the_graphs_that_run_them():
    """Eager prices where a draft step costs 0.9 of a step (as an eager W4A8 draft of SmolLM2
    does) turn drafting off; the same engine's compiled prices (a draft step 0.4 of a step) turn
    it on. A compiled step is priced at its graph's shape: rows padded to the batch bucket,
    each to a power-of-two width."""
    draft = ExecutionPlan(skip_layers=(1,))
    cost = LinearCost(10.0, 0.5, draft_ms=9.5, compiled=LinearCost(10.0, 0.5, draft_ms=4.0))
    policy = DraftPolicy(cost, model=None, draft_plan=draft, graph_buckets=[1, 2, 4, 8])
    one = dict(num_tokens=1, num_seqs=1, context_len=100, base_yield=1)
    assert policy.choose([geometric(0.9, 3)], [3], **one) == [0]
    # k = 1, 2, 3: (1 + E) / (10 + 0.5 * width + 4 k), widths 2, 4, 4: 0.127, 0.136, 0.143
    assert policy.choose([geometric(0.9, 3)], [3], compiled=True, **one) == [3]
    cost.shapes.clear()
    three = dict(num_tokens=3, num_seqs=3, context_len=100, base_yield=3)
    policy.choose([geometric(a, 3) for a in (0.9, 0.5, 0.2)], [3, 3, 3], compiled=True, **three)
    verify = {(tokens, seqs) for plan, tokens, seqs, compiled in cost.shapes if plan is None}
    drafts = {(tokens, seqs) for plan, tokens, seqs, compiled in cost.shapes if plan is draft}
    assert verify == {(4, 4), (8, 4), (16, 4)}
    assert drafts <= {(1, 1), (2, 2), (4, 4)} and drafts
    assert all(compiled for *_, compiled in cost.shapes)
    # An engine that does not compile prices eager steps whatever the step says.
    eager = DraftPolicy(cost, model=None, draft_plan=draft)
    assert eager.choose([geometric(0.9, 3)], [3], compiled=True, **one) == [0]


def test_a_run_of_k_drafts_is_expected_to_keep_what_runs_of_k_kept():
    """Runs of one draft always kept, runs of three keeping 1.2 on average: a single rate per
    position tried (22 kept of 32 tried: 0.69) would expect 1.47 of three drafts; the runs of
    three say 1.2, shrunk toward the prior by PRIOR_RUNS pseudo-runs. A run of two, never
    measured, expects at least what a run of one does."""
    yields = RunYields()
    for kept in [1] * 10:
        yields.record(1, kept)
    for kept in [1] * 8 + [2] * 2:
        yields.record(3, kept)
    prior = geometric(0.5, 3)  # 0, 0.5, 0.75, 0.875
    expected = yields.expected(prior)
    one = (10 + PRIOR_RUNS * 0.5) / (10 + PRIOR_RUNS)
    three = (12 + PRIOR_RUNS * 0.875) / (10 + PRIOR_RUNS)
    assert expected == pytest.approx([0.0, one, one, three])
    assert RunYields().expected(prior) == prior


# One sequence's compiled step without drafts, for DraftPolicy.choose
ONE_ROW = dict(num_tokens=1, num_seqs=1, context_len=100, base_yield=1, compiled=True)


def compiled_policy(measured: dict) -> DraftPolicy:
    """A compiled engine's policy under prices that make drafting pay (a step 10 ms plus 0.01
    a token), its graphs' measured ms looked up in `measured` by (rows, width) as it changes."""
    cost = LinearCost(0.0, 1.0, compiled=LinearCost(10.0, 0.01))
    return DraftPolicy(
        cost, model=None, draft_plan=None, graph_buckets=[1, 2, 4],
        measured_step_ms=lambda rows, width: measured.get((rows, width)),
    )  # fmt: skip


def test_graphs_the_engine_ran_are_priced_by_their_measured_time():
    """Compiled prices that make drafting pay (a step 10 ms plus 0.01 a token), with plain steps
    measured at a tenth of their price: a verifying graph not run yet costs its price scaled
    alike, and three drafts at 0.9 pay; measured at 4 plain steps, the 4-wide graph stops paying
    and one draft (a 2-wide graph, scaled) does; measured too, no draft pays."""
    measured = {(1, 1): 1.0}
    policy = compiled_policy(measured)
    assert policy.choose([geometric(0.9, 3)], [3], **ONE_ROW) == [3]
    measured[(1, 4)] = 4.0
    assert policy.choose([geometric(0.9, 3)], [3], **ONE_ROW) == [1]
    measured[(1, 2)] = 2.5
    assert policy.choose([geometric(0.9, 3)], [3], **ONE_ROW) == [0]
    # predictions and gains reported to users stay the fit's
    assert policy.predicted_gain(0.9, 3) > 1.0


def test_a_plain_step_is_measured_before_drafts_are_weighed_against_a_measured_verifying_one():
    """The fit prices the plain step at 10 ms, and the 2-wide graph, run from the first step,
    measured 1.05 ms: against the fit's price one draft looks like a 10x gain. No drafts until
    the plain step has a measured time (1 ms); then drafting at 0.9 pays, measured against
    measured."""
    measured = {(1, 2): 1.05}
    policy = compiled_policy(measured)
    assert policy.choose([geometric(0.9, 3)], [3], **ONE_ROW) == [0]
    measured[(1, 1)] = 1.0
    assert policy.choose([geometric(0.9, 3)], [3], **ONE_ROW) == [3]


def test_held_requests_probe_in_one_step():
    """Four requests held at no drafts (drafts never pay at this acceptance and cost), their
    idle counts staggered: a probe widens the whole compiled step, so they probe together,
    one probe step every probe_every steps, and each of them in it."""
    policy = DraftPolicy(LinearCost(0.0, 1.0), model=None, draft_plan=None)
    totals = {"num_draft_trials": 100, "num_accepted_tokens": 0}
    seqs = [Sequence([1, 2, 3], GREEDY, None) for _ in range(4)]
    for i, seq in enumerate(seqs):
        seq.num_computed_tokens = 2  # the prompt's last token is this step's
        policy.steps_without_drafts[seq.seq_id] = 5 * i
    every = policy.probe_every(num_seqs=4, context_len=3)
    probe_steps = []
    for _ in range(4 * every):
        scheduled = [ScheduledSeq(seq, 1, 3) for seq in seqs]
        drafts = [s.num_lookahead_tokens for s in policy.limit(scheduled, totals)]
        assert set(drafts) <= {0, 1}
        if any(drafts):
            probe_steps.append(drafts)
    assert probe_steps == [[1, 1, 1, 1]] * len(probe_steps)
    assert len(probe_steps) == 4


def test_probes_are_rarer_where_a_probe_costs_more():
    """Bandwidth-bound (10 ms a step, 0.01 a token), a probe costs next to nothing and a held
    request probes every PROBE_EVERY steps; compute-bound (1 ms a token), a step verifying one
    draft a row takes two plain steps' time, so probes come 1 / PROBE_BUDGET plain steps apart."""
    cheap = DraftPolicy(LinearCost(10.0, 0.01), model=None, draft_plan=None)
    assert cheap.probe_every(num_seqs=4, context_len=100) == PROBE_EVERY
    costly = DraftPolicy(LinearCost(0.0, 1.0), model=None, draft_plan=None)
    assert costly.probe_every(num_seqs=4, context_len=100) == round(1 / PROBE_BUDGET)


# ---- in the engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return LLM(tiny_checkpoint("llama").path, kv_cache_bytes=1 << 20, block_size=4)


def engine(tiny, cost, **config) -> LLMEngine:
    config = dataclasses.replace(tiny.config, speculative="ngram", num_draft_tokens=3, **config)
    return LLMEngine(tiny.model, tiny.tokenizer, config, cost_model=cost)


def test_the_engine_drafts_where_the_cost_model_says_it_pays(tiny):
    """The prompt that repeats itself, where n-gram lookup drafts at once. Compute-bound: only
    the probes draft (one token per PROBE_EVERY steps); bandwidth-bound: every step may draft.
    A request that sets num_draft_tokens drafts as it asked either way. Tokens are plain
    decoding's in every case."""
    loop = prompts()[-1]
    plain = run(engine(tiny, None, draft_policy="fixed"), [(loop, dataclasses.replace(
        GREEDY, num_draft_tokens=0))])[0].token_ids  # fmt: skip
    asked = dataclasses.replace(GREEDY, num_draft_tokens=2)
    compute_bound = engine(tiny, LinearCost(0.0, 1.0))
    out, fixed = run(compute_bound, [(loop, GREEDY), (loop, asked)])
    assert out.token_ids == fixed.token_ids == plain
    assert out.plan.speculative["policy"] == "adaptive"
    assert out.plan.speculative["num_draft_tokens"] <= PROBES
    assert fixed.plan.speculative["num_draft_tokens"] > PROBES
    bandwidth_bound = engine(tiny, LinearCost(10.0, 0.01))
    out = run(bandwidth_bound, [(loop, GREEDY)])[0]
    assert out.token_ids == plain
    assert out.plan.speculative["num_draft_tokens"] > PROBES


def test_an_engine_keeping_kv_per_head_prices_its_page_gathers(tiny):
    """Its steps gather each layer's KV pages per sequence (the cost model's kv-paged
    features): the policy asks for those prices, a flat-KV engine's policy does not."""
    for per_request_depth in (True, False):
        cost = LinearCost(10.0, 0.01)
        run(engine(tiny, cost, per_request_depth=per_request_depth), [(prompts()[-1], GREEDY)])
        assert cost.kv_paged == {per_request_depth}


def test_a_compiled_engine_drafts_by_the_cost_of_compiled_steps(tiny):
    """Eager prices that never pay for drafts, with compiled prices that do: a compiled engine
    drafts (verifying graphs of width > 1 compiled), with plain decoding's tokens; without a
    fit of compiled steps its policy is fixed and says why."""
    loop = prompts()[-1]
    plain = run(engine(tiny, None, draft_policy="fixed"), [(loop, dataclasses.replace(
        GREEDY, num_draft_tokens=0))])[0].token_ids  # fmt: skip
    unfitted = engine(tiny, LinearCost(0.0, 1.0), compile=True)
    assert unfitted.draft_policy is None
    assert unfitted.draft_policy_name.startswith("fixed: no cost fit of compiled steps")
    pays = engine(tiny, LinearCost(0.0, 1.0, compiled=LinearCost(10.0, 0.01)), compile=True)
    assert pays.draft_policy.graph_buckets == pays.runner.graphs.buckets
    pays.draft_policy.measured_step_ms = lambda rows, width: None  # the fit's prices alone
    out = run(pays, [(loop, GREEDY)])[0]
    assert out.token_ids == plain
    assert out.plan.speculative["num_draft_tokens"] > PROBES
    assert any(width > 1 for _, _, width in pays.runner.graphs.graphs)


def test_a_compiled_engine_times_its_steps_for_the_policy(tiny):
    """Each step of one compiled graph is timed by the graph's shape (a step that compiled it
    is not); the policy reads a shape's median over its latest MEASURED_RUNS steps, and nothing
    for a shape not run. An eager engine times nothing."""
    fitted = LinearCost(0.0, 1.0, compiled=LinearCost(10.0, 0.01))
    plain = dataclasses.replace(GREEDY, num_draft_tokens=0)
    spec = engine(tiny, fitted, compile=True)
    recorded, record = [], spec.step_times.record
    spec.step_times.record = lambda shape, ms: (recorded.append(shape), record(shape, ms))
    run(spec, [(prompts()[0], plain)])
    signature = spec.runner.plan_signature
    assert recorded == [(signature, 1, 1)] * (GREEDY.max_tokens - 2)  # decode steps, 1 compiling
    runs = spec.step_times.runs_ms[(signature, 1, 1)]
    assert len(runs) == MEASURED_RUNS
    assert spec.draft_policy.measured_step_ms(1, 1) == statistics.median(runs) > 0
    assert spec.draft_policy.measured_step_ms(1, 4) is None
    eager = engine(tiny, fitted)
    run(eager, [(prompts()[0], plain)])
    assert eager.step_times.runs_ms == {}


class KnowingDrafter(Drafter):
    """Drafts the target's own next `num_right` tokens (from a plain run), then `num_wrong`
    wrong ones; records the slots it was asked for."""

    def __init__(self, prompt: list[int], plain: list[int], num_right: int, num_wrong: int):
        self.prompt, self.plain = prompt, plain
        self.num_right, self.num_wrong = num_right, num_wrong
        self.slots: list[int] = []

    def propose(self, seqs, max_num_tokens):
        (seq,), (slots,) = seqs, max_num_tokens
        self.slots.append(slots)
        at = seq.num_tokens - len(self.prompt)
        right = self.plain[at : at + self.num_right]
        wrong = [(t + 1) % 100 for t in self.plain[at + len(right) :][: self.num_wrong]]
        return [(right + wrong)[:slots]]


@pytest.mark.parametrize("num_wrong", [0, 2])
def test_acceptance_is_accepted_drafts_per_position_tried(tiny, num_wrong):
    """Each step drafts one right token, then two wrong ones or nothing: with wrong ones
    verification tries two positions (the right draft, the rejected one) and accepts one, so the
    policy's acceptance is one in two, where accepted per draft would be 1/3; without, it tries
    the one draft there is (a slot the drafter leaves empty is no trial: the step verifies the
    drafts it has). The last step has one slot (two tokens a step from the first output token
    on, an odd max_tokens): one right draft fills it, one position tried."""
    prompt = prompts()[0]
    params = dataclasses.replace(GREEDY, max_tokens=41)
    no_drafts = dataclasses.replace(params, num_draft_tokens=0)
    plain = run(engine(tiny, None, draft_policy="fixed"), [(prompt, no_drafts)])[0].token_ids
    spec = engine(tiny, None, draft_policy="fixed")
    spec.drafter = drafter = KnowingDrafter(prompt, plain, 1, num_wrong)
    assert run(spec, [(prompt, params)])[0].token_ids == plain
    assert drafter.slots == [3] * 19 + [1]
    totals = spec.spec_totals
    assert totals["num_accepted_tokens"] == 20
    assert totals["num_draft_trials"] == 19 * (2 if num_wrong else 1) + 1
    assert totals["num_draft_tokens"] == sum(min(n, 1 + num_wrong) for n in drafter.slots)
    # What runs of k drafts kept, by k: 19 runs of 3 keeping 1 each and a last run of 1, or
    # 20 runs of 1 kept whole
    yields = spec.spec_yields
    if num_wrong:
        assert (yields.runs, yields.accepted) == ([0, 1, 0, 19], [0, 1, 0, 19])
    else:
        assert (yields.runs, yields.accepted) == ([0, 20], [0, 20])


def test_a_free_drafter_drafts_before_the_policy_chooses(tiny):
    """n-gram lookup costs nothing, so its drafts are made first and the policy weighs those:
    a lookup finds a match or none. Asked for three slots, a drafter that makes one draft gets
    the policy asked about one; one that makes none, about none, and a step without drafts
    is no trial."""
    prompt = prompts()[0]
    no_drafts = dataclasses.replace(GREEDY, num_draft_tokens=0)
    plain = run(engine(tiny, None, draft_policy="fixed"), [(prompt, no_drafts)])[0].token_ids
    for num_right in (1, 0):
        spec = engine(tiny, LinearCost(10.0, 0.01))
        spec.drafter = drafter = KnowingDrafter(prompt, plain, num_right, 0)
        asked, limit = [], spec.draft_policy.limit

        def spy(scheduled, *args, limit=limit, asked=asked):
            asked.extend(s.num_lookahead_tokens for s in scheduled)
            return limit(scheduled, *args)

        spec.draft_policy.limit = spy
        out = run(spec, [(prompt, GREEDY)])[0]
        assert out.token_ids == plain
        assert max(drafter.slots) == 3
        assert max(asked) == num_right
        accepted = out.plan.speculative["num_accepted_tokens"]  # every draft here is right
        assert spec.spec_totals["num_draft_trials"] == accepted
        assert (accepted > len(plain) // 3) if num_right else accepted == 0


def test_a_new_engine_tries_a_drafter_and_keeps_what_pays(tiny):
    """Drafting pays here only from an acceptance of ~0.8 on (a draft step costs 0.7 of a
    verifying step): a new engine, knowing 0.5, drafts by its upper confidence bound, so a
    drafter that is always right drafts (nearly) every step, where a policy drafting by the
    point estimate would only probe; one that is always wrong stops after a few steps."""
    prompt = prompts()[0]
    no_drafts = dataclasses.replace(GREEDY, num_draft_tokens=0)
    plain = run(engine(tiny, None, draft_policy="fixed"), [(prompt, no_drafts)])[0].token_ids
    assert exploring_acceptance(engine(tiny, None).spec_totals) > 0.8
    drafted = {}
    for num_right in (3, 0):
        spec = engine(tiny, LinearCost(10.0, 0.01, draft_ms=7.0))
        spec.draft_policy.draft_plan = ExecutionPlan(name="draft")
        spec.drafter = KnowingDrafter(prompt, plain, num_right, 3 - num_right)
        out = run(spec, [(prompt, GREEDY)])[0]
        assert out.token_ids == plain
        drafted[num_right] = out.plan.speculative["num_draft_tokens"]
    # at least 1 draft a step (it then yields 2 tokens or more), and more once measured
    assert drafted[3] > GREEDY.max_tokens // 2
    assert drafted[0] <= 3 * 3 + PROBES


def test_without_a_fitted_cost_model_every_request_drafts_its_tokens(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("ZCODE_CACHE_DIR", str(tmp_path))  # nothing fitted there
    out = run(engine(tiny, None), [(prompts()[-1], GREEDY)])[0]
    assert out.plan.speculative["policy"].startswith("fixed: no cost model")
    assert out.plan.speculative["num_draft_tokens"] > PROBES


def test_draft_policy_is_validated():
    from zcode.config import EngineConfig

    with pytest.raises(ValueError, match="draft_policy must be one of"):
        EngineConfig(draft_policy="sometimes")


@pytest.mark.parametrize("num_seqs", [1, 4])
@pytest.mark.parametrize("num_drafts", [1, 3])
def test_predicted_gain_is_the_objective_over_plain_decoding(num_seqs, num_drafts):
    cost = LinearCost(10.0, 1.0, draft_ms=2.0)
    policy = DraftPolicy(cost, model=None, draft_plan=ExecutionPlan(skip_layers=(1,)))
    gain = policy.predicted_gain(0.8, num_drafts, num_seqs=num_seqs, context_len=100)
    rates = [0.8] * num_seqs
    with_drafts = tokens_per_ms(cost, rates, [num_drafts] * num_seqs, num_seqs)
    assert gain == pytest.approx(with_drafts / tokens_per_ms(cost, rates, [0] * num_seqs, num_seqs))


def test_the_cli_passes_the_draft_policy_to_the_engine():
    import argparse

    from zcode.cli.options import add_speculative_options, speculative_args

    parser = argparse.ArgumentParser()
    add_speculative_options(parser)
    args = parser.parse_args(["--speculative", "ngram", "--draft-policy", "fixed"])
    assert speculative_args(args) == {"speculative": "ngram", "draft_policy": "fixed"}


def test_a_plan_caps_the_drafts_of_its_request(tiny):
    """ExecutionPlan.num_draft_tokens: 0 turns speculation off for its request, 1 verifies at
    most one draft a step, None keeps the engine's; a plan asking more than the engine's, or
    drafts of an engine without a drafter, is refused. The signature leaves it out (drafting
    changes no result)."""
    loop = prompts()[-1]
    spec = engine(tiny, None, draft_policy="fixed")
    seqs = [
        spec.add_request(loop, GREEDY, plan=ExecutionPlan(num_draft_tokens=n)) for n in (0, 1, None)
    ]
    finished = {}
    while spec.has_unfinished():
        finished |= {out.request_id: out for out in spec.step() if out.finished}
    off, one, own = (finished[seq.request_id] for seq in seqs)
    assert off.token_ids == one.token_ids == own.token_ids
    assert off.plan is None and seqs[0].num_draft_tokens == 0  # never drafted
    assert 0 < one.plan.speculative["num_draft_tokens"] <= one.plan.speculative["num_drafts"]
    assert own.plan.speculative["num_draft_tokens"] > own.plan.speculative["num_drafts"]
    with pytest.raises(ValidationError, match="more than the engine's 3"):
        spec.add_request(loop, GREEDY, plan=ExecutionPlan(num_draft_tokens=4))
    with pytest.raises(ValidationError, match="needs an engine built with speculative"):
        tiny.engine.add_request(loop, GREEDY, plan=ExecutionPlan(num_draft_tokens=1))
    assert not spec.has_unfinished() and not tiny.engine.has_unfinished()
    assert ExecutionPlan(num_draft_tokens=0).signature() == ExecutionPlan().signature()
    with pytest.raises(ValueError, match="num_draft_tokens must be >= 0"):
        ExecutionPlan(num_draft_tokens=-1)


def test_drafts_the_step_would_cut_are_never_weighed_nor_drafted(tiny):
    """A verifying step keeps its linears on the plain step's kernel (the float GEMV up to 32
    rows here), so 16 rows verify one draft each at most. The cut comes before drafting: the
    policy weighs, and a costly drafter is asked for, one draft a row, not the three each
    request may have (weighed three, a step cut to one had been priced for the yield of
    three: bench_spec drafted at a loss at batch 16)."""
    loop = prompts()[-1]
    no_drafts = dataclasses.replace(GREEDY, num_draft_tokens=0)
    plain = run(engine(tiny, None, draft_policy="fixed"), [(loop, no_drafts)])[0].token_ids
    spec = engine(tiny, LinearCost(10.0, 0.01))
    assert spec.runner.gemv_row_limit == 32
    spec.draft_policy.draft_plan = ExecutionPlan(name="draft")  # weighed before drafting
    weighed, slots = [], []
    limit, propose = spec.draft_policy.limit, spec.drafter.propose

    def spy_limit(scheduled, *args):
        weighed.extend(s.num_lookahead_tokens for s in scheduled)
        return limit(scheduled, *args)

    def spy_propose(seqs, max_num_tokens):
        slots.extend(max_num_tokens)
        return propose(seqs, max_num_tokens)

    spec.draft_policy.limit, spec.drafter.propose = spy_limit, spy_propose
    outs = run(spec, [(loop, GREEDY)] * 16)
    assert [o.token_ids for o in outs] == [plain] * 16
    assert max(weighed) == max(slots) == 1
    assert spec.spec_totals["num_draft_tokens"] > 0
