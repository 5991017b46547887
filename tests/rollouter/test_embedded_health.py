"""The embedded engine in this process: no wedge when a full KV cache meets cancellations, and a health check
that means progress (the stall watchdog, driven by a fake clock).

Each test starts its own engine inside its own event loop, because these tests need small caches, fake
clocks and hooks into the generation thread that the shared server process cannot have.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import msgspec
import pytest
from transformers.generation.continuous_batching.offloading_manager import OffloadingManager

from slipstream.agents.protocol import SamplingParams
from slipstream.rollouter.embedded.app import build_app
from slipstream.rollouter.embedded.engine import EmbeddedEngine, RequestState, _PauseHolder
from tests.rollouter.conftest import TEST_ENGINE, run

# A cache of 64 tokens holds one request of max_model_len at most: four concurrent ones overflow it.
TINY_CACHE = msgspec.structs.replace(
    TEST_ENGINE, max_model_len=64, kv_cache_tokens=64, kv_page_size=16, max_batch_tokens=64
)
STALL_S = 30.0
LONG = SamplingParams(max_new_tokens=10_000)  # clamped to what fits in max_model_len
# Bounds a wait that only a broken engine would exhaust; a working one needs well under a second.
FAIL_AFTER_S = 60.0


class FakeClock:
    """The engine's watchdog clock, moved only by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def started(model_path, cfg=TEST_ENGINE, clock=None) -> AsyncIterator[EmbeddedEngine]:
    kwargs = {"clock": clock} if clock is not None else {}
    engine = EmbeddedEngine(model_path, cfg, **kwargs)
    await engine.start()
    try:
        yield engine
    finally:
        engine.stop()


async def first_token(engine: EmbeddedEngine, state: RequestState, more_than: int = 0) -> None:
    """Wait until ``state`` holds more than ``more_than`` tokens."""
    async for _ in engine.stream(state):
        if len(state.output_ids) > more_than:
            return
    raise AssertionError(f"request {state.rid} finished ({state.finish}) without a token")


@pytest.fixture()
def offload_barrier(monkeypatch):
    """Parks the generation thread right after the first offload that blocks new requests.

    ``offloaded`` is set once transformers set ``block_new_requests``; the thread then waits for
    ``proceed``, so the test can cancel requests while the block is known to be in force.
    """
    offloaded, proceed = threading.Event(), threading.Event()
    original = OffloadingManager.offload_requests

    def offload_then_park(self) -> bool:
        result = original(self)
        if self.scheduler.block_new_requests and not offloaded.is_set():
            offloaded.set()
            proceed.wait(FAIL_AFTER_S)
        return result

    monkeypatch.setattr(OffloadingManager, "offload_requests", offload_then_park)
    yield offloaded, proceed
    proceed.set()


async def _cancel_by_pause(engine: EmbeddedEngine, _states: list[RequestState]) -> None:
    await engine.pause("abort")  # what a weight push with partial_rollout: abort does
    await engine.resume()


async def _cancel_each(engine: EmbeddedEngine, states: list[RequestState]) -> None:
    for state in states:  # what every client disconnecting at once does
        engine.abort(state.rid, "client disconnected")


@pytest.mark.parametrize("cancel", [_cancel_by_pause, _cancel_each], ids=["pause-abort", "disconnects"])
def test_cancelling_every_request_of_a_full_cache_does_not_wedge(tiny_model_path, offload_barrier, cancel):
    offloaded, proceed = offload_barrier

    async def main():
        async with started(tiny_model_path, TINY_CACHE) as engine:
            states = [
                await engine.submit([1, 2, 3, 4], LONG, rid=f"fill-{i}", ignore_eos=True) for i in range(4)
            ]
            assert await asyncio.to_thread(offloaded.wait, FAIL_AFTER_S), "the cache never filled"
            await cancel(engine, states)
            proceed.set()
            late = await engine.submit([5, 6], SamplingParams(max_new_tokens=4), rid="late", ignore_eos=True)
            await asyncio.wait_for(engine.wait(late), FAIL_AFTER_S)
            return [s.finish.type for s in states], late

    finishes, late = run(main(), timeout_s=3 * FAIL_AFTER_S)
    assert finishes == ["abort"] * 4
    assert late.finish.type == "length" and len(late.output_ids) == 4


def test_watchdog_reports_a_stalled_loop_and_recovers(tiny_model_path):
    clock = FakeClock()
    cfg = msgspec.structs.replace(TEST_ENGINE, stall_timeout_s=STALL_S)

    async def main():
        async with started(tiny_model_path, cfg, clock) as engine:
            http = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=build_app(engine)), base_url="http://t"
            )
            state = await engine.submit([1, 2], LONG, rid="stall", ignore_eos=True)
            await first_token(engine, state)
            # Inject the stall: park the generation loop as a wedged scheduler would leave it.
            holder = _PauseHolder(engine._manager)
            holder.start()
            assert await asyncio.to_thread(holder.acquired.wait, FAIL_AFTER_S)
            await asyncio.sleep(0)  # let tokens delivered before the loop parked land first
            parked_at = len(state.output_ids)
            clock.now += STALL_S - 1
            just_before = engine.health_problem(), (await http.get("/health")).status_code
            clock.now += 2
            stalled = await http.get("/health")
            holder.release.set()
            await first_token(engine, state, more_than=parked_at)
            recovered = engine.health_problem(), (await http.get("/health")).status_code
            engine.abort("stall")
            await http.aclose()
            return just_before, stalled, recovered

    just_before, stalled, recovered = run(main())
    assert just_before == (None, 200)
    assert stalled.status_code == 503
    message = stalled.json()["error"]["message"]
    assert "stalled: 1 requests in flight" in message and "stall_timeout_s 30" in message
    assert recovered == (None, 200)


def test_watchdog_ignores_idle_time_and_in_place_pauses(tiny_model_path):
    clock = FakeClock()
    cfg = msgspec.structs.replace(TEST_ENGINE, stall_timeout_s=STALL_S)

    async def main():
        async with started(tiny_model_path, cfg, clock) as engine:
            clock.now += 10 * STALL_S  # idle: nothing in flight, nothing owed
            idle = engine.health_problem()
            await engine.pause("in_place")
            pending = await asyncio.wait_for(_submit_at_closed_gate(engine), FAIL_AFTER_S)
            clock.now += 10 * STALL_S  # the request waits at the gate: it is not in flight
            held = engine.health_problem()
            await engine.resume()
            state = await pending
            fresh = engine.health_problem()  # the first request after idle time starts the clock anew
            await first_token(engine, state)
            await engine.pause("in_place")  # now a running request is frozen on purpose
            clock.now += 10 * STALL_S
            frozen = engine.health_problem()
            await engine.resume()
            after = engine.health_problem()
            engine.abort_all()
            return idle, held, fresh, frozen, after

    assert run(main()) == (None, None, None, None, None)


async def _submit_at_closed_gate(engine: EmbeddedEngine) -> asyncio.Task:
    """Start a submit and return once it is registered and held at the pause gate."""
    task = asyncio.create_task(engine.submit([3, 4], LONG, rid="gated", ignore_eos=True))
    while engine.num_running == 0:
        await asyncio.sleep(0)
    return task


def test_watchdog_off_when_timeout_is_zero(tiny_model_path):
    clock = FakeClock()
    cfg = msgspec.structs.replace(TEST_ENGINE, stall_timeout_s=0.0)

    async def main():
        async with started(tiny_model_path, cfg, clock) as engine:
            state = await engine.submit([1, 2], LONG, rid="off", ignore_eos=True)
            await first_token(engine, state)
            holder = _PauseHolder(engine._manager)
            holder.start()
            assert await asyncio.to_thread(holder.acquired.wait, FAIL_AFTER_S)
            clock.now += 1e6
            problem = engine.health_problem()
            holder.release.set()
            engine.abort("off")
            return problem

    assert run(main()) is None
