"""The trainer loop on one process with an in-process queue: staleness policies, publish hook, algorithm
variants, and resume from a checkpoint that loses and repeats no sample."""

from __future__ import annotations

import pytest
import torch

from slipstream.trainer.engine import make_aux_engines
from slipstream.trainer.engine.fsdp import FSDPEngine
from slipstream.trainer.trainer import Trainer, latest_checkpoint
from tests.trainer.conftest import RecordingPublisher, trainer_settings
from tests.trainer.fake_queue import FakeQueue, collate, make_group


def _trainer(cfg, queue, **kw):
    engine = FSDPEngine(cfg)
    engine.initialize()
    aux = make_aux_engines(cfg)
    return Trainer(cfg, engine, queue, rank=0, world_size=1, collate_fn=collate, **aux, **kw)


def _fill(queue, n_groups, *, version=0, prefix="g"):
    for i in range(n_groups):
        queue.put(make_group(f"{prefix}{i}", 4, version=version, seed=i))


def test_drop_policy_leases_more_and_acks_dropped(tiny_model_path, single_process_group, tmp_path):
    cfg = trainer_settings(
        tiny_model_path, "trainer.batch_groups=2", "async.max_staleness=1", f"run.output_dir={tmp_path}"
    )
    queue = FakeQueue()
    queue.put(make_group("old", 4, version=0))
    _fill(queue, 3, version=3, prefix="new")
    trainer = _trainer(cfg, queue)
    trainer.version = 3  # the old group is 3 versions stale, over the bound of 1
    metrics = trainer.step()
    assert queue.dropped == ["old"]
    assert sorted(queue.acked) == ["new0", "new1"]
    assert not queue.leased
    assert metrics["trainer/dropped_groups"] == 1.0
    assert metrics["trainer/staleness_versions_max"] == 0.0
    assert all(uid.startswith("new") for uid in trainer.last_batch_uids)
    assert metrics["trainer/tokens_per_s"] > 0 and torch.isfinite(torch.tensor(metrics["trainer/loss"]))


def test_keep_policy_trains_on_stale_groups(tiny_model_path, single_process_group, tmp_path):
    cfg = trainer_settings(
        tiny_model_path, "trainer.batch_groups=2", "async.max_staleness=1", "async.stale_policy=keep"
    )
    queue = FakeQueue()
    queue.put(make_group("old", 4, version=0))
    _fill(queue, 1, version=3, prefix="new")
    trainer = _trainer(cfg, queue)
    trainer.version = 3
    metrics = trainer.step()
    assert queue.dropped == [] and sorted(queue.acked) == ["new0", "old"]
    assert metrics["trainer/staleness_versions_max"] == 3.0


def test_staleness_metric_counts_versions_as_the_cap_does(tiny_model_path, single_process_group):
    """With a push every 2 steps, tokens from step 0 are 2 versions old at step 5: the metric and the cap
    (``max_staleness``) count the same versions, not the 5 steps."""
    cfg = trainer_settings(
        tiny_model_path,
        "trainer.batch_groups=2",
        "async.max_staleness=1",
        "async.stale_policy=keep",
        "async.sync_every=2",
    )
    queue = FakeQueue()
    queue.put(make_group("old", 4, version=0))
    _fill(queue, 1, version=5, prefix="new")
    trainer = _trainer(cfg, queue)
    trainer.version = 5
    metrics = trainer.step()
    assert cfg.staleness(5, 0) == 2
    assert metrics["trainer/staleness_versions_max"] == 2.0
    assert metrics["trainer/staleness_versions_mean"] == 1.0


def test_failed_step_nacks_its_leases(tiny_model_path, single_process_group, monkeypatch):
    cfg = trainer_settings(tiny_model_path, "trainer.batch_groups=2")
    queue = FakeQueue()
    _fill(queue, 2)
    trainer = _trainer(cfg, queue)
    monkeypatch.setattr(trainer.engine, "optimizer_step", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        trainer.step()
    assert len(queue.ready) == 2 and not queue.leased and not queue.acked


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.algorithm.policy_loss=decoupled_ppo", "trainer.mini_batches=2", "trainer.epochs=2"],
        [
            "trainer.algorithm.policy_loss=gspo",
            "trainer.algorithm.tis_level=sequence",
            "trainer.algorithm.kl_type=k3",
            "trainer.algorithm.kl_coef=0.1",
            "trainer.algorithm.entropy_coef=0.01",
            "trainer.algorithm.loss_agg_mode=seq-mean-token-sum-norm",
        ],
        [
            "trainer.algorithm.adv_estimator=gae",
            "trainer.algorithm.policy_loss=cispo",
            "trainer.algorithm.rejection=seq_mean_k1",
            "trainer.algorithm.rejection_high=1000",
        ],
    ],
    ids=["decoupled-minibatches", "gspo-tis-kl-entropy", "gae-critic-cispo-rejection"],
)
def test_algorithm_variants_run_a_step(tiny_model_path, single_process_group, overrides):
    cfg = trainer_settings(tiny_model_path, "trainer.batch_groups=2", *overrides)
    queue = FakeQueue()
    _fill(queue, 2)
    metrics = _trainer(cfg, queue).step()
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    assert metrics["trainer/grad_norm"] > 0
    if "gae" in overrides[0]:
        assert "trainer/vf_loss" in metrics


def test_publish_every_sync_every_steps(tiny_model_path, single_process_group):
    cfg = trainer_settings(tiny_model_path, "trainer.batch_groups=1", "async.sync_every=2")
    queue = FakeQueue()
    _fill(queue, 4)
    publisher = RecordingPublisher()
    trainer = _trainer(cfg, queue, publisher=publisher)
    trainer.fit(4)
    assert [(v, sent) for v, sent, _ in publisher.pushes] == [(2, "full"), (4, "full")]
    names = dict(trainer.engine.model.named_parameters())
    assert set(publisher.pushes[0][2]) == set(names)


def test_resume_with_queue_snapshot_loses_and_repeats_nothing(
    tiny_model_path, single_process_group, tmp_path
):
    cfg = trainer_settings(
        tiny_model_path, "trainer.batch_groups=2", "trainer.checkpoint_every=2", f"run.output_dir={tmp_path}"
    )
    snapshots = tmp_path / cfg.run.name / "checkpoints"  # the queue's snapshot_dir: the checkpoint root
    queue = FakeQueue(snapshot_dir=snapshots)
    _fill(queue, 8)
    all_uids = {f"g{i}-{j}" for i in range(8) for j in range(4)}

    first = _trainer(cfg, queue)
    trained_before_checkpoint = []
    for _ in range(3):  # checkpoint after step 2; step 3 is lost in the "crash"
        first.step()
        if first.version <= 2:
            trained_before_checkpoint += first.last_batch_uids
    ckpt = latest_checkpoint(first.checkpoint_root)
    assert ckpt is not None and ckpt.name == "step_00000002"

    restored_queue = FakeQueue(snapshot_dir=snapshots)  # a fresh server process restored from the snapshot
    second = _trainer(cfg, restored_queue)
    second.resume(ckpt)
    assert second.version == 2
    trained_after = []
    while restored_queue.ready:
        second.step()
        trained_after += second.last_batch_uids
    trained = trained_before_checkpoint + trained_after
    assert len(trained) == len(set(trained)), "a sample was trained twice"
    assert set(trained) == all_uids, "a sample was lost"
    assert second.version == 4


def test_a_group_delivered_again_is_acked_not_trained_twice(tiny_model_path, single_process_group, tmp_path):
    cfg = trainer_settings(tiny_model_path, "trainer.batch_groups=2", f"run.output_dir={tmp_path}")
    queue = FakeQueue()
    # g0 comes back after its step (leases that expired unacked), g4 a second time within one batch
    for gid in ["g0", "g1", "g2", "g0", "g3", "g4", "g0", "g4", "g5"]:
        queue.put(make_group(gid, 4, version=0, seed=int(gid[1:])))
    trainer = _trainer(cfg, queue)
    trained = []
    for _ in range(3):
        trainer.step()
        trained += trainer.last_batch_uids
    assert len(trained) == len(set(trained)), "a sample was trained twice"
    assert set(trained) == {f"g{i}-{j}" for i in range(6) for j in range(4)}
    assert not queue.ready and not queue.leased
    assert sorted(queue.acked) == ["g0"] * 3 + [
        "g1",
        "g2",
        "g3",
        "g4",
        "g4",
        "g5",
    ]  # copies acked, not dropped
    assert queue.dropped == []


def test_kl_to_a_frozen_reference_starts_at_zero_and_grows_as_the_policy_moves(
    tiny_model_path, single_process_group
):
    cfg = trainer_settings(
        tiny_model_path, "trainer.batch_groups=2", "trainer.lr=0.05", "trainer.algorithm.kl_type=k3",
        "trainer.algorithm.kl_coef=0.1", "trainer.algorithm.kl_reference=reference",
    )  # fmt: skip
    queue = FakeQueue()
    _fill(queue, 8)
    trainer = _trainer(cfg, queue)
    before = {n: p.detach().clone() for n, p in trainer.reference.get_per_tensor_param()}
    first = trainer.step()
    later = [trainer.step()["trainer/kl"] for _ in range(3)]
    assert first["trainer/kl"] == 0.0  # the policy is still the reference
    assert max(later) > 0.0
    after = dict(trainer.reference.get_per_tensor_param())
    assert all(torch.equal(before[n], after[n]) for n in before)  # the reference never trains


def test_a_reference_kl_needs_a_kl_penalty():
    from slipstream.trainer.config import AlgorithmConfig

    with pytest.raises(ValueError, match="kl_type"):
        AlgorithmConfig(kl_reference="reference")
