"""The autotune controller as pure logic: it settles on a steady workload, holds and says so on a missing
metric, never leaves its bounds, backs off over the staleness cap, and its state survives a checkpoint."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from slipstream.config import AutotuneBounds, ConfigError, load_config
from slipstream.pipeline.autotune import (
    Autotuner,
    AutotuneState,
    Knobs,
    Observation,
    in_order_bound,
)
from slipstream.pipeline.modes import check_config, prepare_config

START = Knobs(staleness_threshold=0.0, sync_every=1, concurrency=4)
BOUNDS = AutotuneBounds(staleness_cap=2, staleness_threshold_max=2.0, sync_every_min=1, sync_every_max=4,
                        concurrency_min=1, concurrency_max=64)  # fmt: skip


def plant(k: Knobs, step: int) -> Observation:
    """A steady workload in closed form: the trainer waits less as the budget and the concurrency grow,
    requests queue below 32 per server, and staleness is the gate's in-order bound (plus one past 1.5)."""
    budget = k.sync_every * (1 + k.staleness_threshold)
    idle = max(0.0, 0.8 - 0.15 * budget - 0.2 * min(k.concurrency, 32) / 32)
    stale = in_order_bound(k.staleness_threshold, k.sync_every) + (1 if k.staleness_threshold >= 1.5 else 0)
    return Observation(
        trainer_idle=idle,
        rollouter_idle=0.0,
        requests_queued=8.0 if k.concurrency < 32 else 0.0,
        staleness_max=float(stale),
        staleness_mean=stale / 2,
        dropped_groups=0.0,
        tokens=1000.0,
        elapsed_s=10.0 * step / (1.1 - idle),
        response_len_mean=200.0,
    )


def drive(tuner: Autotuner, steps: int, make=plant) -> list[Knobs]:
    seen = []
    for step in range(1, steps + 1):
        tuner.observe(make(tuner.state.knobs, step))
        seen.append(tuner.state.knobs)
    return seen


def test_it_settles_on_a_steady_workload_without_oscillating():
    seen = drive(Autotuner(BOUNDS, every=2, start=START), 200)
    changes = [i for i in range(1, len(seen)) if seen[i] != seen[i - 1]]
    assert changes and changes[-1] < 60  # it moved, then settled
    late = seen[100:]
    assert all(k == late[0] for k in late)
    # never back to a setting it left: no A -> B -> A
    distinct = [seen[0]] + [seen[i] for i in changes]
    assert len(distinct) == len(set(distinct))
    assert late[0].concurrency >= 32 and late[0].sync_every > 1


def test_a_balanced_run_is_left_alone():
    tuner = Autotuner(BOUNDS, every=2, start=START)
    balanced = lambda k, step: msgspec.structs.replace(plant(k, step), trainer_idle=0.01)  # noqa: E731
    assert all(k == START for k in drive(tuner, 50, balanced))
    assert tuner.state.changes == 0


def test_a_missing_metric_holds_and_names_it():
    tuner = Autotuner(BOUNDS, every=2, start=START)
    decisions = []
    for step in range(1, 11):
        obs = msgspec.structs.replace(plant(tuner.state.knobs, step), staleness_max=None)
        if (d := tuner.observe(obs)) is not None:
            decisions.append(d)
    assert decisions and all(d.action == "hold" and not d.changed for d in decisions)
    assert "missing trainer/staleness_versions_max" in decisions[0].reason
    assert decisions[0].metrics()["autotune/held_missing"] == 1.0
    assert tuner.state.knobs == START


def test_without_the_queue_gauge_concurrency_is_never_guessed():
    tuner = Autotuner(BOUNDS, every=2, start=START)
    seen = drive(tuner, 60, lambda k, s: msgspec.structs.replace(plant(k, s), requests_queued=None))
    assert all(k.concurrency == START.concurrency for k in seen)


def test_from_metrics_reads_the_run_keys_and_leaves_the_rest_missing():
    obs = Observation.from_metrics(
        {"trainer/idle_ratio": 0.3, "trainer/staleness_versions_max": float("nan")}
    )
    assert obs.trainer_idle == 0.3 and obs.staleness_max is None and obs.tokens is None


def test_it_never_leaves_its_bounds():
    tight = AutotuneBounds(staleness_cap=4, staleness_threshold_max=0.5, sync_every_min=1, sync_every_max=2,
                           concurrency_min=2, concurrency_max=8)  # fmt: skip
    always_waiting = lambda k, s: msgspec.structs.replace(  # noqa: E731
        plant(k, s), trainer_idle=0.9, requests_queued=50.0 if s % 2 else 0.0, staleness_max=0.0
    )
    seen = drive(Autotuner(tight, every=2, start=START), 100, always_waiting)
    assert all(
        k.staleness_threshold <= 0.5 and 1 <= k.sync_every <= 2 and 2 <= k.concurrency <= 8 for k in seen
    )
    assert seen[-1] == Knobs(staleness_threshold=0.5, sync_every=2, concurrency=8)


def test_over_the_cap_it_backs_off_and_does_not_climb_back():
    start = Knobs(staleness_threshold=1.0, sync_every=1, concurrency=32)
    over = lambda k, s: msgspec.structs.replace(  # noqa: E731
        plant(k, s), trainer_idle=0.5, staleness_max=3.0 if k.staleness_threshold >= 1.0 else 1.0
    )
    tuner = Autotuner(BOUNDS, every=2, start=start)
    seen = drive(tuner, 40, over)
    assert seen[1].staleness_threshold == 0.5  # the first decision backs off
    assert max(k.staleness_threshold for k in seen[2:]) < 1.0  # the rung over the cap is a ceiling
    decisions = [tuner.observe(over(tuner.state.knobs, 41)), tuner.observe(over(tuner.state.knobs, 42))]
    assert all(d is None or d.action != "lower" for d in decisions)


def test_the_mismatch_cap_needs_its_metric_and_backs_off_above_it():
    bounds = msgspec.structs.replace(BOUNDS, mismatch_cap=0.05)
    start = Knobs(staleness_threshold=1.0, sync_every=1, concurrency=32)
    tuner = Autotuner(bounds, every=2, start=start)
    drive(tuner, 2)
    assert tuner.state.knobs == start  # no mismatch reported: held
    tuner = Autotuner(bounds, every=2, start=start)
    drive(tuner, 2, lambda k, s: msgspec.structs.replace(plant(k, s), mismatch=0.2))
    assert tuner.state.knobs.staleness_threshold == 0.5


def test_the_state_round_trips_a_checkpoint_and_goes_on_the_same():
    a = Autotuner(BOUNDS, every=2, start=START)
    drive(a, 9)
    saved = msgspec.msgpack.encode(a.state)
    b = Autotuner(BOUNDS, every=2, start=START, state=msgspec.msgpack.decode(saved, type=AutotuneState))
    for step in range(10, 40):
        da = a.observe(plant(a.state.knobs, step))
        db = b.observe(plant(b.state.knobs, step))
        assert da == db


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["async.autotune_bounds.sync_every_min=3", "async.autotune_bounds.sync_every_max=2"],
         "async.autotune_bounds.sync_every_min"),
        (["async.autotune_bounds.concurrency_min=16", "async.autotune_bounds.concurrency_max=8"],
         "async.autotune_bounds.concurrency_min"),
        (["async.autotune_bounds.concurrency_min=128"], "rollout.max_concurrent_per_server"),
        (["async.autotune_bounds.staleness_cap=3"], "async.autotune_bounds.staleness_cap"),
        (["async.staleness_threshold=3"], "async.staleness_threshold"),
        (["async.mode=one_step_off"], "async.autotune"),
    ],
)  # fmt: skip
def test_contradicting_bounds_are_refused_naming_the_keys(overrides, key):
    cfg = load_config(None, ["async.autotune=throughput", "async.max_staleness=2", *overrides])
    with pytest.raises(ConfigError, match=f"^{key}"):
        check_config(prepare_config(cfg)[0], environment=False)


def test_bounds_are_not_checked_with_autotune_off():
    cfg = load_config(None, ["async.max_staleness=0"])  # cap 2 > hard cap 0, but the controller is off
    check_config(prepare_config(cfg)[0], environment=False)


def test_a_run_with_autotune_on_is_warned_that_the_pipeline_moves_only_the_threshold():
    from slipstream.pipeline.modes import config_warnings

    cfg = prepare_config(load_config(None, ["async.autotune=throughput", "async.max_staleness=2"]))[0]
    assert any(w.startswith("async.autotune:") for w in config_warnings(cfg))


class _Rollouter:
    def __init__(self) -> None:
        self.thresholds: list[float] = []

    def set_staleness_threshold(self, x: float) -> None:
        self.thresholds.append(x)


def test_the_step_driver_sends_a_new_threshold_to_the_rollouter_and_records_it(caplog):
    from types import SimpleNamespace

    from slipstream.pipeline.driver import StepDriver, make_autotuner

    cfg = load_config(None, ["async.autotune=throughput", "async.autotune_every=2", "async.max_staleness=2",
                             "async.staleness_threshold=0", "rollout.max_concurrent_per_server=4"])  # fmt: skip
    assert make_autotuner(load_config(None, [])) is None
    driver = StepDriver.__new__(StepDriver)  # only the controller's part of a step is exercised
    driver.autotune, rollouter = make_autotuner(cfg), _Rollouter()
    driver.parts = SimpleNamespace(rollouter=rollouter)
    records = []
    for step in range(1, 9):
        metrics = msgspec.structs.asdict(plant(driver.autotune.state.knobs, step))
        keys = {"trainer_idle": "trainer/idle_ratio", "rollouter_idle": "rollouter/idle_ratio",
                "requests_queued": "rollouter/requests_queued", "staleness_max": "trainer/staleness_versions_max",
                "dropped_groups": "trainer/dropped_groups", "tokens": "trainer/tokens",
                "elapsed_s": "perf/elapsed_s"}  # fmt: skip
        record = {key: metrics[name] for name, key in keys.items()}
        record["rollouter/requests_queued"] = 0.0  # the servers have room: the gate is what holds back
        with caplog.at_level("INFO", logger="slipstream.pipeline.driver"):
            records.append(driver._autotune(step, record))
    assert rollouter.thresholds and rollouter.thresholds[0] > 0  # the trainer waited: the budget grew
    knobs = driver.autotune.state.knobs
    assert knobs.sync_every == 1 and knobs.concurrency == 4  # pinned in the pipeline
    assert records[0] == {} and records[1]["autotune/staleness_threshold"] == rollouter.thresholds[0]
    assert "autotune at step 2: raise async.staleness_threshold" in caplog.text


def test_the_controller_state_is_in_the_checkpoint_and_a_resumed_run_goes_on_from_it(tmp_path):
    from types import SimpleNamespace

    from slipstream.pipeline import checkpoint as ckpt
    from slipstream.pipeline.driver import StepDriver, make_autotuner
    from slipstream.rollouter.state import GateCount, PromptPosition, RolloutState
    from slipstream.utils import checkpoints

    cfg = load_config(
        None, ["async.autotune=throughput", "async.max_staleness=2", "async.staleness_threshold=0"]
    )
    tuner = make_autotuner(cfg)
    tuner.state.knobs = Knobs(staleness_threshold=0.5, sync_every=1, concurrency=64)
    tuner.state.changes = 3
    state = RolloutState(prompts=PromptPosition(epoch=0, offset=0, seed=0, shuffle=False, size=4),
                         gate=GateCount(admitted=0), pending=[])  # fmt: skip
    parts = SimpleNamespace(
        rollouter=SimpleNamespace(state_dict=lambda: state),
        trainer=SimpleNamespace(save=lambda staging, timeout: checkpoints.mark_complete(Path(staging), 3)),
    )
    coordinator = ckpt.CheckpointCoordinator(parts, tmp_path, keep=2, save_timeout_s=1.0)
    coordinator.autotune = tuner
    coordinator.save(3)
    saved = checkpoints.latest(checkpoints.checkpoint_root(tmp_path))
    assert ckpt.read_autotune_state(saved) == tuner.state
    driver = StepDriver.__new__(StepDriver)
    driver.autotune, rollouter = make_autotuner(cfg), _Rollouter()
    driver.parts = SimpleNamespace(rollouter=rollouter)
    driver.resume_autotune(saved)
    assert driver.autotune.state.knobs.staleness_threshold == 0.5 and driver.autotune.state.changes == 3
    assert rollouter.thresholds == [0.5]
    driver.resume_autotune(None)  # a fresh start: nothing to resume
    assert rollouter.thresholds == [0.5]


def dropping(share: float, tokens: float = 1000.0):
    """The plant with ``share`` of each step's groups dropped at the hard cap (groups of 8, 64 samples trained),
    a step every 10 s."""

    def make(k: Knobs, step: int) -> Observation:
        groups = 8 * share / (1 - share)
        return msgspec.structs.replace(
            plant(k, step), trainer_idle=0.5, staleness_max=2.0, dropped_groups=groups, samples=64.0,
            tokens=tokens, elapsed_s=10.0 * step,
        )  # fmt: skip

    return make


def test_a_few_groups_dropped_at_the_cap_are_tolerated_and_many_back_off():
    start = Knobs(staleness_threshold=1.0, sync_every=1, concurrency=32)
    few = Autotuner(BOUNDS, every=2, start=start, max_staleness=2, group_size=8)
    drive(few, 4, dropping(0.02))
    assert few.state.knobs.staleness_threshold >= 1.0  # 2% dropped: no back-off
    many = Autotuner(BOUNDS, every=2, start=start, max_staleness=2, group_size=8)
    drive(many, 2, dropping(0.2))
    assert many.state.knobs.staleness_threshold == 1.0  # 2 drops: too few to judge the setting on
    drive(many, 2, dropping(0.2))
    assert many.state.knobs.staleness_threshold == 0.5  # 6 of 30 groups over the setting's two windows
    # without the samples gauge the share is unknown: any drop backs off, as before
    blind = Autotuner(BOUNDS, every=2, start=start, max_staleness=2, group_size=8)
    drive(blind, 2, lambda k, s: msgspec.structs.replace(dropping(0.04)(k, s), samples=None))
    assert blind.state.knobs.staleness_threshold == 0.5


def test_after_a_back_off_the_old_settings_groups_do_not_back_it_off_again():
    """Groups admitted under the old setting are still dropped for a while; they say nothing of the new one."""
    start = Knobs(staleness_threshold=2.0, sync_every=2, concurrency=32)
    tuner = Autotuner(BOUNDS, every=2, start=start, max_staleness=2, group_size=8)
    seen = drive(tuner, 8, dropping(0.3))
    assert seen[1].staleness_threshold == 1.5  # the first window backs off once
    assert all(k.staleness_threshold == 1.5 for k in seen[1:8])  # quiet until ceil(2 * 3) + 1 steps later
    assert tuner.state.quiet_until == 2 + 7


def test_drops_are_judged_over_the_whole_setting_however_fast_it_trains():
    """One drop in a window is noise; 5% of the setting's groups over several windows is not, however many
    tokens/s the setting trains: each drop regenerates its prompt, and a prompt dropped async.max_stale_drops
    times is trained over the cap (the simulator's one step over it, when drops that paid were kept)."""
    start = Knobs(staleness_threshold=1.0, sync_every=1, concurrency=32)
    tuner = Autotuner(BOUNDS, every=2, start=start, max_staleness=2, group_size=8)
    # balanced, 8 groups trained a step, 1 dropped at steps 3, 5, 8 (5%), twice the tokens/s of before
    one_in = lambda k, s: msgspec.structs.replace(  # noqa: E731
        dropping(0.0, tokens=2000.0)(k, s), trainer_idle=0.0, dropped_groups=1.0 if s % 5 in (0, 3) else 0.0
    )
    decisions = {s: d for s in range(1, 11) if (d := tuner.observe(one_in(tuner.state.knobs, s)))}
    assert decisions[4].action == decisions[6].action == "hold"  # a drop each: 1, then 2 of the setting's
    assert decisions[8].action == "lower"
    assert (
        "3 of 59 groups (5%) dropped over async.max_staleness since the setting began" in decisions[8].reason
    )
    assert tuner.state.knobs.staleness_threshold == 0.5 and tuner.state.setting_dropped == 0.0


def test_a_push_bursts_requests_but_only_a_full_server_holds_the_gate():
    """With sync_every 2 the window's first and last records are push steps, where the requests the push
    aborted are re-submitted at once: requests queued there alone do not say the servers are full."""
    start = Knobs(staleness_threshold=0.5, sync_every=2, concurrency=64)  # the concurrency at its bound

    def burst(at_push_only: bool):
        return lambda k, s: msgspec.structs.replace(
            plant(k, s), trainer_idle=0.2, staleness_max=1.0,
            requests_queued=40.0 if s % 2 == 0 or not at_push_only else 0.0,
        )  # fmt: skip

    pushes = Autotuner(BOUNDS, every=4, start=start, max_staleness=2)
    drive(pushes, 8, burst(at_push_only=True))
    assert pushes.state.knobs.sync_every == 4  # the gate grew
    full = Autotuner(BOUNDS, every=4, start=start, max_staleness=2)
    decisions = [d for s in range(1, 9) if (d := full.observe(burst(at_push_only=False)(start, s)))]
    assert full.state.knobs == start and [d.step for d in decisions] == [4, 8]
    assert "requests wait for a server slot at most steps' ends" in decisions[-1].reason


def test_with_the_cap_enforced_a_tail_at_the_cap_does_not_stop_the_climb():
    """The window's maximum at the cap is the long tail's (the trainer drops what would exceed it): where the
    cap is enforced, the budget's own in-order bound is what must fit; where it is not, the maximum counts."""
    start = Knobs(staleness_threshold=0.5, sync_every=2, concurrency=64)
    at_cap = lambda k, s: msgspec.structs.replace(  # noqa: E731
        plant(k, s), trainer_idle=0.2, requests_queued=0.0, staleness_max=2.0
    )
    enforced = Autotuner(BOUNDS, every=2, start=start, max_staleness=2)
    seen = drive(enforced, 40, at_cap)
    assert seen[-1].sync_every == 4 and seen[-1].staleness_threshold == 2.0
    assert all(in_order_bound(k.staleness_threshold, k.sync_every) <= 2 for k in seen)
    loose = Autotuner(BOUNDS, every=2, start=start, max_staleness=4)  # target one under the cap: already past
    assert all(k == start for k in drive(loose, 40, at_cap))


def test_the_controller_steers_to_the_cap_only_where_the_trainer_enforces_it():
    assert Autotuner(BOUNDS, every=2, start=START, max_staleness=2).target == 2
    assert Autotuner(BOUNDS, every=2, start=START, max_staleness=4).target == 1
    assert Autotuner(BOUNDS, every=2, start=START).target == 1


def test_with_autotune_on_the_hard_cap_is_the_controllers():
    cfg, notes = prepare_config(load_config("configs/quickstart.yaml", ["async.autotune=throughput",
                                                                        "async.max_staleness=4"]))  # fmt: skip
    assert cfg.async_.max_staleness == cfg.async_.autotune_bounds.staleness_cap == 2
    assert "async.max_staleness: 4 -> 2 (async.autotune_bounds.staleness_cap)" in notes
    off, _ = prepare_config(load_config("configs/quickstart.yaml", ["async.max_staleness=4"]))
    assert off.async_.max_staleness == 4
