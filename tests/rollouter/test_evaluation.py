"""Evaluation during training: when it runs, what it computes, that it never feeds the trainer and never holds
up training generation; its config checks, its plot panel and the held-out data it runs on."""

from __future__ import annotations

import asyncio
import json

import pytest
from rollouter_fakes import ControlledClient, InlineRewards, RecordingQueue, settle
from test_rollouter import config, prompts

from slipstream.agents.data import Sample
from slipstream.agents.rewards.runner import RewardResult
from slipstream.config import ConfigError, load_config
from slipstream.rollouter.evaluation import EvalSample, summarize
from slipstream.rollouter.rollouter import Rollouter
from slipstream.utils.tiny_models import make_tiny_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


class VerdictRewards(InlineRewards):
    """Training prompts score 1; a held-out prompt scores 1 when its ground truth is `right`, else 0."""

    async def score(self, data_source, response, ground_truth, extra_info) -> RewardResult:
        return RewardResult(score=0.0 if ground_truth == "wrong" else 1.0)


def val_samples(truths: list[str]) -> list[Sample]:
    return [
        Sample(
            index=i, messages=[{"role": "user", "content": f"v{i}"}], data_source="arithmetic", ground_truth=t
        )
        for i, t in enumerate(truths)
    ]


def make_eval(tok, truths, **overrides):
    cfg = config(**{"eval.every": 2, "eval.n": 2, "eval.max_concurrent": 2, **overrides})
    client, queue = ControlledClient(), RecordingQueue()
    rollouter = Rollouter(cfg, client, queue, tok, prompts(40, epochs=1), val_samples=val_samples(truths))
    rollouter.rewards = rollouter.evaluator.rewards = VerdictRewards()
    rollouter.poll_s = 0.01
    return rollouter, client, queue


def eval_rids(client: ControlledClient, version: int | None = None) -> list[str]:
    prefix = "eval-" if version is None else f"eval-v{version}-"
    return sorted(rid for rid in client.pending if rid.startswith(prefix))


def finish(client: ControlledClient, *, evaluation: bool) -> None:
    for rid in list(client.pending):
        if rid.startswith("eval-") == evaluation:
            client.finish(rid)


async def until(predicate, rounds: int = 500) -> None:
    for _ in range(rounds):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


# ---------------------------------------------------------------------------------------------- metrics
def test_mean_and_pass_at_n_on_a_hand_checked_reward():
    def s(prompt, score, **components):
        return EvalSample(prompt_index=prompt, data_source="math", score=score, components=components)

    # A -1/1 reward with an `acc` verdict (math_signed): prompt 0 solved once, prompt 1 never, prompt 2 twice.
    signed = [s(0, 1.0, acc=1.0), s(0, -1.0, acc=0.0), s(1, -1.0, acc=0.0), s(1, -1.0, acc=0.0),
              s(2, 1.0, acc=1.0), s(2, 1.0, acc=1.0)]  # fmt: skip
    m = summarize(signed, n=2, version=4)
    assert m["eval/mean@2"] == 0.0 and m["eval/pass@2"] == pytest.approx(2 / 3)
    assert m["eval/prompts"] == 3 and m["eval/samples"] == 6 and m["eval/version"] == 4
    # Without `acc`, a sample is correct when its reward is positive (a shaped 0.5 counts, 0 does not).
    plain = [s(0, 0.5), s(0, 0.0), s(1, 0.0), s(1, 0.0)]
    m = summarize(plain, n=2, version=0)
    assert m["eval/mean@2"] == 0.125 and m["eval/pass@2"] == 0.5
    # `acc` wins over the score: a positive score with acc 0 is wrong.
    assert summarize([s(0, 0.2, acc=0.0)], n=1, version=0)["eval/pass@1"] == 0.0
    # Two data sources: each gets its own pair beside the overall one.
    mixed = [*plain, EvalSample(prompt_index=7, data_source="count", score=1.0)]
    m = summarize(mixed, n=2, version=0)
    assert m["eval/math/pass@2"] == 0.5 and m["eval/count/pass@2"] == 1.0 and m["eval/pass@2"] == 2 / 3


# ---------------------------------------------------------------------------------------------- rollouter
def test_eval_runs_at_version_0_and_every_eval_every_versions_without_reaching_the_queue(tok):
    async def main():
        rollouter, client, queue = make_eval(tok, ["right", "wrong", "right"])
        task = asyncio.create_task(rollouter.run())
        await settle()
        # Version 0 is evaluated before any training step; at most eval.max_concurrent requests at once.
        assert len(eval_rids(client, 0)) == 2
        for version in range(1, 7):
            while eval_rids(client):
                finish(client, evaluation=True)
                await settle()
            finish(client, evaluation=False)
            await settle()
            rollouter.set_version(version)
            client.version = version
            await settle()
        while eval_rids(client):
            finish(client, evaluation=True)
            await settle()
        assert rollouter.evaluator.evaluated == [0, 2, 4, 6]
        started = {rid.split("-")[1] for rid, _, _ in client.requests if rid.startswith("eval-")}
        assert started == {"v0", "v2", "v4", "v6"}
        # 3 prompts x n=2 per evaluation: mean@2 = pass@2 = 2/3 with one prompt always wrong.
        metrics = rollouter.metrics()
        assert metrics["eval/version"] == 6 and metrics["eval/samples"] == 6
        assert metrics["eval/mean@2"] == pytest.approx(2 / 3) and metrics["eval/pass@2"] == pytest.approx(
            2 / 3
        )
        assert metrics["eval/skipped"] == 0 and metrics["eval/partial_ratio"] == 0
        assert "eval/version" not in rollouter.metrics()  # each evaluation is reported once
        # The queue holds training groups only, and the gate never counted an evaluation.
        uids = [uid for g in queue.groups.values() for uid in g.uids]
        assert uids and not any(uid.startswith("eval") for uid in uids)
        assert rollouter.metrics()["rollouter/trajectories"] == 0  # eval samples are not rollouter stats
        await rollouter.stop()
        await asyncio.wait_for(task, 10)

    asyncio.run(main())


def test_training_groups_keep_being_put_while_an_eval_is_in_flight(tok):
    async def main():
        cfg = {"async.staleness_threshold": 3}
        rollouter, client, queue = make_eval(tok, ["right"] * 4, **cfg)
        task = asyncio.create_task(rollouter.run())
        await settle()
        held = eval_rids(client, 0)
        assert len(held) == 2  # the evaluation holds its two slots and finishes none
        for _ in range(3):
            finish(client, evaluation=False)
            await settle()
        # Four batches of two groups were admitted and put while the evaluation's requests stayed open.
        assert len(queue.groups) == 8 and eval_rids(client, 0) == held
        assert rollouter.evaluator.running
        # The next due version finds it still running: skipped and counted, not started beside it.
        rollouter.set_version(2)
        await settle()
        assert eval_rids(client) == held and rollouter.metrics()["eval/skipped"] == 1
        while eval_rids(client):
            finish(client, evaluation=True)
            await settle()
        assert rollouter.evaluator.evaluated == [0]
        await rollouter.stop()
        await asyncio.wait_for(task, 10)

    asyncio.run(main())


def test_an_eval_request_cut_by_a_push_is_resumed_on_the_new_weights(tok):
    async def main():
        rollouter, client, queue = make_eval(tok, ["right", "wrong"], **{"eval.n": 1})
        task = asyncio.create_task(rollouter.run())
        await settle()
        cut = eval_rids(client, 0)
        assert cut == ["eval-v0-p0-0", "eval-v0-p1-0"]
        client.abort_running()  # the push pauses the servers: every request returns its partial tokens
        client.version = 1
        rollouter.set_version(1)
        await settle()
        assert sorted(eval_rids(client)) == [f"{rid}.r1" for rid in cut]  # resumed, not restarted
        while eval_rids(client):
            finish(client, evaluation=True)
            await settle()
        metrics = rollouter.metrics()
        # The evaluation belongs to version 0; its tokens came from versions 0 (before the cut) and 1.
        assert metrics["eval/version"] == 0 and metrics["eval/token_version_max"] == 1
        assert metrics["eval/partial_ratio"] == 1.0 and metrics["eval/mean@1"] == 0.5
        resumed = [
            (rid, ids) for rid, ids, _ in client.requests if rid.startswith("eval-") and rid.endswith(".r1")
        ]
        first = {rid: ids for rid, ids, _ in client.requests if rid in cut}
        for rid, ids in resumed:  # prompt + the partial token, as training requests are resumed
            assert ids[: len(first[rid[:-3]])] == first[rid[:-3]] and len(ids) == len(first[rid[:-3]]) + 1
        await rollouter.stop()
        await asyncio.wait_for(task, 10)

    asyncio.run(main())


def test_stop_ends_a_running_eval(tok):
    async def main():
        rollouter, client, queue = make_eval(tok, ["right"] * 3)
        task = asyncio.create_task(rollouter.run())
        await settle()
        assert rollouter.evaluator.running
        await rollouter.stop()
        await asyncio.wait_for(task, 10)
        assert not rollouter.evaluator.running and rollouter.evaluator.evaluated == []
        assert "eval/version" not in rollouter.metrics()

    asyncio.run(main())


def test_evaluation_off_adds_nothing(tok):
    async def main():
        client, queue = ControlledClient(), RecordingQueue()
        rollouter = Rollouter(config(), client, queue, tok, prompts(2), val_samples=val_samples(["right"]))
        rollouter.rewards = InlineRewards()
        task = asyncio.create_task(rollouter.run())
        await settle()
        assert not eval_rids(client) and not any(k.startswith("eval/") for k in rollouter.metrics())
        await rollouter.stop()
        await asyncio.wait_for(task, 10)

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------- real processes
def test_eval_against_a_real_server_and_queue(embedded_server, tok, tmp_path):
    """A server process, a queue server and reward worker processes: the run puts its training groups, the
    evaluation of version 0 scores every held-out sample, and the queue holds no evaluation sample."""
    from slipstream.queue.client import AsyncQueueClient
    from slipstream.queue.config import QueueConfig
    from slipstream.queue.server import QueueServer
    from slipstream.rollouter.balancer import LoadBalancer
    from slipstream.serverkinds.sglang import SGLangClient

    cfg = config(**{"eval.every": 1, "eval.n": 3, "eval.max_concurrent": 2, "reward.num_workers": 1,
                    "rollout.sampling.max_new_tokens": 6, "data.max_prompt_tokens": 1024})  # fmt: skip
    val = [
        Sample(
            index=i,
            messages=[{"role": "user", "content": f"What is {i} + 1?"}],
            data_source="arithmetic",
            ground_truth=str(i + 1),
        )  # fmt: skip
        for i in range(3)
    ]
    queue_server = QueueServer(
        QueueConfig(capacity_groups=8, shm_bytes_per_unit=8 << 20, io_threads=1)
    ).start()

    async def main():
        client = SGLangClient(embedded_server.url)
        queue = AsyncQueueClient(queue_server.address)
        balancer = LoadBalancer([client], max_concurrent_per_server=8)
        rollouter = Rollouter(cfg, balancer, queue, tok, prompts(2), val_samples=val)
        try:
            await asyncio.wait_for(rollouter.run(), 90)
            await asyncio.wait_for(rollouter.evaluator.evaluate_now(0), 90)
            lease = await queue.lease(2, timeout_s=30)
            await queue.ack(lease)
            return lease.groups, rollouter.metrics()
        finally:
            await rollouter.stop()
            await queue.close()
            await client.aclose()

    try:
        groups, metrics = asyncio.run(main())
    finally:
        queue_server.stop()
    assert sorted(g.group_id for g in groups) == ["e0-p0", "e0-p1"]
    assert not any(uid.startswith("eval") for g in groups for uid in g.uids)
    assert metrics["eval/version"] == 0 and metrics["eval/samples"] == 9 and metrics["eval/prompts"] == 3
    assert 0 <= metrics["eval/mean@3"] <= metrics["eval/pass@3"] <= 1
    assert 0 < metrics["eval/response_len_mean"] <= 6 and metrics["eval/reward_errors"] == 0
    assert json.dumps(metrics)


# ---------------------------------------------------------------------------------------------- config, data, plot
def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_config_checks_name_the_key_and_the_file(tmp_path):
    from slipstream.agents.datagen import make_rows
    from slipstream.pipeline.modes import check_data

    train = write_jsonl(tmp_path / "train.jsonl", make_rows("arithmetic", 8))
    cfg = load_config(None, [f"data.train_files=[{train}]", "eval.every=5"])
    with pytest.raises(ConfigError, match=r"^eval\.every: 5 evaluates data\.val_files, which is empty"):
        check_data(cfg)
    missing = tmp_path / "heldout.jsonl"
    cfg = load_config(None, [f"data.train_files=[{train}]", f"data.val_files=[{missing}]", "eval.every=5"])
    with pytest.raises(ConfigError, match=rf"^data\.val_files: {missing} does not exist$"):
        check_data(cfg)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": [{"role": "user", "content": "q"}]}])
    cfg = load_config(None, [f"data.train_files=[{train}]", f"data.val_files=[{bad}]", "eval.every=5"])
    with pytest.raises(ConfigError, match=rf"^data\.val_files: {bad}: row 0: field `data_source` is missing"):
        check_data(cfg)
    with pytest.raises(ConfigError, match=r"^eval\.n: expected int >= 1"):
        load_config(None, ["eval.n=0"])


def test_datagen_holds_out_problems_the_training_file_never_asks(tmp_path):
    from slipstream.agents.data import load_samples
    from slipstream.pipeline.modes import make_missing_data

    train, val = tmp_path / "train.parquet", tmp_path / "val.jsonl"
    cfg = load_config(None, ["datagen.task=arithmetic", "datagen.n=600", "datagen.val_n=30",
                             f"data.train_files=[{train}]", f"data.val_files=[{val}]"])  # fmt: skip
    assert make_missing_data(cfg) == [train, val]
    asked = {s.messages[0]["content"] for s in load_samples([train])}
    held = [s.messages[0]["content"] for s in load_samples([val])]
    assert len(held) == len(set(held)) == 30 and not asked & set(held)
    cfg = load_config(
        None, ["datagen.task=arithmetic", "datagen.val_n=60", f"data.val_files=[{tmp_path / 'x.jsonl'}]"]
    )
    with pytest.raises(ConfigError, match="the heldout split of `arithmetic` gave only"):
        make_missing_data(cfg)


def test_plot_draws_the_eval_panel_against_the_version_evaluated(tmp_path):
    from slipstream.metrics import MetricsLogger
    from slipstream.plot import PANELS, X_AXES, plot_run, series

    cfg = load_config(None, ["wandb.mode=disabled"])
    with MetricsLogger(tmp_path, cfg, total_steps=6) as log:
        for step in range(1, 7):
            record = {"trainer/reward_mean": step / 10}
            if step % 2 == 0:  # an evaluation of the version before is reported a step later
                record |= {"eval/version": step - 2, "eval/mean@4": step / 20, "eval/pass@4": step / 10}
            log.log(step, record)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    data = series(records, PANELS["eval"][1], X_AXES["eval"][0])
    assert data == {"eval/mean@4": ([0, 2, 4], [0.1, 0.2, 0.3]), "eval/pass@4": ([0, 2, 4], [0.2, 0.4, 0.6])}
    assert {p.name for p in plot_run(tmp_path)} >= {"eval.png", "reward.png", "summary.png"}
