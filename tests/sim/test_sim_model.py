"""The event model on cases small enough to check by hand."""

from __future__ import annotations

import pytest
from helpers_sim import flat_profile, small_config

from slipstream.sim.simulate import Simulation, simulate


def test_sync_fixed_lengths_gives_the_analytic_step_time():
    # generation: prefill 20/100 + decode 50/10 = 5.2 s; training: 1 + 8 x (20 + 50) / 280 = 3 s; push 0.5 s.
    # The next batch starts when the push ends, while the controller spends its 0.25 s of bookkeeping.
    res = simulate(small_config("async.mode=sync"), flat_profile(), steps=6)
    assert res.step_s[1:] == pytest.approx([0.5 + 5.2 + 3] * 5)
    assert res.step_s[0] == pytest.approx(5.2 + 3)  # no push before the first step
    # the trainer's window opens after the bookkeeping: it waits 5.2 - 0.25 s, then trains 3 s
    assert res.trainer_idle[1:] == pytest.approx([4.95 / 7.95] * 5)
    # requests are in flight 5.2 s of every 8.7 s cycle
    assert res.rollouter_idle[1:] == pytest.approx([1 - 5.2 / 8.7] * 5)
    assert res.staleness_versions_mean == 0 and res.dropped_groups == 0


def test_one_step_off_overlaps_generation_with_training():
    # generation (5.2 s) hides behind training (3 s) + push + overhead: the step is bounded by
    # max(train + push + overhead, push + generation + ...) and is shorter than sync's
    sync = simulate(small_config("async.mode=sync"), flat_profile(), steps=8)
    off = simulate(small_config("async.mode=one_step_off"), flat_profile(), steps=8)
    assert off.step_s_steady < sync.step_s_steady
    assert off.staleness_versions_max <= 1


@pytest.mark.parametrize("threshold,every,expected", [(0.0, 1, 2), (0.5, 2, 6), (1.0, 1, 4), (2.5, 1, 7)])
def test_the_gate_admits_exactly_what_the_formula_allows(threshold, every, expected):
    cfg = small_config("async.mode=fully_async", f"async.staleness_threshold={threshold}",
                       f"async.sync_every={every}")  # fmt: skip
    sim = Simulation(cfg, flat_profile(), steps=1)
    sim._admit()
    # floor((0 + sync_every * (1 + s)) * batch_groups), batch_groups = 2
    assert sim.next_gid == expected == sim.gate.budget_at(0)
    assert sim.in_flight == expected


def test_partial_rollout_aborts_and_resumes_in_place_continues():
    long = {
        "lengths": {"mean": 600, "samples": [600]},
        "trainer": {"tokens_per_s_per_rank": 1e6, "fixed_s": 1},
    }
    cfgs = {
        mode: small_config(
            "async.mode=fully_async",
            "async.staleness_threshold=2",
            f"async.partial_rollout={mode}",
            "rollout.sampling.max_new_tokens=1000",
            "async.max_staleness=100",
        )  # fmt: skip
        for mode in ("abort", "in_place")
    }
    aborted = simulate(cfgs["abort"], flat_profile(**long), steps=6)
    kept = simulate(cfgs["in_place"], flat_profile(**long), steps=6)
    assert aborted.resumed_requests > 0 and kept.resumed_requests == 0
    # nothing is lost: a resumed request ends with all its tokens; its first ones keep the old version
    assert aborted.generated_tokens % 600 == 0
    assert aborted.staleness_versions_mean > 0
    # the prefix is prefilled again after an abort, so abort is never faster than in_place here
    assert aborted.step_s_steady >= kept.step_s_steady


def test_stale_groups_are_dropped_then_kept_after_max_stale_drops():
    cfg = small_config("async.mode=fully_async", "async.staleness_threshold=3", "async.max_staleness=0",
                       "async.max_stale_drops=1", "async.partial_rollout=in_place")  # fmt: skip
    res = simulate(cfg, flat_profile(trainer={"tokens_per_s_per_rank": 1e6, "fixed_s": 0.1}), steps=8)
    assert res.dropped_groups > 0
    assert res.stale_kept_groups > 0
    assert res.steps == 8


def test_requests_spread_over_servers_as_the_balancer_puts_them():
    # 2 servers, at most 3 requests on each: 8 requests of one sync batch -> 3 + 3 held, 2 waiting
    cfg = small_config("async.mode=sync", "rollout.num_servers=2", "rollout.max_concurrent_per_server=3")
    sim = Simulation(cfg, flat_profile(), steps=1)
    sim._admit()
    assert [s.slots for s in sim.servers] == [3, 3]
    assert sim.lb.outstanding() == {"sim://server0": 3, "sim://server1": 3}
    assert len(sim.waiting) == 2
    res = sim.run()
    # two waves of 5.2 s of generation: 3 + 3 requests, then the 2 that waited
    assert res.step_s[0] == pytest.approx(2 * 5.2 + 3)


def test_dynamic_sampling_generates_filtered_groups_and_trains_none_of_them():
    """A sync step of 2 groups with half of all groups filtered: on average 4 groups are generated per
    step, in waves (a filtered group's unit is refunded only when it ends), so a step takes longer and
    nothing filtered is trained; with the filter off in the config the profile's fraction is ignored."""
    prof = flat_profile(filtered_fraction=0.5)
    on = small_config("async.mode=sync", "rollout.dynamic_sampling.enable=true",
                      "rollout.dynamic_sampling.max_attempts=3")  # fmt: skip
    off = small_config("async.mode=sync")
    filtered = simulate(on, prof, steps=40)
    plain = simulate(off, prof, steps=40)
    assert plain.filtered_groups == 0
    assert plain.step_s[1:] == pytest.approx([0.5 + 5.2 + 3] * 39)
    trained = 40 * 2
    assert filtered.filtered_groups == pytest.approx(trained, rel=0.35)  # about as many filtered as kept
    assert filtered.tokens_per_s * filtered.seconds == pytest.approx(trained * 4 * 70, rel=1e-6)
    assert filtered.step_s_mean > plain.step_s_mean * 1.3  # extra waves of generation
