"""Entry point of one trainer rank, usable from a Ray actor or a plain process (``torch.multiprocessing``,
``torchrun``, a launch script): it joins the process group, builds the engine(s) and the queue client,
resumes from the newest checkpoint when ``run.resume`` is set, and runs the loop.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from slipstream.trainer.engine import make_aux_engines, make_engine
from slipstream.trainer.trainer import PublishFn, Trainer, latest_checkpoint
from slipstream.utils.logging import get_logger

if TYPE_CHECKING:
    from slipstream.trainer.settings import TrainerSettings

log = get_logger(__name__)


def run_trainer_rank(
    settings: TrainerSettings,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    queue_address: str | None,
    publish_fn: PublishFn | None = None,
    *,
    num_steps: int | None = None,
    log_metrics: bool = True,
) -> list[dict[str, float]]:
    """Run this rank until ``num_steps`` (default ``run.total_steps``) trainer versions exist; return the
    metrics of the steps it ran. Rank 0 connects to the queue at ``queue_address`` (others may pass None).
    ``settings`` is ``trainer.settings.from_root(cfg)``; with ``log_metrics`` rank 0 writes the run's
    metrics.jsonl and console progress (wandb, which logs the whole root config, is the pipeline's).
    """
    tcfg, run = settings.trainer, settings.run
    use_cuda = tcfg.device == "cuda" or (tcfg.device == "auto" and torch.cuda.is_available())
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=max(600.0, tcfg.batch_timeout_s + 60)),
    )
    queue = None
    try:
        engine = make_engine(settings)
        engine.initialize()
        aux = make_aux_engines(settings)
        if rank == 0:
            from slipstream.queue.client import QueueClient

            queue = QueueClient(queue_address)
        trainer = Trainer(
            settings, engine, queue, rank=rank, world_size=world_size, publish_fn=publish_fn, **aux
        )
        if run.resume and (ckpt := latest_checkpoint(trainer.checkpoint_root)) is not None:
            log.info("rank %d resuming from %s", rank, ckpt)
            trainer.resume(ckpt)
        target = num_steps if num_steps is not None else run.total_steps
        return _fit(settings, trainer, max(0, target - trainer.version), log_metrics and rank == 0)
    finally:
        if queue is not None and hasattr(queue, "close"):
            queue.close()
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
