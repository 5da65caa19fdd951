"""Whether a measurement of the op plan may be cached (mixprec.autocast.plan_verdict), on synthetic samples: no
clock is read, so nothing here depends on how fast or busy the test machine is.

The samples reproduce a user's report: on a 2-core machine under ~4x load ``mixprec bench --quick`` measured the
``fwd+bwd`` key of gpt/mid's attention (q[16, 4, 128, 64]; fused 21.8 ms when quiet, 92 ms there), did not find it
noisy, cached ``fused`` over the ``blockwise`` cached before, and every later run ran ``fused``."""

from __future__ import annotations

import math

import pytest

from mixprec.autocast import kernel_timing, plan_verdict
from mixprec.autocast.kernel_timing import NOISY_SPREAD, from_rounds, speed_choice
from mixprec.autocast.plan_verdict import verdict

PREFER = ("fused-fp32", "fused", "blockwise", "matmul")   # the op plan's exactness order


def rule(times):
    return speed_choice(times, "fused", PREFER)


# fwd+bwd under 4x load: each candidate's rounds within 1.2x of each other (a long run averages the load), the
# two candidates' ratio swinging round to round: blockwise 9-10 % faster in two rounds, slower in three
LOADED_ROUNDS = {"fused": [88.0, 95.0, 92.0, 101.0, 90.0], "blockwise": [97.0, 86.0, 99.0, 91.0, 104.0]}
LOADED_WARM = {"fused-fp32": 400.0, "fused": 93.0, "blockwise": 96.0, "matmul": 380.0}   # two dropped at warm-up
# the same key on the quiet machine: blockwise 12-14 % faster in every round
QUIET_ROUNDS = {"fused": [21.8, 22.0, 21.9, 22.4, 21.8], "blockwise": [19.0, 19.1, 19.3, 19.2, 19.0]}
QUIET_WARM = {"fused-fp32": 70.0, "fused": 23.0, "blockwise": 20.0, "matmul": 66.0}
CACHED_BLOCKWISE = {"chosen": "blockwise", "times_ms": {"fused-fp32": 70.0, "fused": 21.8, "blockwise": 19.0,
                                                        "matmul": 66.0}}


@pytest.fixture(autouse=True)
def _rules_as_shipped(monkeypatch):
    """The thresholds as the library ships them (another test module's fixture may have relaxed them)."""
    monkeypatch.setattr(kernel_timing, "NOISY_SPREAD", 1.5)
    monkeypatch.setattr(plan_verdict, "AGREEMENT", 1.0)


def test_a_loaded_machines_measurement_that_does_not_separate_the_candidates_is_not_cached():
    timing = from_rounds(LOADED_ROUNDS, LOADED_WARM, default="fused", prefer=PREFER)
    assert timing.times_ms == {"fused-fp32": 400.0, "fused": 88.0, "blockwise": 86.0, "matmul": 380.0}
    assert timing.chosen == "fused"               # best of each: blockwise only 2 % faster, under the margin
    assert timing.spread <= NOISY_SPREAD and not timing.noisy   # what used to be the whole rule: "quiet", cached
    assert plan_verdict.round_choices(timing, rule) == ["fused", "blockwise", "fused", "blockwise", "fused"]
    found = verdict(timing, rule, None, default="fused")
    assert not found.cache and not found.keep_cached
    assert "do not separate the candidates: 3 of 5 chose fused (blockwise 2)" in found.why
    assert found.why.startswith("not cached") and found.why.endswith("fused for this process only")


def test_a_loaded_measurement_does_not_replace_a_cached_choice():
    timing = from_rounds(LOADED_ROUNDS, LOADED_WARM, default="fused", prefer=PREFER)
    found = verdict(timing, rule, CACHED_BLOCKWISE, default="fused")
    assert not found.cache and found.keep_cached
    assert "the cached blockwise kept" in found.why and "fused measured" in found.why
    assert "busier than when blockwise was cached (fused 88.00 ms against 21.80 ms, 4.0x)" in found.why


def test_a_consistent_measurement_on_a_busier_machine_does_not_replace_a_cached_choice():
    """Load that distorts every round alike cannot be seen within the run (every round chooses fused); the same
    kernel at the same key taking 4x its cached time can: the cached choice stays."""
    rounds = {"fused": [88.0, 89.0, 88.5, 90.0, 88.0], "blockwise": [97.0, 98.0, 97.5, 99.0, 97.0]}
    timing = from_rounds(rounds, LOADED_WARM, default="fused", prefer=PREFER)
    assert plan_verdict.round_choices(timing, rule) == ["fused"] * 5 and not timing.noisy
    assert verdict(timing, rule, None, default="fused").cache          # nothing cached: nothing to compare with
    found = verdict(timing, rule, CACHED_BLOCKWISE, default="fused")
    assert not found.cache and found.keep_cached and "busier" in found.why


def test_a_quiet_measurement_that_separates_the_candidates_is_cached_and_says_what_it_replaced():
    timing = from_rounds(QUIET_ROUNDS, QUIET_WARM, default="fused", prefer=PREFER)
    assert timing.chosen == "blockwise" and plan_verdict.round_choices(timing, rule) == ["blockwise"] * 5
    assert verdict(timing, rule, None, default="fused") == plan_verdict.Verdict(True, False, "")
    assert verdict(timing, rule, CACHED_BLOCKWISE, default="fused") == plan_verdict.Verdict(True, False, "")
    cached_fused = {"chosen": "fused", "times_ms": {"fused": 22.5, "blockwise": 22.0}}
    assert verdict(timing, rule, cached_fused, default="fused") == \
        plan_verdict.Verdict(True, False, "replaces the cached fused")


def test_a_dropped_candidate_whose_warm_up_the_loaded_rounds_reach_unsettles_the_verdict():
    """A candidate dropped after one warm-up (over 3x the fastest warm-up) keeps that one time; a round slowed past
    it chooses it: a verdict from a single run on a busy machine is no separation either."""
    rounds = {"fused": [44.0, 45.0, 66.0, 44.0, 44.5], "fused-fp32": [43.0, 44.0, 64.4, 43.5, 43.0]}
    warm = {"fused-fp32": 20.0, "fused": 45.0, "blockwise": None, "matmul": 61.0}
    timing = from_rounds(rounds, warm, default="fused", prefer=PREFER)
    assert timing.chosen == "fused" and not timing.noisy and timing.times_ms["matmul"] == 61.0
    assert plan_verdict.round_choices(timing, rule) == ["fused", "fused", "matmul", "fused", "fused"]
    assert not verdict(timing, rule, None, default="fused").cache


def test_noisy_rounds_are_still_not_cached_and_the_words_say_so():
    rounds = {"fused": [20.0, 40.0, 21.0, 20.5, 20.0], "blockwise": [30.0, 60.0, 31.0, 30.0, 30.5]}
    timing = from_rounds(rounds, QUIET_WARM, default="fused", prefer=PREFER)
    assert timing.noisy and plan_verdict.round_choices(timing, rule) == ["fused"] * 5
    found = verdict(timing, rule, None, default="fused")
    assert not found.cache and "its rounds spread 2.00x (a busy machine)" in found.why


def test_agreement_is_a_share_of_the_rounds(monkeypatch):
    timing = from_rounds(LOADED_ROUNDS, LOADED_WARM, default="fused", prefer=PREFER)
    monkeypatch.setattr(plan_verdict, "AGREEMENT", 0.6)      # 3 of 5 rounds suffice
    assert verdict(timing, rule, None, default="fused").cache
    monkeypatch.setattr(plan_verdict, "AGREEMENT", 0.8)
    assert not verdict(timing, rule, None, default="fused").cache
    monkeypatch.setattr(kernel_timing, "NOISY_SPREAD", math.inf)   # the busier test off with the spread's
    monkeypatch.setattr(plan_verdict, "AGREEMENT", 0.0)
    assert verdict(timing, rule, CACHED_BLOCKWISE, default="fused") == \
        plan_verdict.Verdict(True, False, "replaces the cached blockwise")


def test_a_measurement_that_dropped_the_cached_choice_after_its_warm_ups_does_not_replace_it():
    """The cached blockwise, dropped after its warm-ups (a load spike over 3x the fastest) and never timed in the
    rounds: the rounds "agree" on fused without having compared blockwise, the spread is clean, fused is no slower
    than cached. Untested, blockwise cannot be overturned: the cached choice is kept."""
    rounds = {"fused": [21.8, 21.9, 22.0, 21.8, 21.9]}
    warm = {"fused-fp32": 70.0, "fused": 22.0, "blockwise": 160.0, "matmul": 66.0}   # all three dropped
    timing = from_rounds(rounds, warm, default="fused", prefer=PREFER)
    assert timing.chosen == "fused" and not timing.noisy and plan_verdict.round_choices(timing, rule) == ["fused"] * 5
    found = verdict(timing, rule, CACHED_BLOCKWISE, default="fused")
    assert not found.cache and found.keep_cached
    assert "the cached blockwise was dropped after its warm-ups (160.00 ms), not timed in the rounds" in found.why
    # a dropped candidate that is not the cached choice changes nothing; nor does one with nothing cached
    cached_fused = {"chosen": "fused", "times_ms": {"fused": 22.0, "blockwise": 24.0}}
    assert verdict(timing, rule, cached_fused, default="fused") == plan_verdict.Verdict(True, False, "")
    assert verdict(timing, rule, None, default="fused").cache


def _within(allowed):
    """A rule under an allowance: the speed rule among ``allowed`` candidates (and fused, never left out)."""
    return lambda times: rule({n: t if n in allowed or n == "fused" else None for n, t in times.items()})


def test_a_re_choice_under_another_allowance_reads_every_time_only_where_the_rounds_agree():
    """Measured (and cached) under +0 MiB: fused, matmul left out for its bytes. Under no limit matmul is fastest
    by its best round, but its rounds split 3 matmul / 2 fused: the re-choice reads fused's and the measured
    choice's times alone (fused), and says why; rounds that agree give matmul its every time."""
    split = {"fused": [10.0] * 5, "fused-fp32": [12.0] * 5, "matmul": [7.0, 13.0, 7.0, 13.0, 7.0]}
    warm = {"fused-fp32": 12.0, "fused": 10.0, "blockwise": 20.0, "matmul": 7.0}
    timing = from_rounds(split, warm, default="fused", prefer=PREFER)
    assert _within(("fused-fp32", "blockwise"))(timing.times_ms) == "fused"     # the allowance measured under
    unlimited = _within(PREFER)
    assert unlimited(timing.times_ms) == "matmul"                              # best of: 7 ms against 10
    times, why = plan_verdict.agreed_times(timing, unlimited, "fused", default="fused")
    assert unlimited(times) == "fused" and times["matmul"] is None and times["fused"] == 10.0
    assert why == ("not matmul under this allowance (the interleaved rounds do not separate the candidates: 3 of 5 "
                   "chose matmul (fused 2)): fused, the measured choice")
    clean = from_rounds({**split, "matmul": [7.0] * 5}, warm, default="fused", prefer=PREFER)
    assert plan_verdict.agreed_times(clean, unlimited, "fused", default="fused") == (clean.times_ms, "")


def test_a_re_choice_falls_back_to_the_measured_choice_where_it_is_allowed():
    """Measured blockwise (it saves what fused saves, so every allowance admits it); under no limit the rounds
    split between matmul and blockwise: blockwise runs, not fused."""
    rounds = {"fused": [20.0] * 5, "blockwise": [15.0] * 5, "matmul": [12.0, 16.0, 12.0, 16.0, 12.0]}
    timing = from_rounds(rounds, {"fused": 20.0, "blockwise": 15.0, "matmul": 12.0}, default="fused",
                         prefer=PREFER)
    times, why = plan_verdict.agreed_times(timing, _within(PREFER), "blockwise", default="fused")
    assert rule(times) == "blockwise" and why.endswith("): blockwise, the measured choice")
    # measured under no limit (matmul), re-chosen under +0 MiB where matmul is not allowed: the rule's own
    # choice there, checked against the rounds like any other
    no_matmul = _within(("blockwise",))
    assert plan_verdict.agreed_times(timing, no_matmul, "matmul", default="fused") == (timing.times_ms, "")
