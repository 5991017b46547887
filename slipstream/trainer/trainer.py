"""The trainer loop: queue → batch → advantages → mini-batch updates → ack → publish → checkpoint.

One :class:`Trainer` runs on every data-parallel rank (SPMD). Rank 0 alone talks to the queue: it leases
whole groups until it holds ``trainer.batch_groups`` fresh enough ones, collates them and broadcasts the
packed tensors (``trainer/dist.py``; no pickle). Every rank then derives the same plan from the same full
batch, so results do not depend on the number of ranks:

  1. staleness: weight pushes since the group's oldest token, ``(version - min(token versions)) //
     sync_every``, per group; over ``async.max_staleness`` (unless the rollouter marked it ``keep_stale``) with
     ``stale_policy=drop`` the group is set aside (acked as dropped, so the rollouter regenerates its
     prompt) and more groups are leased until the batch is full; ``keep`` trains on it;
  2. proximal logprobs (decoupled PPO, truncated IS, rejection) and critic values (GAE) by forward passes
     on rank shards, all-gathered back into full-batch order;
  3. advantages per group over the full batch (``algos/advantages``);
  4. ``trainer.epochs`` passes over ``trainer.mini_batches`` mini-batches of whole groups; each mini-batch is
     split over data-parallel replicas by token count and is one optimizer step, its loss normalised by its global counts;
     the train-inference mismatch (``mismatch/*``, ``trainer/mismatch.py``) is measured on the proximal
     logprobs, or without them on the first update's, both at the weights held before the step;
  5. rank 0 acks the leases (with the dropped group ids); ``version`` += 1; every ``async.sync_every``
     steps, when the trainer publishes (``publish=True``), :meth:`Trainer.push` runs on every rank (rank 0
     sends through its ``publisher``, the others drive the all-gathers); every ``checkpoint_every`` steps (``trainer.checkpoint_every``; 0 under
     the pipeline, which writes them itself) a checkpoint is written.

The trainer is built from :class:`~slipstream.trainer.settings.TrainerSettings` (``slipstream.config.trainer_settings(cfg)``),
which names the few values it takes from other roles (the sampling temperature and token budget, the
staleness cap, the push cadence), never from the root config.

Nothing is lost or trained twice: leases are acked only after the optimizer steps (a failed step nacks
them back), and a checkpoint holds the queue snapshot taken right after the ack, so resuming restores
exactly the samples the saved weights have not seen. The queue delivers at least once (a group whose lease
expired before its ack can come back), so rank 0 also skips, and acks, a group whose uids it trained
recently or already holds for this batch.

Worked example (one process; ``run_trainer_rank`` does the same for N processes)::

    settings = trainer_settings(cfg)
    engine = FSDPEngine(settings); engine.initialize()
    trainer = Trainer(settings, engine, QueueClient(address), rank=0, world_size=1, publish=True,
                      publisher=WeightPublisher(settings.weightsync, server_urls, server_kind("vllm")))
    trainer.fit(100)           # or trainer.step() -> {"trainer/loss": ..., "trainer/staleness_versions_mean": ...}
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tensordict import TensorDict

from slipstream.trainer.algos import ADVANTAGES, AdvantageInputs, global_counts
from slipstream.trainer.batching import partition_for_ranks, sample_lengths, select_samples, split_groups
from slipstream.trainer.dist import broadcast_batch, gather_tokens
from slipstream.trainer.engine.base import ModelEngine
from slipstream.trainer.loss import GlobalCounts, PolicyLoss, ValueLoss
from slipstream.trainer.mismatch import MismatchCollector
from slipstream.utils import checkpoints
from slipstream.utils.logging import get_logger

if TYPE_CHECKING:
    from slipstream.queue.base import QueueConsumer
    from slipstream.trainer.settings import TrainerSettings
    from slipstream.weightsync.publisher import PublishReport, WeightPublisher

log = get_logger(__name__)

# Uids rank 0 remembers having trained, to skip a group delivered again after a lease expiry; covers far more
# than the groups leased within one lease_timeout_s at any realistic rate.
_TRAINED_UIDS_KEPT = 1 << 18

# Peak dense bf16 TFLOP/s per GPU, by a substring of torch.cuda.get_device_name(); for MFU.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0}


class Trainer:
    """Runs RL steps on one rank. Every public method is collective: all ranks call it together.

    ``queue`` is only used on rank 0 (other ranks may pass None). ``critic`` is a value-head engine,
    required when ``trainer.algorithm.adv_estimator`` is ``gae``. ``collate_fn`` turns leased groups into
    a packed batch (default: ``slipstream.queue.batch.collate``).
    """

    def __init__(
        self,
        settings: TrainerSettings,
        engine: ModelEngine,
        queue: QueueConsumer | None,
        *,
        rank: int,
        world_size: int,
        publish: bool = False,
        publisher: WeightPublisher | None = None,
        critic: ModelEngine | None = None,
        reference: ModelEngine | None = None,
        collate_fn: Callable[[list], TensorDict] | None = None,
    ) -> None:
        algo = settings.trainer.algorithm
        if algo.adv_estimator == "gae" and critic is None:
            raise ValueError("adv_estimator `gae` needs a critic engine (Trainer(..., critic=...))")
        ADVANTAGES.get(algo.adv_estimator)  # fail at construction on an unknown name
        if rank == 0 and queue is None:
            raise ValueError("rank 0 needs a queue client")
        if algo.kl_reference == "reference" and algo.kl_type is not None and reference is None:
            raise ValueError(
                "kl_reference `reference` needs a reference engine (Trainer(..., reference=...))"
            )
        self.settings, self.engine, self.queue, self.critic = settings, engine, queue, critic
        self.reference = reference
        self.rank, self.world_size = rank, world_size
        # Every sync_every steps, push (publish: on every rank; publisher: rank 0's, None on the others).
        self.publish, self.publisher = publish or publisher is not None, publisher
        self._collate = collate_fn
        self._images = None  # the model's image processor, loaded with the first batch that has images
        self.version = 0  # weight version = completed trainer steps
        self.last_batch_uids: list[str] = []  # rank 0: the samples the last step trained on
        self._trained: dict[str, None] = {}  # rank 0: recently trained uids, oldest first (see _skip)
        self.checkpoint_root = checkpoints.checkpoint_root(Path(settings.run.output_dir) / settings.run.name)

    # ---------------------------------------------------------------- the loop
    def fit(
        self, num_steps: int, on_step: Callable[[int, dict], None] | None = None
    ) -> list[dict[str, float]]:
        history = []
        for _ in range(num_steps):
            metrics = self.step()
            history.append(metrics)
            if on_step is not None:
                on_step(self.version, metrics)
        return history

    def step(self) -> dict[str, float]:
        """One trainer step (module docstring); returns ``trainer/*`` metrics (identical on every rank)."""
        t0 = time.perf_counter()
        leases, dropped, batch = self._next_batch()
        try:
            metrics = self._train_on(batch)
        except BaseException:
            if self.rank == 0:
                for lease in leases:
                    self.queue.nack(lease)
            raise
        if self.rank == 0:
            for lease in leases:
                self.queue.ack(lease, dropped=dropped.get(lease.lease_id, ()))
            self._remember_trained(self.last_batch_uids)
        self.version += 1
        metrics["trainer/dropped_groups"] = float(self._bcast_scalar(sum(len(v) for v in dropped.values())))
        if self.publish and self.version % self.settings.sync_every == 0:
            t_pub = time.perf_counter()
            self.push(self.publisher, self.version)
            metrics["trainer/publish_s"] = time.perf_counter() - t_pub
        every = self.settings.checkpoint_every
        if every and self.version % every == 0:
            self.save(checkpoints.step_dir(self.checkpoint_root, self.version))
            self._prune_checkpoints()
        elapsed = time.perf_counter() - t0
        metrics["trainer/step_s"] = elapsed
        metrics["trainer/tokens_per_s"] = metrics["trainer/tokens"] / elapsed
        metrics["trainer/version"] = float(self.version)
        self._add_mfu(metrics, batch, elapsed)
        return metrics

    # ---------------------------------------------------------------- batch in
    def _next_batch(self) -> tuple[list, dict[str, list[str]], TensorDict]:
        leases, dropped, batch = [], {}, None
        if self.rank == 0:
            leases, dropped, groups = self._lease_groups()
            batch = self._collate_groups(groups)
            self.last_batch_uids = list(batch.get_non_tensor("uids"))
        if self.world_size > 1:
            batch = broadcast_batch(batch, device=self._comm_device())
        return leases, dropped, batch

    def _lease_groups(self) -> tuple[list, dict[str, list[str]], list]:
        """Lease until ``batch_groups`` groups within the staleness bound are held (rank 0)."""
        tcfg, settings = self.settings.trainer, self.settings
        need = tcfg.batch_groups
        deadline = time.monotonic() + tcfg.batch_timeout_s
        leases, groups, dropped = [], [], {}
        while len(groups) < need:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                for lease in leases:
                    self.queue.nack(lease)
                raise TimeoutError(
                    f"trainer: only {len(groups)} of {need} groups arrived within {tcfg.batch_timeout_s:.0f} s "
                    "(trainer.batch_timeout_s); is the rollouter running?"
                )
            lease = self.queue.lease(
                need - len(groups),
                partition="train",
                timeout_s=min(remaining, 30.0),
                consumer_version=self.version,
            )
            if lease is None:
                continue
            stale = [
                g.group_id
                for g in lease.groups
                if settings.stale_policy == "drop"
                and settings.staleness(self.version, g.min_version) > settings.max_staleness
                and not g.meta.keep_stale  # dropped max_stale_drops times already
            ]
            skip = set(stale) | self._skip(lease.groups, groups)
            groups.extend(g for g in lease.groups if g.group_id not in skip)
            if len(skip) == len(lease.groups):
                self.queue.ack(lease, dropped=stale)  # nothing of it is trained: release it now
                continue
            leases.append(lease)
            if stale:
                dropped[lease.lease_id] = stale
        return leases, dropped, groups

    def _skip(self, leased: list, held: list) -> set[str]:
        """Ids of ``leased`` groups delivered again: trained recently or already held for this batch. The
        queue hands a group out again once its lease expired unacked; it is acked, not trained twice."""
        held_ids = {g.group_id for g in held}
        again = {
            g.group_id
            for g in leased
            if g.group_id in held_ids or any(uid in self._trained for uid in g.uids)
        }
        if again:
            log.warning(
                "skipping %d group(s) delivered again after a lease expiry: %s", len(again), sorted(again)[:5]
            )
        return again

    def _remember_trained(self, uids: list[str]) -> None:
        self._trained.update(dict.fromkeys(uids))
        while len(self._trained) > _TRAINED_UIDS_KEPT:
            del self._trained[next(iter(self._trained))]

    def _collate_groups(self, groups: list) -> TensorDict:
        if self._collate is None:
            from slipstream.queue.batch import collate

            self._collate = collate
        batch = self._collate(groups)
        if "image_bytes" in batch.keys():  # a vision-language batch: the model's pixels, per sample
            from slipstream.trainer.engine.vision import ImageProcessor, attach_pixels

            if self._images is None:
                self._images = ImageProcessor(self.settings.model.path)
            batch = attach_pixels(batch, self._images)
        if self.settings.trainer.moe.routing_replay == "off" and "routed_experts" in batch.keys():
            del batch["routed_experts"]  # routes that came anyway are not replayed
        return batch

    # ---------------------------------------------------------------- compute
    def _train_on(self, batch: TensorDict) -> dict[str, float]:
        algo, tcfg = self.settings.trainer.algorithm, self.settings.trainer
        lengths = sample_lengths(batch)
        if algo.needs_proximal:
            batch["prox_logprobs"] = self._forward_full(self.engine, batch, "logprobs")
        if self.reference is not None:
            batch["ref_logprobs"] = self._forward_full(self.reference, batch, "logprobs")
        if self.critic is not None:
            batch["values"] = self._forward_full(self.critic, batch, "values")
        out = ADVANTAGES.get(algo.adv_estimator)(
            AdvantageInputs(
                rewards=batch["rewards"].float(),
                group_index=batch["group_index"],
                loss_mask=batch["loss_mask"].bool(),
                cu_seqlens=batch["cu_seqlens"],
                values=batch.get("values", None),
                gamma=algo.gamma,
                lam=algo.lam,
                norm_by_std=algo.norm_adv_by_std,
                episode_index=batch.get("episode_index", None),
            )
        )
        batch["advantages"], batch["returns"] = out.advantages, out.returns
        minis = [select_samples(batch, idx) for idx in split_groups(batch["group_index"], tcfg.mini_batches)]
        plans = [self._mini_plan(mini) for mini in minis]
        # the train-inference mismatch at the weights held before the step (trainer/mismatch.py)
        mismatch, proximal = MismatchCollector(self.version), "prox_logprobs" in batch.keys()
        if proximal:  # the whole batch, on every rank
            mismatch.add(batch["prox_logprobs"], batch["old_logprobs"], batch["loss_mask"], batch["versions"])
        sums: dict[str, float] = {}
        norms = []
        for epoch in range(tcfg.epochs):
            for i, (shard, counts) in enumerate(plans):
                first = epoch == 0 and i == 0 and not proximal  # nothing has stepped yet
                loss_fn = PolicyLoss(algo, counts, mismatch if first else None)
                res = self.engine.forward_backward_batch(shard, loss_fn)
                norms.append(self.engine.optimizer_step())
                _accumulate(sums, res.metrics)
                if self.critic is not None:
                    _accumulate(
                        sums, self.critic.forward_backward_batch(shard, ValueLoss(algo, counts)).metrics
                    )
                    self.critic.optimizer_step()
        lr = self.engine.lr_scheduler_step()
        if self.critic is not None:
            self.critic.lr_scheduler_step()
        updates = len(plans) * tcfg.epochs
        metrics = {f"trainer/{k}": v / updates for k, v in sums.items()}
        metrics.update(self._batch_metrics(batch, lengths))
        # without the proximal pass, each rank holds the tokens of its own micro-batches
        world = 1 if proximal else self.world_size
        metrics.update(mismatch.reduce(world_size=world, device=self._comm_device()))
        metrics["trainer/grad_norm"] = sum(norms) / len(norms)
        metrics["trainer/grad_norm_max"] = max(norms)
        metrics["trainer/lr"] = lr
        return metrics

    def _mini_plan(self, mini: TensorDict) -> tuple[TensorDict, GlobalCounts]:
        tokens, seqs = global_counts(mini["loss_mask"].bool(), mini["cu_seqlens"])
        algo = self.settings.trainer.algorithm
        scale = algo.loss_scale_factor or float(self.settings.loss_scale_tokens)
        parts = partition_for_ranks(sample_lengths(mini), self.engine.dp_size)
        return select_samples(mini, parts[self.engine.dp_rank]), GlobalCounts(tokens, seqs, scale)

    def _forward_full(self, engine: ModelEngine, batch: TensorDict, key: str) -> torch.Tensor:
        """Per-token ``key`` of the whole batch: forward passes on data-parallel shards, gathered back over
        the data-parallel group (tensor- and pipeline-parallel peers of one replica share a shard)."""
        lengths = sample_lengths(batch)
        parts = partition_for_ranks(lengths, engine.dp_size)
        local = engine.forward_backward_batch(
            select_samples(batch, parts[engine.dp_rank]), None, forward_only=True
        )
        return gather_tokens(
            local.tokens[key], parts, lengths, device=self._comm_device(), group=engine.dp_group
        )

    def _batch_metrics(self, batch: TensorDict, lengths: list[int]) -> dict[str, float]:
        # in weight versions (pushes), the unit of async.max_staleness: versions_behind, sample by sample
        behind = (self.version - batch["min_versions"].long()).clamp(min=0)
        staleness = torch.div(behind, self.settings.sync_every, rounding_mode="floor").float()
        mask = batch["loss_mask"].bool()
        out = {}
        if "routed_experts" in batch.keys():
            # MoE routing replay: the share of tokens whose routers were held to the server's routes (the
            # rest route freely: each sample's last token, prompt tokens a server returned no routes for)
            known = (batch["routed_experts"] >= 0).all(-1).all(-1)
            out["trainer/moe_replayed_token_share"] = float(known.float().mean())
        return out | {
            "trainer/reward_mean": float(batch["rewards"].float().mean()),
            "trainer/staleness_versions_mean": float(staleness.mean()),
            "trainer/staleness_versions_max": float(staleness.max()),
            "trainer/response_len_mean": float(batch["response_lens"].float().mean()),
            "trainer/samples": float(len(lengths)),
            "trainer/tokens": float(sum(lengths)),
            "trainer/policy_tokens": float(mask.sum()),
            "trainer/advantage_mean": float(batch["advantages"][mask].mean()) if mask.any() else 0.0,
        }

    def _add_mfu(self, metrics: dict[str, float], batch: TensorDict, elapsed: float) -> None:
        if self.engine.device.type != "cuda":
            return
        peak = self.settings.trainer.peak_tflops or _lookup_peak_tflops(torch.cuda.get_device_name())
        if peak is None:
            return
        tcfg = self.settings.trainer
        passes = tcfg.epochs + (1 / 3 if tcfg.algorithm.needs_proximal else 0)
        passes += 1 / 3 if self.reference is not None else 0  # a forward is a third of a training pass
        flops = self.engine.model_flops(sample_lengths(batch)) * passes
        metrics["trainer/mfu"] = flops / (elapsed * peak * 1e12 * self.world_size)

    # ---------------------------------------------------------------- checkpoints
    def save(self, path: str | Path) -> Path:
        """Engine (+ critic) state, trainer state and the queue snapshot under ``path``. Collective."""
        path = Path(path)
        self.engine.save_checkpoint(path / "engine")
        if self.critic is not None:
            self.critic.save_checkpoint(path / "critic")
        if self.rank == 0:
            self.queue.snapshot(self._snapshot_name(path))
            checkpoints.mark_complete(path, self.version)
        self._barrier()
        log.info("checkpoint at version %d written to %s", self.version, path)
        return path

    def resume(self, path: str | Path, *, restore_queue: bool = True) -> None:
        """Load a checkpoint written by :meth:`save`; with ``restore_queue`` rank 0 restores the queue's
        unconsumed samples from its snapshot (the samples these weights have not been trained on)."""
        path = Path(path)
        version = checkpoints.read_version(path)  # refuses an incomplete checkpoint before loading anything
        self.engine.load_checkpoint(path / "engine")
        if self.critic is not None:
            self.critic.load_checkpoint(path / "critic")
        self.version = version
        self._trained.clear()  # what was trained after this checkpoint is to be trained again
        if self.rank == 0 and restore_queue:
            self.queue.restore(self._snapshot_name(path))
        self._barrier()

    def _snapshot_name(self, path: Path) -> str:
        """The queue snapshot of checkpoint ``path``: ``<path>/queue`` named relative to the checkpoint root,
        which is the queue server's ``queue.snapshot_dir`` (the server takes names there, never paths)."""
        snapshot = Path(os.path.abspath(path)) / "queue"
        try:
            return snapshot.relative_to(os.path.abspath(self.checkpoint_root)).as_posix()
        except ValueError:
            raise ValueError(
                f"checkpoint {path} is not under {self.checkpoint_root}, the queue's snapshot_dir"
            ) from None

    def _prune_checkpoints(self) -> None:
        if self.rank == 0:
            checkpoints.prune(self.checkpoint_root, self.settings.trainer.keep_checkpoints)

    # ---------------------------------------------------------------- collectives
    def _comm_device(self) -> torch.device:
        return self.engine.device

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def push(self, publisher: WeightPublisher | None, version: int) -> PublishReport | None:
        """Push the weights as ``version``: the one way every trainer pushes (``step`` every sync_every steps,
        the pipeline's ``TrainerRank.publish`` when the controller asks). Every rank calls it, rank 0 with
        its publisher and the others with None (they drive the collectives that gather full tensors). A LoRA
        run sends the adapters (with the base weights to a server that lacks them) or, to servers that
        cannot rebuild adapters, merged whole weights: rank 0 decides and every rank follows
        (``publish_lora``). Any other run sends the whole weights in ``weightsync.push_dtype``."""
        from slipstream.weightsync.publisher import publish_lora, publish_whole

        engine, dtype, lora = self.engine, push_dtype(self.settings), self.settings.trainer.lora
        if not lora.enabled:
            return publish_whole(publisher, version, engine.get_per_tensor_param(dtype))
        from slipstream.weightsync.delta import lora_scale

        return publish_lora(
            publisher,
            version,
            lambda: engine.get_adapter_params(dtype),
            lambda: engine.base_reference().get_per_tensor_param(dtype),
            lora_scale(lora.alpha, lora.rank),
            agree=lambda code: int(self._bcast_scalar(float(code))),  # rank 0 decides for all
            merged=lambda: engine.get_per_tensor_param(
                dtype
            ),  # W + scale B A: SGLang, vLLM's own nccl engine
        )

    def _bcast_scalar(self, value: float) -> float:
        if self.world_size == 1:
            return value
        t = torch.tensor([float(value)], device=self._comm_device())
        dist.broadcast(t, 0)
        return float(t.item())


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None (the layout: ``slipstream.utils.checkpoints``)."""
    return checkpoints.latest(root)


def _accumulate(into: dict[str, float], metrics: dict[str, float]) -> None:
    for key, value in metrics.items():
        into[key] = into.get(key, 0.0) + value


def _lookup_peak_tflops(name: str) -> float | None:
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def push_dtype(settings: TrainerSettings) -> torch.dtype | None:
    """The dtype weights are pushed in (``weightsync.push_dtype``; ``auto`` unresolved: as trained)."""
    name = settings.weightsync.push_dtype
    return None if name == "auto" else getattr(torch, name)
