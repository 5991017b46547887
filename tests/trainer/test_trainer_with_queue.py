"""The trainer against a real queue server process: two gloo ranks via ``run_trainer_rank`` train, ack and
publish; and a run resumed from its checkpoint on a fresh server restored from the snapshot trains every
sample exactly once (counted by uid)."""

from __future__ import annotations

import math

import torch
import torch.multiprocessing as mp

from slipstream.queue.batch import collate
from slipstream.queue.client import QueueClient
from slipstream.queue.config import QueueConfig
from slipstream.queue.server import start_queue_server
from slipstream.trainer.engine.fsdp import FSDPEngine
from slipstream.trainer.launch import run_trainer_rank
from slipstream.trainer.trainer import Trainer, latest_checkpoint
from slipstream.utils.net import free_port
from tests.trainer.conftest import RecordingPublisher, trainer_settings
from tests.trainer.fake_queue import make_group


def _fill(client, n, prefix="g"):
    for i in range(n):
        assert client.put(make_group(f"{prefix}{i}", 4, version=0, seed=i))


def _rank(rank, world, port, model_path, queue_address, out_dir):
    torch.set_num_threads(1)
    cfg = trainer_settings(
        model_path, "trainer.batch_groups=2", f"run.output_dir={out_dir}", "run.resume=false"
    )
    publisher = RecordingPublisher() if rank == 0 else None  # the other ranks drive the gathers
    metrics = run_trainer_rank(
        cfg, rank, world, "127.0.0.1", port, queue_address if rank == 0 else None,
        publish=True, publisher=publisher, num_steps=2,
    )  # fmt: skip
    pushes = publisher.pushes if publisher else []
    published = [(v, sum(math.prod(shape) for shape in shapes.values())) for v, _, shapes in pushes]
    torch.save({"metrics": metrics, "published": published}, f"{out_dir}/rank{rank}.pt")


def test_two_ranks_train_from_a_real_queue(tiny_model_path, tmp_path):
    server = start_queue_server(QueueConfig())
    try:
        with QueueClient(server.address) as client:
            _fill(client, 4)
            args = (2, free_port(), str(tiny_model_path), server.address, str(tmp_path))
            mp.start_processes(_rank, args=args, nprocs=2, start_method="spawn")
            stats = client.stats().partitions["train"]
            assert stats.acked_total == 4
    finally:
        server.stop()
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert [m["trainer/loss"] for m in r0["metrics"]] == [m["trainer/loss"] for m in r1["metrics"]]
    assert [v for v, _ in r0["published"]] == [1, 2] and r1[
        "published"
    ] == []  # rank 1 only drove the gathers
    from transformers import AutoModelForCausalLM

    whole = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model_path).parameters())
    assert r0["published"][0][1] == whole  # full tensors, gathered from both ranks' shards


def test_resume_on_a_fresh_server_trains_every_sample_once(tiny_model_path, single_process_group, tmp_path):
    cfg = trainer_settings(
        tiny_model_path, "trainer.batch_groups=2", "trainer.checkpoint_every=2", f"run.output_dir={tmp_path}"
    )
    all_uids = {f"g{i}-{j}" for i in range(6) for j in range(4)}
    queue_cfg = QueueConfig(snapshot_dir=str(tmp_path / cfg.run.name / "checkpoints"))  # the checkpoint root
    first_server = start_queue_server(queue_cfg)
    before = []
    try:
        with QueueClient(first_server.address) as client:
            _fill(client, 6)
            engine = FSDPEngine(cfg)
            engine.initialize()
            trainer = Trainer(cfg, engine, client, rank=0, world_size=1, collate_fn=collate)
            for _ in range(3):  # checkpoint at version 2; the third step is lost with the server
                trainer.step()
                if trainer.version <= 2:
                    before += trainer.last_batch_uids
    finally:
        first_server.stop()
    ckpt = latest_checkpoint(trainer.checkpoint_root)
    second_server = start_queue_server(queue_cfg)
    after = []
    try:
        with QueueClient(second_server.address) as client:
            resumed = Trainer(cfg, FSDPEngine(cfg), client, rank=0, world_size=1, collate_fn=collate)
            resumed.engine.initialize()
            resumed.resume(ckpt)
            assert resumed.version == 2
            while client.stats().partitions["train"].ready_groups > 0:
                resumed.step()
                after += resumed.last_batch_uids
    finally:
        second_server.stop()
    trained = before + after
    assert len(trained) == len(set(trained)), "a sample was trained twice"
    assert set(trained) == all_uids, "a sample was lost"
