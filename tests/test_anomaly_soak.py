"""The anomaly guard raises no false alarm on healthy generation (issue 20's soak): 200 requests
on real text (Python standard-library sources) through the default model, greedy and sampled, and
a few long sampled ones that reach the repetition check (it starts at repeat_window + max_period
output tokens). The faults it must catch are injected in tests/test_engine.py."""

import pytest

from zcode.calibration import corpus_tokens
from zcode.engine.sampler import AnomalyGuard
from zcode.sampling_params import SamplingParams

# ~2 min on a quiet 2-core machine; over 600 s (the suite's hang guard) at load average 9, so
# this module's guard is 40 min: a hang still ends, a busy machine does not fail the soak.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


def _prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    ids = corpus_tokens(tokenizer, "heldout", count * length)
    return [ids[i * length : (i + 1) * length] for i in range(count)]


def test_no_false_alarm_over_a_200_request_soak(default_llm):
    prompts = _prompts(default_llm.tokenizer, 200, 24)
    greedy = SamplingParams(temperature=0, max_tokens=32)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=0)
    outs = default_llm.generate(prompts[:100], greedy)
    outs += default_llm.generate(prompts[100:], sampled)
    assert len(outs) == 200
    alarms = [(o.request_id, o.stop_reason) for o in outs if o.finish_reason == "anomaly"]
    assert alarms == []
    assert all(o.finish_reason in ("stop", "length") for o in outs)


def test_no_false_alarm_on_long_sampled_outputs(default_llm):
    guard = AnomalyGuard()
    long_enough = guard.repeat_window + guard.max_period + 2 * guard.repeat_check_every
    params = SamplingParams(temperature=0.8, max_tokens=long_enough, ignore_eos=True, seed=1)
    outs = default_llm.generate(_prompts(default_llm.tokenizer, 4, 32), params)
    assert [o.finish_reason for o in outs] == ["length"] * 4
    assert all(len(o.token_ids) == long_enough for o in outs)
