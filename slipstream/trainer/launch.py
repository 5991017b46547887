"""Set-up of one trainer rank, written once: :func:`build_rank` joins the process group and builds the
engine(s) and the :class:`~slipstream.trainer.trainer.Trainer`. Both entry points use it: the pipeline's Ray
actor (``pipeline/actors.py``: ``TrainerRank.setup``, which then steps when the controller says) and
:func:`run_trainer_rank` for a plain process (``torch.multiprocessing``, ``torchrun``, a launch script), which
also resumes from the newest checkpoint when ``run.resume`` is set and runs the loop itself.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from slipstream.trainer.engine import make_aux_engines, make_engine
from slipstream.trainer.trainer import Trainer, latest_checkpoint
from slipstream.utils.logging import get_logger

if TYPE_CHECKING:
    from slipstream.queue.base import QueueConsumer
    from slipstream.trainer.settings import TrainerSettings
    from slipstream.weightsync.publisher import WeightPublisher

log = get_logger(__name__)


def build_rank(
    settings: TrainerSettings,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    queue: QueueConsumer | None,
    *,
    publish: bool = False,
    publisher: WeightPublisher | None = None,
) -> Trainer:
    """Join the process group at ``master_addr:master_port`` (NCCL on CUDA, else gloo; the timeout covers a
    rank waiting for rank 0's batch), build and initialise the policy engine and the auxiliary engines
    (critic, reference: a LoRA reference shares the policy's base weights), and return this rank's trainer.
    ``queue`` is rank 0's consumer side of the queue (None on other ranks)."""
    tcfg = settings.trainer
    use_cuda = tcfg.device == "cuda" or (tcfg.device == "auto" and torch.cuda.is_available())
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=max(600.0, tcfg.batch_timeout_s + 60)),
    )
    engine = make_engine(settings)
    engine.initialize()
    aux: dict[str, Any] = make_aux_engines(settings, policy=engine)
    return Trainer(
        settings, engine, queue, rank=rank, world_size=world_size, publish=publish, publisher=publisher, **aux
    )


def run_trainer_rank(
    settings: TrainerSettings,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    queue_address: str | None,
    *,
    publish: bool = False,
    publisher: WeightPublisher | None = None,
    num_steps: int | None = None,
    log_metrics: bool = True,
) -> list[dict[str, float]]:
    """Run this rank until ``num_steps`` (default ``run.total_steps``) trainer versions exist; return the
    metrics of the steps it ran. Rank 0 connects to the queue at ``queue_address`` (others may pass None).
    ``settings`` is ``slipstream.config.trainer_settings(cfg)``; with ``log_metrics`` rank 0 writes the run's
    metrics.jsonl and console progress (wandb, which logs the whole root config, is the pipeline's). With
    ``publish`` every rank takes part in a push every ``async.sync_every`` steps, rank 0 through its
    ``publisher`` (``Trainer.push``).
    """
    run = settings.run
    queue = None
    if rank == 0:
        from slipstream.queue.client import QueueClient

        queue = QueueClient(queue_address)
    try:
        trainer = build_rank(
            settings, rank, world_size, master_addr, master_port, queue, publish=publish, publisher=publisher
        )
        if run.resume and (ckpt := latest_checkpoint(trainer.checkpoint_root)) is not None:
            log.info("rank %d resuming from %s", rank, ckpt)
            trainer.resume(ckpt)
        target = num_steps if num_steps is not None else run.total_steps
        return _fit(settings, trainer, max(0, target - trainer.version), log_metrics and rank == 0)
    finally:
        if queue is not None:
            queue.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _fit(
    settings: TrainerSettings, trainer: Trainer, steps: int, log_metrics: bool
) -> list[dict[str, float]]:
    if not log_metrics:
        return trainer.fit(steps)
    from slipstream.metrics import MetricsLogger

    run_dir = Path(settings.run.output_dir) / settings.run.name
    total = trainer.version + steps
    with MetricsLogger(run_dir, None, total_steps=total, start_step=trainer.version) as logger:
        return trainer.fit(steps, on_step=logger.log)
