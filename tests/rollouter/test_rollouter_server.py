"""The agent loops and the rollouter against a real embedded server process and a real queue server.

A random tiny model never writes a tool call, so the module first *teaches* it one conversation: a few
seconds of Adam on the tiny model, with the loss on the assistant tokens only, until greedy decoding
(temperature 0) reproduces both assistant turns exactly (checked before the model is saved):

    user:      What is 6 * 7? Use python.
    assistant: <tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>
    tool:      42
    assistant: The answer is 42.

Over-fitting was chosen over a stop-token trick because it exercises the real path end to end: the model
generates the call, the loop parses it, the sandbox runs it, the template renders the result and the model
continues from the exact ids. One server process with that model serves every test of the module.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest
import torch

from slipstream.agents.chat import ChatRenderer
from slipstream.agents.config import AgentConfig
from slipstream.agents.data import PromptSource, Sample
from slipstream.agents.protocol import SamplingParams
from slipstream.agents.registry import make_agent_loop
from slipstream.agents.tools import make_tools
from slipstream.agents.tools.sandbox import sandbox_problem
from slipstream.config import load_config, rollouter_settings
from slipstream.queue.client import AsyncQueueClient
from slipstream.queue.config import QueueConfig
from slipstream.queue.server import QueueServer
from slipstream.rollouter.balancer import LoadBalancer
from slipstream.rollouter.config import EmbeddedServerConfig, RolloutConfig
from slipstream.rollouter.launch import launch_server
from slipstream.rollouter.partial import PartialRolloutClient
from slipstream.rollouter.rollouter import Rollouter
from slipstream.serverkinds import server_kind
from slipstream.serverkinds.sglang import SGLangClient

QUESTION = [{"role": "user", "content": "What is 6 * 7? Use python."}]
CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
TOOL_REPLY = "42\n"  # what the sandbox prints for print(6 * 7)
ANSWER = "The answer is 42."
ENGINE = EmbeddedServerConfig(
    num_threads=1, max_model_len=1024, kv_cache_tokens=8192, kv_page_size=64, max_batch_tokens=512, seed=0
)


SANDBOX_PROBLEM = sandbox_problem()  # None where the python tool's boundary can be built here


def episode_ids(tok) -> dict[str, list[int]]:
    """The token ids of the taught conversation, piece by piece, as the tool loop builds them."""
    schema_only = AgentConfig(sandbox_unsafe_no_isolation=SANDBOX_PROBLEM is not None)  # no code runs here
    renderer = ChatRenderer(tok, tools=[t.schema() for t in make_tools(["python"], schema_only).values()])
    eot = renderer.end_of_turn_id
    return {
        "prompt": renderer.prompt_ids(QUESTION),
        "turn1": renderer.encode(CALL) + [eot],
        "tool": renderer.tool_turn_ids(
            [{"role": "tool", "content": TOOL_REPLY, "name": "python"}], ended_turn=True
        ),
        "turn2": renderer.encode(ANSWER) + [eot],
    }


def teach(model_path, out_dir, pieces: dict[str, list[int]], max_steps: int = 400):
    """Over-fit the model on the conversation until every assistant token is the arg-max by a margin of 2
    nats (so that the server's float32 kernels, which differ slightly from training's, decode the same)."""
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        ids = pieces["prompt"] + pieces["turn1"] + pieces["tool"] + pieces["turn2"]
        mask = [0] * len(pieces["prompt"]) + [1] * len(pieces["turn1"]) + [0] * len(pieces["tool"])
        mask += [1] * len(pieces["turn2"])
        inputs, targets = torch.tensor([ids[:-1]]), torch.tensor(ids[1:])
        weight = torch.tensor(mask[1:], dtype=torch.bool)
        optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
        for _ in range(max_steps):
            logits = model(inputs).logits[0]
            if _margin(logits[weight], targets[weight]) > 2.0:
                break
            loss = torch.nn.functional.cross_entropy(logits[weight], targets[weight])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        assert _margin(logits[weight], targets[weight]) > 2.0, "the conversation was not learned"
        model.save_pretrained(out_dir)
    finally:
        torch.set_num_threads(threads)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (model_path / name).exists():
            shutil.copy(model_path / name, out_dir / name)
    return out_dir


@torch.no_grad()
def _margin(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Smallest gap between the target's logit and the best other logit, over all positions."""
    target = logits.gather(1, targets[:, None])[:, 0]
    other = logits.scatter(1, targets[:, None], float("-inf")).max(-1).values
    return float((target - other).min())


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def taught_server(tiny_model_path, tok, tmp_path_factory):
    """An embedded server process serving the taught model (weight version 0)."""
    out = tmp_path_factory.mktemp("taught-model")
    teach(tiny_model_path, out, episode_ids(tok))
    server = launch_server(
        server_kind("embedded"), out, cfg=RolloutConfig(embedded=ENGINE), log_path=out / "server.log"
    )
    server.model_dir = out
    try:
        server.wait_healthy(timeout_s=180)
        yield server
    finally:
        server.stop()


class Recording:
    """Wraps a client and keeps every raw server output, to compare with the trajectory."""

    def __init__(self, client):
        self.client = client
        self.outputs = []

    async def generate(self, input_ids, sampling, *, rid=None, session_id=None):
        out = await self.client.generate(input_ids, sampling, rid=rid, session_id=session_id)
        self.outputs.append((list(input_ids), out))
        return out

    async def abort(self, rid):
        await self.client.abort(rid)


@pytest.mark.skipif(SANDBOX_PROBLEM is not None, reason=f"python tool sandbox unavailable: {SANDBOX_PROBLEM}")
def test_tool_episode_with_python_sandbox_keeps_exact_ids(taught_server, tok):
    pieces = episode_ids(tok)

    async def main():
        client = SGLangClient(taught_server.url)
        try:
            recording = Recording(client)
            loop = make_agent_loop(AgentConfig(name="tool", tools=["python"], max_turns=3), recording, tok)
            sample = Sample(index=0, messages=QUESTION, data_source="arithmetic", ground_truth="42")
            return await loop.run(
                sample, SamplingParams(max_new_tokens=120, temperature=0.0), uid="tool-0"
            ), recording
        finally:
            await client.aclose()

    out, recording = asyncio.run(asyncio.wait_for(main(), 120))
    out.validate()
    assert out.finish_reason == "stop" and out.num_turns == 2
    assert out.metrics == {"tool_calls": 1.0, "tool_errors": 0.0}
    assert out.response_text == ANSWER
    # The model called the sandbox, which printed 42; the result came back through the chat template.
    assert "<tool_response>\n42\n\n</tool_response>" in tok.decode(pieces["tool"])
    assert out.prompt_ids == pieces["prompt"]
    assert out.response_ids == pieces["turn1"] + pieces["tool"] + pieces["turn2"]

    # Exact ids: the response is the server's outputs and the inserted tool tokens, nothing re-encoded.
    (input1, first), (input2, second) = recording.outputs
    assert input1 == out.prompt_ids
    assert input2 == out.prompt_ids + first.output_ids + pieces["tool"]
    assert out.response_ids == first.output_ids + pieces["tool"] + second.output_ids
    n1, nt = len(first.output_ids), len(pieces["tool"])
    assert out.loss_mask == [1] * n1 + [0] * nt + [1] * len(second.output_ids)
    assert out.logprobs == first.logprobs + [0.0] * nt + second.logprobs
    assert all(lp <= 0.0 for lp in first.logprobs + second.logprobs)
    assert out.versions == [0] * len(out.response_ids)


def test_rollouter_streams_scored_groups_into_a_real_queue(taught_server, tok, tmp_path):
    """Server process + queue server + reward worker process: two groups of the taught prompt go through
    the whole rollouter and come back from the queue with rewards, masks and versions."""
    cfg = load_config(
        None,
        [
            "agent.name=tool", "agent.tools=[python]", "rollout.n=2", "trainer.batch_groups=2",
            # where the sandbox cannot be built, the test's own print(6 * 7) runs with limits only
            f"agent.sandbox_unsafe_no_isolation={str(SANDBOX_PROBLEM is not None).lower()}",
            "async.staleness_threshold=0", "rollout.sampling.max_new_tokens=120",
            "rollout.sampling.temperature=0", "reward.num_workers=1", "data.max_prompt_tokens=1024",
            f"rollout.server_urls=[{taught_server.url}]",
        ],
    )  # fmt: skip
    samples = [
        Sample(index=i, messages=QUESTION, data_source="arithmetic", ground_truth="42") for i in range(2)
    ]
    # The queue server runs in this process (its own thread and real ZeroMQ sockets): starting a queue
    # process costs seconds of imports that the queue's own tests already pay.
    queue_server = QueueServer(
        QueueConfig(capacity_groups=8, shm_bytes_per_unit=8 << 20, io_threads=1)
    ).start()

    async def main():
        client = SGLangClient(taught_server.url)
        queue = AsyncQueueClient(queue_server.address)
        balancer = LoadBalancer([client], max_concurrent_per_server=cfg.rollout.max_concurrent_per_server)
        rollouter = Rollouter(
            rollouter_settings(cfg), balancer, queue, tok, PromptSource(samples, shuffle=False)
        )
        try:
            await asyncio.wait_for(rollouter.run(), 90)
            lease = await queue.lease(2, timeout_s=30)
            metrics = rollouter.metrics()
            await queue.ack(lease)
            return lease.groups, metrics
        finally:
            await rollouter.stop()
            await queue.close()
            await client.aclose()

    try:
        groups, metrics = asyncio.run(main())
    finally:
        queue_server.stop()
    assert sorted(g.group_id for g in groups) == ["e0-p0", "e0-p1"]
    for group in groups:
        assert group.meta.provenance.prompt_index in (0, 1)
        for traj in group.to_trajectories():
            assert traj.uid.startswith(group.group_id + "-")
            assert traj.reward == 1.0 and traj.num_turns == 2 and traj.finish_reason == "stop"
            assert 0 in traj.loss_mask and traj.loss_mask[0] == 1 and set(traj.versions) == {0}
    assert metrics["rollouter/groups_put"] == 2 and metrics["rollouter/reward_mean"] == 1.0
    assert metrics["rollouter/reward_errors"] == 0 and metrics["rollouter/num_turns_mean"] == 2
    assert json.dumps(metrics)  # plain numbers, ready for the metrics logger


# -------------------------------------------------------------------------------------------------
# Runs last in this module: it changes the server's weights.


def test_partial_rollout_across_a_weight_version_change(taught_server, tok, tiny_model_path):
    """A request is aborted mid-generation by a pause, a new version (different weights) is pushed through
    the weight-sync path, generation resumes: the episode's tokens carry the version that produced them, and
    each token's logprob is that version's teacher-forced logprob (loss mask and logprobs line up).

    Versions alternate between the taught weights (even) and the original random weights (odd), so that an
    attempt in which the request finished before the pause (then tried again) still pushes different
    weights. The prompt is one the taught model continues for long without an end-of-turn token."""
    from transformers import AutoModelForCausalLM

    from slipstream.weightsync.config import WeightSyncConfig
    from slipstream.weightsync.publisher import WeightPublisher

    models = [
        AutoModelForCausalLM.from_pretrained(taught_server.model_dir, dtype=torch.float32).eval(),
        AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval(),
    ]
    sample = Sample(index=0, messages=[{"role": "user", "content": "Count to ten."}], data_source="arithmetic",
                    ground_truth="0")  # fmt: skip
    publisher = WeightPublisher(
        WeightSyncConfig(device="cpu", pause_mode="in_place", bucket_mb=4, timeout_s=60),
        [taught_server.url],
        server_kind("embedded"),
    )

    async def generated_tokens(http) -> int:
        return (await http.get("/model_info")).json()["generated_tokens"]

    async def main():
        client = SGLangClient(taught_server.url)
        http = httpx.AsyncClient(base_url=taught_server.url, timeout=30)
        loop = make_agent_loop(
            AgentConfig(name="single_turn"), PartialRolloutClient(client, max_in_flight=2), tok
        )
        try:
            for version in range(1, 6):
                before = await generated_tokens(http)
                task = asyncio.create_task(
                    loop.run(
                        sample, SamplingParams(max_new_tokens=160, temperature=1.0), uid=f"partial-{version}"
                    )
                )
                while not task.done() and await generated_tokens(http) < before + 4:
                    await asyncio.sleep(0.002)
                await client.pause("abort")  # the request returns its partial tokens; its resume is held
                params = list(models[version % 2].named_parameters())
                report = await asyncio.to_thread(publisher.publish, version, params)
                assert report.ok == [taught_server.url], report
                await client.resume()
                out = await asyncio.wait_for(task, 60)
                if out.num_resumes:
                    return out, version
            raise AssertionError("the request finished before the pause in every attempt")
        finally:
            await http.aclose()
            await client.aclose()

    try:
        out, version = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        publisher.close()
    out.validate()
    old, new = version - 1, version
    k = out.versions.count(old)
    assert out.num_resumes == 1 and 1 <= k < len(out.versions) <= 160
    assert out.versions == [old] * k + [new] * (len(out.versions) - k)
    assert out.loss_mask == [1] * len(out.response_ids) and len(out.logprobs) == len(out.response_ids)

    # Each token's logprob is the one of the weights its version names, given the exact prefix; the two
    # versions really are different policies for these tokens.
    ids = torch.tensor([out.prompt_ids + out.response_ids])
    tokens = torch.tensor(out.response_ids)[:, None]
    with torch.no_grad():
        logp = {
            v: torch.log_softmax(models[v % 2](ids).logits[0, len(out.prompt_ids) - 1 : -1], -1)
            for v in (old, new)
        }
    expected = [
        float(logp[v][i, t]) for i, (t, v) in enumerate(zip(out.response_ids, out.versions, strict=True))
    ]
    assert max(abs(a - b) for a, b in zip(out.logprobs, expected, strict=True)) < 2e-3
    wrong_version = logp[old][k:].gather(1, tokens[k:])[:, 0].tolist()
    assert max(abs(a - b) for a, b in zip(out.logprobs[k:], wrong_version, strict=True)) > 0.1
