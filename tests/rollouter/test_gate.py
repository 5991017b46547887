"""The staleness gate: it never admits more than its budget, whatever the order of events."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.config import load_config, rollouter_settings
from slipstream.rollouter.gate import StalenessGate


def test_budget_formula_and_sync_mode():
    gate = StalenessGate(batch_groups=4, sync_every=2, staleness_threshold=0.5)
    assert gate.budget == 12  # (0 + 2 * 1.5) * 4
    gate.set_version(2)
    assert gate.budget == 20
    gate.set_version(1)  # versions never go back
    assert gate.budget == 20
    assert StalenessGate(batch_groups=10, sync_every=1, staleness_threshold=0.1).budget == 11

    sync = StalenessGate.from_settings(
        rollouter_settings(
            load_config(
                None,
                [
                    "async.mode=sync",
                    "async.staleness_threshold=3",
                    "async.sync_every=4",
                    "trainer.batch_groups=6",
                ],
            )
        )
    )
    assert (sync.staleness_threshold, sync.sync_every, sync.budget) == (0.0, 1, 6)
    with pytest.raises(ValueError, match="staleness_threshold >= 0"):
        StalenessGate(batch_groups=1, sync_every=1, staleness_threshold=-1)


def test_close_refund_and_shutdown():
    async def main():
        gate = StalenessGate(batch_groups=2, sync_every=1, staleness_threshold=0.0)
        assert [gate.try_admit() for _ in range(3)] == [True, True, False]
        waiter = asyncio.create_task(gate.admit())
        await asyncio.sleep(0)
        gate.refund(1)  # a dropped group gives its unit back: the waiter gets it
        assert await asyncio.wait_for(waiter, 5) is True and gate.admitted == 2
        gate.set_version(1)
        gate.close()  # drain: nothing starts until the next version
        assert not gate.try_admit() and await gate.admit(timeout_s=0.01) is False
        gate.set_version(1)
        assert gate.try_admit()
        blocked = asyncio.create_task(gate.admit())
        gate.try_admit()
        await asyncio.sleep(0)
        gate.shutdown()
        assert await asyncio.wait_for(blocked, 5) is False
        with pytest.raises(ValueError, match="cannot refund"):
            gate.refund(10)

    asyncio.run(main())


EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(1, 3)),  # that many coroutines start waiting to admit
        st.tuples(st.just("complete"), st.integers(0, 50)),  # one admitted group finishes (pick by index)
        st.tuples(st.just("version"), st.integers(1, 2)),  # a weight push
        st.tuples(st.just("drop"), st.integers(0, 50)),  # the trainer drops a finished group
        st.tuples(st.just("close"), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    batch_groups=st.integers(1, 5),
    sync_every=st.integers(1, 3),
    threshold=st.sampled_from([0.0, 0.1, 0.5, 1.0, 2.5]),
    events=EVENTS,
)
def test_gate_never_admits_more_than_its_budget(batch_groups, sync_every, threshold, events):
    """Waiters arrive, groups complete and get dropped, versions advance, all in a random order; after every
    event the net number of admitted groups is within the budget of the current version, and every waiter
    that could be admitted was."""

    async def main():
        gate = StalenessGate(batch_groups=batch_groups, sync_every=sync_every, staleness_threshold=threshold)
        waiters: list[asyncio.Task] = []
        running: list[int] = []  # admitted groups still generating
        finished: list[int] = []  # put groups the trainer may still drop
        started = 0
        for kind, arg in events:
            if kind == "arrive":
                waiters += [asyncio.create_task(gate.admit()) for _ in range(arg)]
            elif kind == "complete" and running:
                finished.append(running.pop(arg % len(running)))
            elif kind == "version":
                gate.set_version(gate.version + arg)
            elif kind == "drop" and finished:
                finished.pop(arg % len(finished))
                gate.refund(1)
            elif kind == "close":
                gate.close()
            for _ in range(5):
                await asyncio.sleep(0)
            newly = [w for w in waiters if w.done()]
            waiters = [w for w in waiters if not w.done()]
            for w in newly:
                assert w.result() is True
                running.append(started)
                started += 1
            assert gate.admitted <= gate.budget
            assert gate.admitted == started - gate.refunded
            # Liveness: nobody waits while the gate has room.
            assert not (waiters and gate.available > 0)
        gate.shutdown()
        await asyncio.gather(*waiters)

    asyncio.run(main())


@pytest.mark.parametrize(
    "mode, threshold, sync_every", [("sync", 0.0, 1), ("one_step_off", 1.0, 1), ("fully_async", 3.0, 4)]
)
def test_every_gate_takes_its_modes_preset_from_the_one_table(mode, threshold, sync_every):
    from slipstream.pipeline.modes import prepare_config

    cfg = load_config(None, [f"async.mode={mode}", "async.staleness_threshold=3", "async.sync_every=4"])
    prepared = prepare_config(cfg)[0].async_
    settings = rollouter_settings(cfg)  # a rollouter built from a config the pipeline did not prepare
    gate = StalenessGate.from_settings(settings)  # as the simulator builds its gate
    assert (prepared.staleness_threshold, prepared.sync_every) == (threshold, sync_every)
    assert (settings.staleness_threshold, settings.sync_every) == (threshold, sync_every)
    assert (gate.staleness_threshold, gate.sync_every) == (threshold, sync_every)


def test_a_new_threshold_moves_the_budget_and_wakes_a_waiter():
    async def main():
        gate = StalenessGate(batch_groups=4, sync_every=1, staleness_threshold=0.0)
        assert [gate.try_admit() for _ in range(5)] == [True] * 4 + [False]
        waiter = asyncio.create_task(gate.admit())
        await asyncio.sleep(0)
        gate.set_threshold(0.5)  # budget 4 -> 6
        assert await asyncio.wait_for(waiter, 1.0) and gate.budget == 6
        gate.set_threshold(0.0)  # down again: what was admitted stays, nothing more starts
        assert gate.admitted == 5 and gate.available == 0
        with pytest.raises(ValueError):
            gate.set_threshold(-1.0)

    asyncio.run(main())
