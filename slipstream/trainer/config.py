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
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    clip_low: Annotated[float, msgspec.Meta(ge=0)] = 0.2
    clip_high: Annotated[float, msgspec.Meta(ge=0)] = 0.28
    # Dual-clip constant (> 1) bounding the loss of negative-advantage tokens (ppo_clip, decoupled_ppo);
    # 3.0 as verl's clip_ratio_c; null disables dual clip.
    clip_c: float | None = 3.0
    # KL penalty (k1, k2, k3 = low-variance, abs; k1+ / k3+ = that value with k2's gradient, straight
    # through; null = off) against the batch's `ref_logprobs` when a producer supplies them, else against
    # the behaviour logprobs (a penalty on drifting from the sampling policy).
    kl_type: Literal["k1", "k2", "k3", "abs", "k1+", "k3+"] | None = None
    kl_coef: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    # What the KL penalty compares against: `behaviour` (the batch's `ref_logprobs`, else its sampling
    # logprobs) or `reference`: a frozen copy of the initial policy (`reference_path`, null = model.path)
    # kept beside each trainer rank (FSDP-sharded like the policy, no optimizer state) and run forward once
    # per batch, as verl's reference worker.
    kl_reference: Literal["behaviour", "reference"] = "behaviour"
    reference_path: str | None = None
    entropy_coef: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    # Truncated importance sampling between the behaviour (rollout) policy and the trained policy:
    # null (off), token, sequence; weights are clamped at `tis_cap`.
    tis_level: Literal["token", "sequence"] | None = None
    tis_cap: Annotated[float, msgspec.Meta(gt=0)] = 2.0
    # Rejection mask between the behaviour and proximal policies (trainer/algos/correction.py): null (off),
    # token_k1/k2/k3, seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3.
    rejection: str | None = None
    # k1 criteria keep ratios in [rejection_low, rejection_high] (low defaults to 1/high); k2/k3 criteria keep
    # divergences <= rejection_high.
    rejection_low: Annotated[float, msgspec.Meta(gt=0)] | None = None
    rejection_high: Annotated[float, msgspec.Meta(gt=0)] = 2.0
    # decoupled_ppo: tokens whose behaviour importance weight pi_prox/pi_behav exceeds this are dropped
    # (AReaL's behav_imp_weight_cap); null keeps every token.
    decoupled_cap: Annotated[float, msgspec.Meta(gt=0)] | None = 5.0
    # Constant divisor of seq-mean-token-sum-norm (Dr. GRPO); null uses rollout.sampling.max_new_tokens.
    loss_scale_factor: Annotated[float, msgspec.Meta(gt=0)] | None = None
    # Critic (adv_estimator=gae): weight of the value loss and the clip range of value updates.
    value_coef: Annotated[float, msgspec.Meta(ge=0)] = 0.5
    value_clip: Annotated[float, msgspec.Meta(gt=0)] = 0.2
    gamma: Annotated[float, msgspec.Meta(ge=0, le=1)] = 1.0
    lam: Annotated[float, msgspec.Meta(ge=0, le=1)] = 1.0

    def __post_init__(self) -> None:
        if self.clip_c is not None and self.clip_c <= 1.0:
            raise ValueError(f"clip_c must be > 1 (dual clip), got {self.clip_c}")
        if self.kl_reference == "reference" and self.kl_type is None:
            raise ValueError("kl_reference `reference` needs a KL penalty: set kl_type (and kl_coef)")
        if self.policy_loss == "decoupled_ppo" and self.tis_level is not None:
            raise ValueError("decoupled_ppo already weights by pi_prox/pi_behav: set tis_level to null")

    @property
    def needs_proximal(self) -> bool:
        """Whether the trainer must recompute logprobs with its own weights before updating them."""
        return self.policy_loss == "decoupled_ppo" or self.tis_level is not None or self.rejection is not None


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
    # Learning-rate schedule after warmup: constant, or cosine decay to min_lr_ratio * lr over run.total_steps.
    lr_schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    # Recompute each decoder layer's activations in backward instead of keeping them (HF's switch; the recipes
    # turn it on for long responses). Off by default: on small CPU runs memory is not the limit.
    activation_checkpointing: bool = False
    # Tokens whose full-vocabulary logits exist at once while computing logprobs and entropy
    # (trainer/logprobs.py): the output layer runs chunk by chunk and backward recomputes each chunk, so a
    # 32K-token micro-batch never holds [32K, vocab] fp32 logits. 0 = the plain path (all of a micro-batch's
    # logits at once); models whose output layer is not a plain linear map always take the plain path.
    logits_chunk_tokens: Annotated[int, msgspec.Meta(ge=0)] = 4096
    # Ulysses sequence parallelism (trainer/seqpar.py, fsdp only): each group of this many consecutive ranks
    # trains on the same samples, splitting every packed micro-batch's tokens between them (attention
    # exchanges heads for tokens with all-to-all). Needs pack_sequences and attention heads (and KV heads, or
    # a divisor of this) divisible by it. 1 = off.
    sequence_parallel_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    # Pack samples end to end (no padding; position ids restart per sample). False pads every micro-batch
    # to the longest sample of the batch: the baseline `slipstream bench train` measures against.
    pack_sequences: bool = True
    # Where the engine runs: auto picks cuda when available (NCCL), else cpu (gloo).
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # HF attention kernel; null picks flash_attention_2 on GPU when installed, else sdpa_varlen (per-sample
    # causal sdpa on packed rows, trainer/engine/varlen.py); sdpa and eager also work.
    attn_implementation: str | None = None
    # Seconds a step waits for a full batch from the queue before it fails.
    batch_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 3600.0
    # Peak dense bf16 TFLOP/s of one GPU for MFU; null looks the device name up (H100/H200/A100/...).
    peak_tflops: Annotated[float, msgspec.Meta(gt=0)] | None = None
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
    # Megatron layer implementation: auto (Transformer Engine when it is installed, else megatron-core's
    # local spec: plain torch modules, padded attention), te or local.
    megatron_layer_spec: Literal["auto", "te", "local"] = "auto"

    def __post_init__(self) -> None:
        if self.algorithm.kl_reference == "reference" and self.engine != "fsdp":
            raise ValueError("algorithm.kl_reference `reference` is supported with engine `fsdp` only")
