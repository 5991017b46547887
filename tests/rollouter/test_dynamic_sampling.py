"""Rollouter reward handling: dynamic sampling (groups whose samples all score the same are dropped before
the put and their slot reused), its attempts cap, overlong shaping, and the bound on stale drops."""

from __future__ import annotations

import asyncio

import pytest
from rollouter_fakes import ControlledClient, RecordingQueue, settle
from test_rollouter import config, finish_all, make, started_groups

from slipstream.agents.data import PromptSource, Sample
from slipstream.agents.rewards.runner import RewardResult
from slipstream.utils.tiny_models import make_tiny_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


class ScriptedRewards:
    """`solved` prompts score 1 for every sample, `mixed` ones alternate 0 and 1 within a group."""

    def __init__(self):
        self.calls = 0

    def check(self, data_sources):
        pass

    async def score(self, data_source, response, ground_truth, extra_info) -> RewardResult:
        self.calls += 1
        return RewardResult(score=1.0 if ground_truth == "solved" else float(self.calls % 2))

    def close(self):
        pass


def source(kinds: list[str]) -> PromptSource:
    samples = [
        Sample(
            index=i, messages=[{"role": "user", "content": f"q{i}"}], data_source="arithmetic", ground_truth=k
        )
        for i, k in enumerate(kinds)
    ]
    return PromptSource(samples, shuffle=False)


def filtering(**overrides):
    return config(**{"rollout.dynamic_sampling.enable": "true", **overrides})


async def until(predicate, *, rounds: int = 200) -> None:
    """Let the loop run until ``predicate()`` holds (the rollouter polls for drops every 10 ms)."""
    for _ in range(rounds):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


def test_uniform_groups_are_dropped_and_the_batch_fills_with_informative_ones(tok):
    async def main():
        kinds = ["solved", "mixed", "solved", "mixed", "mixed", "mixed"]
        rollouter, client, queue = make(tok, filtering(), source(kinds))
        rollouter.rewards = ScriptedRewards()
        task = asyncio.create_task(rollouter.run())
        await settle()
        assert started_groups(client) == {"e0-p0", "e0-p1"}  # budget: one batch of 2 at version 0
        for _ in range(3):
            await finish_all(client)
        # p0 and p2 scored 1 everywhere: dropped, their slots reused, still at version 0.
        assert set(queue.groups) == {"e0-p1", "e0-p3"}
        assert started_groups(client) == {"e0-p0", "e0-p1", "e0-p2", "e0-p3"}
        assert rollouter.gate.admitted == 2 and rollouter.version == 0
        for group in queue.groups.values():
            assert len({s.reward for s in group.meta.samples}) == 2
        metrics = rollouter.metrics()
        assert metrics["rollouter/filtered_groups"] == 2 and metrics["rollouter/filter_ratio"] == 0.5
        assert metrics["rollouter/prompts_filtered_out"] == 2  # max_attempts 1: not retried (DAPO)
        await rollouter.stop()
        await asyncio.wait_for(task, 10)

    asyncio.run(main())


def test_without_the_filter_uniform_groups_are_put(tok):
    async def main():
        rollouter, client, queue = make(tok, config(), source(["solved", "mixed"]))
        rollouter.rewards = ScriptedRewards()
        task = asyncio.create_task(rollouter.run())
        await settle()
        await finish_all(client)
        await asyncio.wait_for(task, 10)
        assert set(queue.groups) == {"e0-p0", "e0-p1"}
        assert rollouter.metrics()["rollouter/filtered_groups"] == 0

    asyncio.run(main())


def test_attempts_cap_skips_a_prompt_that_always_scores_the_same(tok):
    async def main():
        cfg = filtering(**{"rollout.dynamic_sampling.max_attempts": 3})
        rollouter, client, queue = make(tok, cfg, source(["solved", "solved"]))
        rollouter.rewards = ScriptedRewards()
        task = asyncio.create_task(rollouter.run())
        while not task.done():
            await settle()
            await finish_all(client)
        await asyncio.wait_for(task, 10)  # ends: every prompt was sampled 3 times, then skipped
        assert not queue.groups
        assert started_groups(client) == {f"e0-p{i}{s}" for i in range(2) for s in ("", "-s1", "-s2")}
        metrics = rollouter.metrics()
        assert metrics["rollouter/filtered_groups"] == 6 and metrics["rollouter/prompts_filtered_out"] == 2
        assert rollouter.gate.admitted == 0  # every unit came back

    asyncio.run(main())


def test_a_resampled_prompt_is_put_once_it_scores_differently(tok):
    class FlipsOnSecondTry(ScriptedRewards):
        async def score(self, data_source, response, ground_truth, extra_info):
            self.calls += 1
            return RewardResult(score=1.0 if self.calls <= 2 else float(self.calls % 2))

    async def main():
        cfg = filtering(**{"rollout.dynamic_sampling.max_attempts": 2, "rollout.n": 2})
        rollouter, client, queue = make(tok, cfg, source(["x"]))
        rollouter.rewards = FlipsOnSecondTry()
        task = asyncio.create_task(rollouter.run())
        while not task.done():
            await settle()
            await finish_all(client)
        await asyncio.wait_for(task, 10)
        assert set(queue.groups) == {"e0-p0-s1"}
        assert rollouter.metrics()["rollouter/prompts_filtered_out"] == 0

    asyncio.run(main())


def test_missing_filter_component_fails_loudly(tok):
    async def main():
        cfg = filtering(**{"rollout.dynamic_sampling.metric": "acc"})
        rollouter, client, _ = make(tok, cfg, source(["mixed"]))
        rollouter.rewards = ScriptedRewards()
        task = asyncio.create_task(rollouter.run())
        while not task.done():
            await settle()
            await finish_all(client)
        with pytest.raises(RuntimeError, match="has no component `acc`"):
            await task

    asyncio.run(main())


def test_a_failed_reward_call_does_not_need_the_filter_component(tok):
    class AccOrTimeout(ScriptedRewards):
        async def score(self, data_source, response, ground_truth, extra_info):
            self.calls += 1
            if self.calls == 1:
                return RewardResult(score=0.0, error="timeout")
            return RewardResult(score=1.0, components={"acc": 1.0})

    async def main():
        cfg = filtering(**{"rollout.dynamic_sampling.metric": "acc"})
        rollouter, client, queue = make(tok, cfg, source(["x"]))
        rollouter.rewards = AccOrTimeout()
        task = asyncio.create_task(rollouter.run())
        while not task.done():
            await settle()
            await finish_all(client)
        await asyncio.wait_for(task, 10)
        assert set(queue.groups) == {"e0-p0"}  # 0 (failed) and 1: informative, not a crash
        outcomes = [s.outcome for s in queue.groups["e0-p0"].meta.samples]
        assert sorted(o.reward_error for o in outcomes) == ["", "timeout"]

    asyncio.run(main())


def test_overlong_penalty_is_added_to_the_reward(tok):
    async def main():
        cfg = config(
            **{
                "rollout.sampling.max_new_tokens": 4,
                "reward.overlong_buffer_len": 2,
                "reward.overlong_penalty_factor": 1.0,
            }
        )
        rollouter, client, queue = make(tok, cfg, source(["solved"]), client=ControlledClient(3))
        rollouter.rewards = ScriptedRewards()
        task = asyncio.create_task(rollouter.run())
        await settle()
        await finish_all(client)
        await asyncio.wait_for(task, 10)
        samples = queue.groups["e0-p0"].meta.samples
        # 3 tokens of at most 4, buffer 2: one token into the buffer costs half the factor.
        assert [s.reward for s in samples] == [0.5, 0.5]
        assert samples[0].reward_components == {"task_score": 1.0, "overlong_penalty": -0.5}

    asyncio.run(main())


def test_a_prompt_always_over_the_staleness_cap_is_kept_after_max_stale_drops(tok):
    """A trainer that drops every group over the cap unless the rollouter marked it ``keep_stale`` (what
    Trainer._lease_groups does): the prompt is regenerated max_stale_drops times, then trained on."""

    class AlwaysTooStale(RecordingQueue):
        async def put(self, group, *, partition="train", timeout_s=None) -> bool:
            stored = await super().put(group, partition=partition, timeout_s=timeout_s)
            if stored and not group.meta.keep_stale:
                self.drop(group.group_id)
            return stored

    async def main():
        cfg = config(**{"async.max_stale_drops": 2, "rollout.n": 1, "trainer.batch_groups": 1})
        rollouter, client, queue = make(tok, cfg, source(["solved"]), queue=AlwaysTooStale())
        task = asyncio.create_task(rollouter.run())
        while not task.done():
            await settle()
            await finish_all(client)
        await asyncio.wait_for(task, 10)
        assert sorted(queue.groups) == ["e0-p0", "e0-p0-a1", "e0-p0-a2"]
        assert queue.groups["e0-p0-a2"].meta.keep_stale is True
        assert not queue.groups["e0-p0-a1"].meta.keep_stale
        metrics = rollouter.metrics()
        assert metrics["rollouter/groups_dropped"] == 2 and metrics["rollouter/stale_kept_groups"] == 1

    asyncio.run(main())
