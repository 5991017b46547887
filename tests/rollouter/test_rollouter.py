"""The rollouter against scripted neighbours: admission, groups, drops, drain, stop and resume."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollouter_fakes import ControlledClient, InlineRewards, RecordingQueue, settle

from slipstream.agents.data import PromptSource, Sample
from slipstream.config import load_config, rollouter_settings
from slipstream.queue.types import Provenance, SampleOutcome
from slipstream.rollouter.rollouter import Rollouter
from slipstream.utils.tiny_models import make_tiny_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def prompts(count: int, epochs: int = 1) -> PromptSource:
    samples = [
        Sample(
            index=i,
            messages=[{"role": "user", "content": f"q{i}"}],
            data_source="arithmetic",
            ground_truth="1",
        )
        for i in range(count)
    ]
    return PromptSource(samples, shuffle=False, epochs=epochs)


def config(**overrides):
    """``RollouterSettings`` of a small run; ``overrides`` are root keys (``trainer.batch_groups``)."""
    base = {
        "rollout.n": 2,
        "trainer.batch_groups": 2,
        "async.sync_every": 1,
        "async.staleness_threshold": 0,
        "rollout.sampling.max_new_tokens": 8,
        "agent.name": "single_turn",
    }
    base.update(overrides)
    return rollouter_settings(load_config(None, [f"{k}={v}" for k, v in base.items()]))


def make(tok, cfg, source, client=None, queue=None) -> tuple[Rollouter, ControlledClient, RecordingQueue]:
    client = client or ControlledClient()
    queue = queue or RecordingQueue()
    rollouter = Rollouter(cfg, client, queue, tok, source)
    rollouter.rewards = InlineRewards()  # scoring in worker processes is tested in tests/agents
    rollouter.poll_s = 0.01
    return rollouter, client, queue


def started_groups(client: ControlledClient) -> set[str]:
    return {rid.rsplit("-", 1)[0].split(".r")[0] for rid, _, _ in client.requests}


async def finish_all(client: ControlledClient) -> None:
    for rid in list(client.pending):
        client.finish(rid)
    await settle()


def test_sync_mode_admits_one_batch_per_version(tok):
    async def main():
        rollouter, client, queue = make(tok, config(**{"async.mode": "sync"}), prompts(5))
        task = asyncio.create_task(rollouter.run())
        await settle()
        assert started_groups(client) == {"e0-p0", "e0-p1"} and len(client.pending) == 4
        await finish_all(client)
        assert set(queue.groups) == {"e0-p0", "e0-p1"}
        assert started_groups(client) == {"e0-p0", "e0-p1"}  # the gate holds until the next version
        rollouter.set_version(1)
        client.version = 1
        await settle()
        assert started_groups(client) == {"e0-p0", "e0-p1", "e0-p2", "e0-p3"}
        await finish_all(client)
        rollouter.set_version(2)
        await settle()
        await finish_all(client)
        await asyncio.wait_for(task, 10)
        assert sorted(queue.groups) == [f"e0-p{i}" for i in range(5)]

        group = queue.groups["e0-p3"]
        assert group.uids == ["e0-p3-0", "e0-p3-1"]
        assert group.meta.provenance == Provenance(
            prompt_index=3, epoch=0, attempt=0, data_source="arithmetic"
        )
        trajectories = group.to_trajectories()
        assert all(t.versions == [1, 1, 1] and t.loss_mask == [1, 1, 1] for t in trajectories)
        assert all(t.reward == 1.0 and t.outcome == SampleOutcome() for t in trajectories)
        metrics = rollouter.metrics()
        assert metrics["rollouter/groups_put"] == 5 and metrics["rollouter/gate_budget"] == 6
        assert metrics["rollouter/reward_mean"] == 1.0 and metrics["rollouter/trajectories"] == 10

    asyncio.run(main())


def test_staleness_threshold_lets_generation_run_ahead(tok):
    async def main():
        cfg = config(**{"async.staleness_threshold": 1.0, "async.sync_every": 2, "trainer.batch_groups": 2})
        rollouter, client, queue = make(tok, cfg, prompts(20))
        task = asyncio.create_task(rollouter.run())
        await settle()
        assert len(started_groups(client)) == 8  # (0 + 2 * 2) * 2
        await finish_all(client)
        assert len(started_groups(client)) == 8
        rollouter.set_version(2)  # versions count trainer steps: one push after two steps
        await settle()
        assert len(started_groups(client)) == 12
        await rollouter.stop()
        await asyncio.wait_for(task, 10)

    asyncio.run(main())


def test_dropped_group_is_generated_again_without_consuming_budget_twice(tok):
    async def main():
        rollouter, client, queue = make(tok, config(), prompts(4))
        task = asyncio.create_task(rollouter.run())
        await settle()
        await finish_all(client)
        assert set(queue.groups) == {"e0-p0", "e0-p1"}
        queue.drop("e0-p1")  # the trainer found it too stale
        for _ in range(50):
            await asyncio.sleep(0.01)
            if "e0-p1-a1" in started_groups(client):
                break
        # The re-generation started although the version did not change: the drop refunded its unit.
        assert started_groups(client) == {"e0-p0", "e0-p1", "e0-p1-a1"}
        await finish_all(client)
        assert queue.groups["e0-p1-a1"].meta.provenance.attempt == 1
        rollouter.set_version(1)
        await settle()
        await finish_all(client)
        await asyncio.wait_for(task, 10)
        assert set(queue.groups) == {"e0-p0", "e0-p1", "e0-p1-a1", "e0-p2", "e0-p3"}
        assert rollouter.metrics()["rollouter/groups_dropped"] == 1

    asyncio.run(main())


def test_drain_waits_for_in_flight_groups_and_holds_admission(tok):
    async def main():
        cfg = config(**{"async.partial_rollout": "off", "async.staleness_threshold": 2})
        rollouter, client, queue = make(tok, cfg, prompts(10))
        task = asyncio.create_task(rollouter.run())
        await settle()
        assert len(started_groups(client)) == 6
        drain = asyncio.create_task(rollouter.drain())
        await settle()
        assert not drain.done()
        first = sorted(client.pending)[:2]
        for rid in first:
            client.finish(rid)
        await settle()
        assert not drain.done()  # four requests of other groups still run
        await finish_all(client)
        await asyncio.wait_for(drain, 5)
        rollouter.set_version(1)
        await settle()
        assert len(started_groups(client)) == 8  # budget (1 + 3) * 2
        await rollouter.stop()
        await asyncio.wait_for(task, 10)

    asyncio.run(main())


def test_stop_and_resume_lose_nothing(tok):
    async def main():
        cfg = config(**{"async.staleness_threshold": 1.0})
        rollouter, client, queue = make(tok, cfg, prompts(6, epochs=2))
        task = asyncio.create_task(rollouter.run())
        await settle()
        # A checkpoint while running lists the four groups in flight and the prompt waiting for the gate.
        assert [(p.epoch, p.index) for p in rollouter.state_dict().pending] == [(0, i) for i in range(5)]
        first_pending = sorted(client.pending)
        for rid in first_pending[:4]:  # two of the four groups finish
            client.finish(rid)
        await settle()
        await rollouter.stop()
        await asyncio.wait_for(task, 10)
        assert len(queue.groups) == 2 and not client.pending
        state = rollouter.state_dict()
        # Two groups were in flight; prompt 4 was taken from the source and waited for the gate.
        assert [(p.epoch, p.index) for p in state.pending] == [(0, 2), (0, 3), (0, 4)]
        assert state.gate.admitted == 2

        resumed, client2, _ = make(tok, cfg, prompts(6, epochs=2), queue=queue)
        resumed.load_state_dict(state)
        resumed.set_version(1)
        task = asyncio.create_task(resumed.run())
        for version in range(2, 10):
            await settle()
            await finish_all(client2)
            resumed.set_version(version)
            if task.done():
                break
        await asyncio.wait_for(task, 10)
        assert sorted(queue.groups) == sorted(f"e{e}-p{i}" for e in range(2) for i in range(6))

    asyncio.run(main())


def test_failing_group_is_retried_then_fails_the_run(tok):
    class Flaky(ControlledClient):
        failures = 1

        async def generate(self, input_ids, sampling, *, rid=None, session_id=None):
            if rid.startswith("e0-p0") and Flaky.failures > 0:
                Flaky.failures -= 1
                raise ConnectionError("server went away")
            return await super().generate(input_ids, sampling, rid=rid, session_id=session_id)

    async def main():
        rollouter, client, queue = make(
            tok, config(**{"rollout.n": 1, "trainer.batch_groups": 1}), prompts(1), client=Flaky()
        )
        task = asyncio.create_task(rollouter.run())
        for _ in range(100):
            await asyncio.sleep(0.01)
            await finish_all(client)
            if task.done():
                break
        await asyncio.wait_for(task, 10)
        assert set(queue.groups) == {"e0-p0"}
        assert rollouter.metrics()["rollouter/groups_failed"] == 1

        Flaky.failures = 10
        rollouter, client, queue = make(tok, config(**{"rollout.n": 1}), prompts(1), client=Flaky())
        with pytest.raises(RuntimeError, match="group e0-p0 failed 3 times; last error: ConnectionError"):
            await asyncio.wait_for(rollouter.run(), 10)

    asyncio.run(main())


def test_routing_replay_without_routes_from_the_server_fails_the_run_naming_the_key(tok):
    """trainer.moe.routing_replay `rollout`: groups whose server returned routes go to the queue with them;
    a server that returns none fails each group until the run ends, naming the key (never trained
    without replay unnoticed)."""

    class Routing(ControlledClient):
        async def generate(self, input_ids, sampling, *, rid=None, session_id=None):
            assert sampling.return_routed_experts
            out = await super().generate(input_ids, sampling, rid=rid, session_id=session_id)
            rows = len(input_ids) + len(out.output_ids) - 1
            out.routed_experts = np.zeros((rows, 2, 2), dtype=np.uint8)
            return out

    replay = {"rollout.n": 1, "trainer.batch_groups": 1, "trainer.moe.routing_replay": "rollout"}

    async def main():
        rollouter, client, queue = make(tok, config(**replay), prompts(1), client=Routing())
        task = asyncio.create_task(rollouter.run())
        while not task.done():
            await asyncio.sleep(0.01)
            await finish_all(client)
        await asyncio.wait_for(task, 10)
        assert queue.groups["e0-p0"].tensors["response_routes"].shape[1:] == (2, 2)

        rollouter, client, queue = make(tok, config(**replay), prompts(1))
        task = asyncio.create_task(rollouter.run())
        while not task.done():
            await asyncio.sleep(0.01)
            await finish_all(client)
        with pytest.raises(RuntimeError, match="failed 3 times") as failed:
            await asyncio.wait_for(task, 10)
        assert "trainer.moe.routing_replay is `rollout`, but the server returned no routes" in str(
            failed.value
        )
        assert not queue.groups

    asyncio.run(main())


def test_too_long_prompts_are_skipped(tok):
    async def main():
        long = Sample(
            index=1,
            messages=[{"role": "user", "content": "x" * 500}],
            data_source="arithmetic",
            ground_truth="1",
        )
        short = Sample(
            index=0, messages=[{"role": "user", "content": "q"}], data_source="arithmetic", ground_truth="1"
        )
        cfg = config(**{"data.max_prompt_tokens": 100, "async.staleness_threshold": 5})
        rollouter, client, queue = make(tok, cfg, PromptSource([short, long], shuffle=False))
        task = asyncio.create_task(rollouter.run())
        await settle()
        await finish_all(client)
        await asyncio.wait_for(task, 10)
        assert set(queue.groups) == {"e0-p0"}
        assert rollouter.metrics()["rollouter/prompts_skipped"] == 1

    asyncio.run(main())


def test_a_prompts_length_counts_its_image_tokens(tok):
    """Each image's one pad becomes its tokens on the server (the model's resize; Qwen2-VL's defaults here,
    as model.path has no image processor): a 448 x 448 image is 256 tokens, a 56 x 56 one 4."""
    import io

    from PIL import Image as PILImage

    from slipstream.agents.multimodal import ImageLimits, decode_image

    def with_image(index: int, side: int) -> Sample:
        buf = io.BytesIO()
        PILImage.new("RGB", (side, side), "red").save(buf, format="PNG")
        image = decode_image(buf.getvalue(), limits=ImageLimits())
        messages = [{"role": "user", "content": "<image>q"}]
        return Sample(
            index=index, messages=messages, data_source="arithmetic", ground_truth="1", images=[image]
        )

    small, big = with_image(0, 56), with_image(1, 448)
    rollouter, _, _ = make(tok, config(**{"data.max_prompt_tokens": 100}), PromptSource([small, big]))
    assert rollouter._prompt_fits(small) and not rollouter._prompt_fits(big)


def test_unknown_data_source_fails_at_construction(tok):
    bad = Sample(
        index=0, messages=[{"role": "user", "content": "q"}], data_source="mystery", ground_truth="1"
    )
    with pytest.raises(KeyError, match="no reward function for data_source `mystery`"):
        Rollouter(config(), ControlledClient(), RecordingQueue(), tok, PromptSource([bad]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batch_groups=st.integers(1, 3),
    sync_every=st.integers(1, 2),
    threshold=st.sampled_from([0.0, 0.5, 1.0]),
    n=st.integers(1, 2),
    num_prompts=st.integers(1, 8),
    actions=st.lists(
        st.tuples(st.sampled_from(["finish", "finish", "finish", "version", "drop"]), st.integers(0, 1000)),
        max_size=120,
    ),
)
def test_rollouter_never_exceeds_budget_and_loses_no_prompt(
    tok, batch_groups, sync_every, threshold, n, num_prompts, actions
):
    """Requests complete in a random order, versions arrive at random moments and the trainer drops random
    put groups; at every point the groups started are within budget (plus refunds), and in the end every
    prompt has a group in the queue."""

    async def main():
        cfg = config(
            **{
                "trainer.batch_groups": batch_groups,
                "async.sync_every": sync_every,
                "async.staleness_threshold": threshold,
                "rollout.n": n,
            }
        )
        rollouter, client, queue = make(tok, cfg, prompts(num_prompts))
        gate = rollouter.gate
        task = asyncio.create_task(rollouter.run())
        drops = 0
        dropped: set[str] = set()

        def check():
            assert len(started_groups(client)) <= gate.budget + drops
            assert gate.admitted <= gate.budget

        for kind, pick in [*actions, *[("finish", 0)] * 400]:
            await settle(5)
            check()
            if task.done():
                break
            if kind == "finish" and client.pending:
                client.finish(sorted(client.pending)[pick % len(client.pending)])
            elif kind == "version" or not client.pending:
                rollouter.set_version(rollouter.version + sync_every)
                client.version = rollouter.version
            elif kind == "drop" and set(queue.groups) - dropped:
                undropped = sorted(set(queue.groups) - dropped)  # the trainer drops a group at most once
                dropped.add(undropped[pick % len(undropped)])
                queue.drop(undropped[pick % len(undropped)])
                drops += 1
                await asyncio.sleep(0.02)  # let the poller see it
        await asyncio.wait_for(task, 10)
        # Every prompt's newest group is in the queue and was not dropped: nothing was lost.
        kept = {g.meta.provenance.prompt_index for gid, g in queue.groups.items() if gid not in dropped}
        assert kept == set(range(num_prompts))
        assert rollouter.metrics()["rollouter/groups_put"] == len(queue.groups)

    asyncio.run(main())
