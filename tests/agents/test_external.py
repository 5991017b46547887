"""The `external` agent loop: users' harnesses (commands and callables) through the gateway, against a real
embedded server process with the tiny random model. A misbehaving harness costs its own episode, with the
reason recorded, and the next episode runs normally."""

from __future__ import annotations

import asyncio

import pytest

from slipstream.agents.config import AgentConfig, ExternalAgentConfig
from slipstream.agents.data import Sample
from slipstream.agents.protocol import SamplingParams
from slipstream.agents.registry import make_agent_loop
from slipstream.queue.base import QueueProducer
from slipstream.queue.batch import collate
from slipstream.queue.types import GroupMeta, TrajectoryGroup
from slipstream.rollouter.config import EmbeddedServerConfig, RolloutConfig
from slipstream.rollouter.launch import launch_server
from slipstream.rollouter.partial import PartialRolloutClient
from slipstream.serverkinds import server_kind
from slipstream.serverkinds.sglang import SGLangClient

ENGINE = EmbeddedServerConfig(
    num_threads=1, max_model_len=2048, kv_cache_tokens=8192, kv_page_size=64, max_batch_tokens=512, seed=0
)
SAMPLE = Sample(index=0, messages=[{"role": "user", "content": "What is 123 * 456?"}], data_source="arithmetic",
                ground_truth="56088")  # fmt: skip
SAMPLING = SamplingParams(max_new_tokens=8, temperature=1.0)
EXAMPLE = ["{python}", "-m", "slipstream.agents.examples.calculator_harness"]


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("external") / "server.log"
    proc = launch_server(
        server_kind("embedded"), tiny_model_path, cfg=RolloutConfig(embedded=ENGINE), log_path=log
    )
    try:
        proc.wait_healthy(timeout_s=180)
        yield proc
    finally:
        proc.stop()


def run_episodes(server, tok, external: ExternalAgentConfig, n: int = 1, max_turns: int = 4):
    async def main():
        raw = SGLangClient(server.url)
        cfg = AgentConfig(name="external", max_total_tokens=2000, max_turns=max_turns, external=external)
        loop = make_agent_loop(cfg, PartialRolloutClient(raw, max_in_flight=4), tok)
        try:
            return await asyncio.gather(*(loop.run(SAMPLE, SAMPLING, uid=f"x-{i}") for i in range(n)))
        finally:
            await loop.aclose()
            await raw.aclose()

    outs = asyncio.run(asyncio.wait_for(main(), 240))
    for out in outs:
        out.validate()
    return outs


def test_example_harness_as_command_and_as_callable(server, tok):
    for ext in (
        ExternalAgentConfig(command=EXAMPLE, max_concurrent=1),
        ExternalAgentConfig(callable="slipstream.agents.examples.calculator_harness:episode"),
    ):
        outs = run_episodes(server, tok, ext, n=2)
        for out in outs:
            assert out.reward_error == "" and out.reward in (0.0, 1.0), out.reward_error
            assert set(out.reward_components) == {"correct", "tool_calls"}
            assert out.num_turns >= 1 and 1 in out.loss_mask, (out.metrics, out.response_ids, out.num_turns)
            assert out.metrics["episode_failed"] == 0.0 and out.metrics["gateway_requests"] >= 1
            # The prompt is the harness's own conversation (its system message), rendered by the gateway.
            assert "careful assistant" in tok.decode(out.prompt_ids)


def test_exit_status_reward(server, tok):
    win = ["{python}", "-c", "raise SystemExit(0)"]
    lose = ["{python}", "-c", "raise SystemExit(1)"]
    assert run_episodes(server, tok, ExternalAgentConfig(command=win, reward="exit_status"))[0].reward == 1.0
    assert run_episodes(server, tok, ExternalAgentConfig(command=lose, reward="exit_status"))[0].reward == 0.0


@pytest.mark.parametrize(
    ("external", "reason"),
    [
        (ExternalAgentConfig(command=["{python}", "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"]),
         "exited with status 3: boom"),
        (ExternalAgentConfig(command=["{python}", "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]),
         "killed by SIGSEGV"),
        (ExternalAgentConfig(command=["{python}", "-c", "import time; time.sleep(600)"], timeout_s=1.0),
         "did not finish within 1 s"),
        (ExternalAgentConfig(command=["{python}", "-c", "pass"]), "wrote no reward"),
        (ExternalAgentConfig(command=["{python}", "-c", "import os; open(os.environ['SLIPSTREAM_REWARD_FILE'], 'w').write('high')"]),
         "not a number or JSON"),
        (ExternalAgentConfig(command=["/nonexistent/harness"]), "cannot start the harness"),
        (ExternalAgentConfig(callable="harness_plugins:raises_on_bad_request"), "BadRequestError"),
        (ExternalAgentConfig(callable="harness_plugins:returns_text"), "not a number"),
    ],
)  # fmt: skip
def test_a_failing_harness_costs_one_episode_with_its_reason(server, tok, external, reason):
    (out,) = run_episodes(server, tok, external)
    assert reason in out.reward_error
    assert out.reward == external.failure_reward and out.metrics["episode_failed"] == 1.0
    assert out.loss_mask == [0] * len(out.response_ids) and out.response_ids  # nothing of it is trained


def test_malformed_requests_cost_only_themselves(server, tok):
    (out,) = run_episodes(server, tok, ExternalAgentConfig(callable="harness_plugins:malformed_then_answers"))
    assert out.reward_error == "" and out.reward == 0.5 and out.reward_components == {"bad_requests": 1.0}
    assert (
        out.metrics["gateway_errors"] == 1.0 and out.metrics["gateway_requests"] == 1.0
    )  # requests that passed the checks
    assert out.num_turns == 1 and out.loss_mask.count(1) >= 1


def test_config_needs_exactly_one_harness(tok):
    with pytest.raises(ValueError, match="exactly one"):
        make_agent_loop(AgentConfig(name="external"), None, tok)


class _Queue(QueueProducer):
    def __init__(self):
        self.groups: list[TrajectoryGroup] = []

    async def put(
        self, group: TrajectoryGroup, *, partition: str = "train", timeout_s: float | None = None
    ) -> bool:
        self.groups.append(group)
        return True

    async def pop_dropped(self, max_groups: int = 1024) -> list[GroupMeta]:
        return []


def _through_rollouter(server, tok, harness: str, n: int):
    """One group of ``n`` episodes of ``harness`` through a real Rollouter: (what it put, its metrics)."""
    from slipstream.agents.data import PromptSource
    from slipstream.config import load_config, rollouter_settings
    from slipstream.rollouter.rollouter import Rollouter

    overrides = {
        "agent.name": "external",
        "agent.external.callable": harness,
        "agent.max_total_tokens": 512,
        "agent.max_turns": 8,
        "rollout.n": n,
        "rollout.sampling.max_new_tokens": 4,
        "trainer.batch_groups": 1,
        "data.max_prompt_tokens": 512,
    }
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    queue = _Queue()

    async def main():
        client = SGLangClient(server.url)
        rollouter = Rollouter(
            rollouter_settings(cfg), client, queue, tok, PromptSource([SAMPLE], shuffle=False)
        )
        try:
            await rollouter.run()
            return rollouter.metrics()
        finally:
            await rollouter.agent.aclose()
            await client.aclose()

    metrics = asyncio.run(asyncio.wait_for(main(), 240))
    return queue.groups, metrics


def test_rollouter_trains_on_the_harness_reward_and_keeps_a_failure_reason(server, tok):
    """Through the rollouter: the harness's reward replaces the reward function, and a crashing sample is
    one failed trajectory of the group (its reason kept, nothing of it trained), not a failed group."""
    (group,), metrics = _through_rollouter(server, tok, "harness_plugins:first_sample_wins", n=2)
    won, crashed = group.to_trajectories()
    assert won.reward == 0.75 and won.outcome.reward_error == "" and 1 in won.loss_mask
    assert crashed.reward == 0.0 and "harness bug" in crashed.outcome.reward_error
    assert crashed.loss_mask == [0] * len(crashed.response_ids)
    assert metrics["rollouter/reward_errors"] == 1 and metrics["rollouter/failed_episodes"] == 1
    assert metrics["rollouter/gateway_sessions"] == 2 and metrics["rollouter/gateway_requests"] == 1


def test_a_harness_that_compacts_its_history_twice_trains_all_three_segments(server, tok):
    """Each compaction starts a new segment (the summary is not what the model saw before); every segment is
    trained as its own sequence of the episode's group, with the episode's reward."""
    (out,) = run_episodes(
        server, tok, ExternalAgentConfig(callable="harness_plugins:compacts_twice"), max_turns=8
    )
    assert out.reward_error == "" and out.metrics["gateway_divergences"] == 2.0
    segments = [*out.earlier_segments, out]
    assert len(segments) == 3 and [s.num_turns for s in segments] == [2, 2, 2]
    assert "Summary 0" not in tok.decode(segments[0].prompt_ids)
    assert "Summary 0" in tok.decode(segments[1].prompt_ids) and "Summary 1" in tok.decode(
        segments[2].prompt_ids
    )
    for seg in segments:
        seg.validate()
        assert seg.loss_mask.count(1) >= 2  # both replies of the segment are trained

    (group,), _ = _through_rollouter(server, tok, "harness_plugins:compacts_twice", n=2)
    trajectories = group.to_trajectories()
    assert len(trajectories) == 6 and {t.group_id for t in trajectories} == {group.group_id}
    assert sorted(t.uid.removeprefix(group.group_id) for t in trajectories) == [
        "-0", "-0-seg0", "-0-seg1", "-1", "-1-seg0", "-1-seg1"
    ]  # fmt: skip
    assert {t.reward for t in trajectories} == {0.25} and all(1 in t.loss_mask for t in trajectories)
    seg = next(t for t in trajectories if t.uid.endswith("-1-seg1"))
    assert seg.episode == f"{group.group_id}-1" and seg.outcome.segment == 1
    last = next(t for t in trajectories if t.uid.endswith("-1"))  # the episode's own trajectory
    assert last.episode == "" and last.outcome.segment == -1
    batch = collate([group])
    episodes = dict(zip(batch["uids"], batch["episode_index"].tolist(), strict=True))
    assert len(set(episodes.values())) == 2  # six sequences, two episodes
    assert episodes[f"{group.group_id}-1"] == episodes[f"{group.group_id}-1-seg0"] == episodes[seg.uid]
