"""What a trainer rank is built from: its own config sections plus the few values it takes from other roles.

The root config holds every role's section; a trainer rank needs only ``trainer``, ``model`` and ``run``,
the weight-sync section of the publisher its rank 0 owns, and a few values that other roles' sections
decide. The trainer never sees the root config: :func:`slipstream.config.trainer_settings` builds this
struct from it, field by field (tested in tests/trainer/test_trainer_settings.py), and the pipeline hands each
rank the struct (msgspec Structs travel through Ray), never the whole config.

Worked example::

    settings = trainer_settings(load_config("configs/quickstart.yaml"))   # slipstream.config
    settings.sampling_temperature        # rollout.sampling.temperature
    settings.sampling_top_p              # rollout.sampling.top_p (and top_k): the filter logprobs replay
    engine = FSDPEngine(settings); trainer = Trainer(settings, engine, queue, rank=0, world_size=1)
    # the pipeline writes the checkpoints itself, so its ranks never do:
    msgspec.structs.replace(settings, checkpoint_every=0)
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from slipstream.config_base import ModelConfig, RunConfig
from slipstream.trainer.config import TrainerConfig
from slipstream.utils.versions import versions_behind
from slipstream.weightsync.config import WeightSyncConfig


class TrainerSettings(msgspec.Struct, kw_only=True):
    """A trainer rank's config: its sections, and named values from other roles (the root key each comes from
    is in :func:`slipstream.config.trainer_settings`)."""

    trainer: TrainerConfig
    model: ModelConfig
    run: RunConfig
    # Rank 0 owns the weight publisher; push_dtype also sets the dtype every rank gathers weights in.
    weightsync: WeightSyncConfig
    sampling_temperature: Annotated[float, Meta(ge=0)]
    """The rollouter's sampling temperature: logprobs are of logits / temperature (0 counts as 1)."""
    sampling_top_k: int = -1
    """The rollouter's top-k (<= 0: off): logprobs are renormalised over the tokens it keeps."""
    sampling_top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    """The rollouter's top-p (1: off): logprobs are renormalised over the tokens it keeps
    (``trainer/logprobs.py``, "Sampling masks")."""
    loss_scale_tokens: Annotated[int, Meta(ge=1)]
    """The loss scale when ``trainer.algorithm.loss_scale_factor`` is unset: the response token budget."""
    max_staleness: Annotated[int, Meta(ge=0)]
    stale_policy: Literal["drop", "keep"]
    sync_every: Annotated[int, Meta(ge=1)]
    """Trainer steps between weight pushes; staleness is counted in pushes."""
    server_kind: str
    """The inference backend the publisher pushes to (embedded, vllm, sglang)."""
    checkpoint_every: Annotated[int, Meta(ge=0)]
    """Steps between the trainer's own checkpoints (0: none; under the pipeline its coordinator writes them)."""

    def staleness(self, trainer_step: int, min_version: int) -> int:
        """Weight versions (pushes) between a group's oldest token and the trainer at ``trainer_step``."""
        return versions_behind(trainer_step, min_version, self.sync_every)
