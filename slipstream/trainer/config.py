"""Config of the trainer: engine, optimisation, algorithm and checkpoints."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from slipstream.config_base import ConfigStruct


class AlgorithmConfig(ConfigStruct):
    # Advantage estimator (registry in trainer/algos/advantages): grpo, rloo, reinforce_plus_plus,
    # reinforce_plus_plus_baseline, gae.
    adv_estimator: str = "grpo"
    # GRPO: divide by the group's reward std (False gives Dr. GRPO's mean-only baseline).
    norm_adv_by_std: bool = True
    # Policy loss (registry in trainer/algos/losses): ppo_clip, gspo, cispo, decoupled_ppo.
    policy_loss: str = "ppo_clip"
    # Loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm.
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    clip_low: Annotated[float, msgspec.Meta(ge=0)] = 0.2
    clip_high: Annotated[float, msgspec.Meta(ge=0)] = 0.28
    # Dual-clip constant (> 1); null disables dual clip.
    clip_c: float | None = None
    # KL penalty against the reference (behaviour) policy: null (off), k1, k2, k3.
    kl_type: Literal["k1", "k2", "k3"] | None = None
    kl_coef: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    entropy_coef: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    # Truncated importance sampling between the behaviour (rollout) policy and the trained policy:
    # null (off), token, sequence; weights are clamped at `tis_cap`.
    tis_level: Literal["token", "sequence"] | None = None
    tis_cap: Annotated[float, msgspec.Meta(gt=0)] = 2.0
    gamma: Annotated[float, msgspec.Meta(ge=0, le=1)] = 1.0
    lam: Annotated[float, msgspec.Meta(ge=0, le=1)] = 1.0


class TrainerConfig(ConfigStruct):
    # Model engine: fsdp (CPU gloo or GPU NCCL) or megatron (GPU only).
    engine: Literal["fsdp", "megatron"] = "fsdp"
    # Trainer processes (data-parallel ranks).
    num_ranks: Annotated[int, msgspec.Meta(ge=1)] = 1
    # Groups (prompts x n samples) per optimizer step, across all ranks.
    batch_groups: Annotated[int, msgspec.Meta(ge=1)] = 8
    # Optimizer steps per batch (the batch is split into this many mini-batches) and passes over it.
    mini_batches: Annotated[int, msgspec.Meta(ge=1)] = 1
    epochs: Annotated[int, msgspec.Meta(ge=1)] = 1
    # Token budget of one micro-batch (packed, no padding); gradients accumulate across micro-batches.
    micro_batch_tokens: Annotated[int, msgspec.Meta(ge=1)] = 4096
    lr: Annotated[float, msgspec.Meta(gt=0)] = 1e-6
    weight_decay: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: Annotated[int, msgspec.Meta(ge=0)] = 0
    grad_clip: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    activation_checkpointing: bool = False
    # Mixed precision on GPU: parameters in bf16 for compute, fp32 master weights and reductions.
    mixed_precision: bool = True
    # A checkpoint (with the queue snapshot) every this many steps; 0 disables.
    checkpoint_every: Annotated[int, msgspec.Meta(ge=0)] = 50
    # Keep only the newest this many checkpoints.
    keep_checkpoints: Annotated[int, msgspec.Meta(ge=1)] = 2
    algorithm: AlgorithmConfig = msgspec.field(default_factory=AlgorithmConfig)
    # Megatron parallelism (ignored by fsdp).
    tensor_parallel: Annotated[int, msgspec.Meta(ge=1)] = 1
    pipeline_parallel: Annotated[int, msgspec.Meta(ge=1)] = 1
