"""Config of the trainer: engine, optimisation, algorithm and checkpoints."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from slipstream.config_base import ConfigStruct


class AlgorithmConfig(ConfigStruct):
    """The RL algorithm: advantage estimator, policy loss, KL and entropy terms, off-policy correction."""

    adv_estimator: Annotated[
        str,
        Meta(
            description="Advantage estimator (registry in trainer/algos/advantages): grpo, rloo, "
            "reinforce_plus_plus, reinforce_plus_plus_baseline, gae.",
        ),
    ] = "grpo"
    norm_adv_by_std: Annotated[
        bool,
        Meta(
            description="GRPO: divide by the group's reward std (False gives Dr. GRPO's mean-only baseline)."
        ),
    ] = True
    policy_loss: Annotated[
        str,
        Meta(
            description="Policy loss (registry in trainer/algos/losses): ppo_clip, gspo, cispo, "
            "decoupled_ppo.",
        ),
    ] = "ppo_clip"
    loss_agg_mode: Annotated[
        Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"],
        Meta(
            description="Loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean, "
            "seq-mean-token-sum-norm.",
        ),
    ] = "token-mean"
    clip_low: Annotated[
        float, Meta(ge=0, description="PPO clip range below 1: the ratio is clipped at 1 - clip_low.")
    ] = 0.2
    clip_high: Annotated[
        float,
        Meta(
            ge=0,
            description="PPO clip range above 1: the ratio is clipped at 1 + clip_high (above clip_low: "
            "DAPO's clip-higher).",
        ),
    ] = 0.28
    clip_c: Annotated[
        float | None,
        Meta(
            description="Dual-clip constant (> 1) bounding the loss of negative-advantage tokens (ppo_clip, "
            "decoupled_ppo); 3.0 as verl's clip_ratio_c; null disables dual clip.",
        ),
    ] = 3.0
    kl_type: Annotated[
        Literal["k1", "k2", "k3", "abs", "k1+", "k3+"] | None,
        Meta(
            description="KL penalty (k1, k2, k3 = low-variance, abs; k1+ / k3+ = that value with k2's "
            "gradient, straight through; null = off) against the batch's `ref_logprobs` when a producer "
            "supplies them, else against the behaviour logprobs (a penalty on drifting from the sampling "
            "policy).",
        ),
    ] = None
    kl_coef: Annotated[
        float,
        Meta(ge=0, description="Weight of the KL penalty in the loss (0 with kl_type null: no penalty)."),
    ] = 0.0
    kl_reference: Annotated[
        Literal["behaviour", "reference"],
        Meta(
            description="What the KL penalty compares against: `behaviour` (the batch's `ref_logprobs`, "
            "else its sampling logprobs) or `reference`: a frozen copy of the initial policy "
            "(`reference_path`) kept beside each trainer rank (FSDP-sharded like the policy, no optimizer "
            "state) and run forward once per batch, as verl's reference worker. With trainer.lora the "
            "reference of model.path is the policy itself with its adapters switched off: no second copy.",
        ),
    ] = "behaviour"
    reference_path: Annotated[
        str | None,
        Meta(
            description="Checkpoint of the frozen reference policy of kl_reference `reference`; null uses "
            "model.path.",
        ),
    ] = None
    entropy_coef: Annotated[
        float, Meta(ge=0, description="Weight of the entropy bonus subtracted from the loss (0: none).")
    ] = 0.0
    tis_level: Annotated[
        Literal["token", "sequence"] | None,
        Meta(
            description="Truncated importance sampling between the behaviour (rollout) policy and the "
            "trained policy: null (off), token, sequence; weights are clamped at `tis_cap`.",
        ),
    ] = None
    tis_cap: Annotated[
        float, Meta(gt=0, description="Largest truncated importance-sampling weight (see tis_level).")
    ] = 2.0
    rejection: Annotated[
        str | None,
        Meta(
            description="Rejection mask between the behaviour and proximal policies "
            "(trainer/algos/correction.py): null (off), token_k1/k2/k3, seq_sum_k1/k2/k3, "
            "seq_mean_k1/k2/k3, seq_max_k2/k3.",
        ),
    ] = None
    rejection_low: (
        Annotated[
            float,
            Meta(
                gt=0,
                description="Lower bound of the ratios k1 rejection criteria keep; null uses "
                "1/rejection_high.",
            ),
        ]
        | None
    ) = None
    rejection_high: Annotated[
        float,
        Meta(
            gt=0,
            description="Upper bound of the ratios k1 rejection criteria keep, and of the divergences k2/k3 "
            "criteria keep.",
        ),
    ] = 2.0
    decoupled_cap: (
        Annotated[
            float,
            Meta(
                gt=0,
                description="decoupled_ppo: tokens whose behaviour importance weight pi_prox/pi_behav "
                "exceeds this are dropped (AReaL's behav_imp_weight_cap); null keeps every token.",
            ),
        ]
        | None
    ) = 5.0
    loss_scale_factor: (
        Annotated[
            float,
            Meta(
                gt=0,
                description="Constant divisor of seq-mean-token-sum-norm (Dr. GRPO); null uses "
                "rollout.sampling.max_new_tokens.",
            ),
        ]
        | None
    ) = None
    value_coef: Annotated[
        float,
        Meta(
            ge=0,
            description="Critic (adv_estimator=gae): weight of the value loss.",
        ),
    ] = 0.5
    value_clip: Annotated[
        float, Meta(gt=0, description="Critic (adv_estimator=gae): clip range of value updates.")
    ] = 0.2
    gamma: Annotated[float, Meta(ge=0, le=1, description="GAE discount factor (adv_estimator=gae).")] = 1.0
    lam: Annotated[float, Meta(ge=0, le=1, description="GAE lambda (adv_estimator=gae).")] = 1.0

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


LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAConfig(ConfigStruct):
    """Low-rank adaptation (trainer/engine/lora.py): the base weights stay frozen and each targeted linear
    layer learns ``W + (alpha / rank) B A``; only A and B (and their AdamW state) are trained and saved."""

    rank: Annotated[
        int,
        Meta(ge=0, description="Adapter rank r (16 is common); 0 turns LoRA off: full fine-tuning."),
    ] = 0
    alpha: Annotated[
        float,
        Meta(gt=0, description="LoRA alpha: the low-rank update B A is scaled by alpha / rank."),
    ] = 32.0
    target_modules: Annotated[
        list[str],
        Meta(
            description="Linear layers that get an adapter, by the last part of their module name "
            "(q_proj matches model.layers.*.self_attn.q_proj); default: attention and MLP projections. "
            "The output layer (lm_head) cannot be a target: the chunked logprob head reads its weight.",
        ),
    ] = msgspec.field(default_factory=lambda: list(LORA_DEFAULT_TARGETS))
    dropout: Annotated[
        float,
        Meta(ge=0, lt=1, description="Dropout on each adapter's input during training passes (0: none)."),
    ] = 0.0

    def __post_init__(self) -> None:
        if self.rank > 0 and not self.target_modules:
            raise ValueError("target_modules is empty: name at least one linear layer to adapt")
        if "lm_head" in self.target_modules:
            raise ValueError(
                "target_modules: lm_head cannot be adapted (the chunked logprob head reads its weight, "
                "often tied to the input embeddings)"
            )

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class MoEConfig(ConfigStruct):
    """Mixture-of-experts models (trainer/engine/moe.py): what the trainer adds for their routers."""

    aux_loss_coef: Annotated[
        float,
        Meta(
            ge=0,
            description="Weight of the router load-balancing loss (Switch Transformer's, as the HF model "
            "computes it from every layer's router logits) added to the policy loss, token-weighted over "
            "micro-batches and ranks; 0 leaves the routers to the policy loss alone. The models' own "
            "router_aux_loss_coef is not used. Needs an MoE model and engine `fsdp`.",
        ),
    ] = 0.0
    routing_replay: Annotated[
        Literal["off", "rollout"],
        Meta(
            description="Routing replay (R3): `rollout` asks the inference servers for the experts every token "
            "was routed to, carries them in the trajectories and routes each token to the same experts in "
            "every trainer pass (old and proximal logprobs and the loss; the router keeps its gradient "
            "through its own softmax); tokens without routes (the last one, tool output) are routed by the "
            "trainer. `off`: the trainer's routers choose. Needs an MoE model, engine `fsdp` without "
            "sequence parallelism, and rollout.backend `embedded` (the only server that returns routes here).",
        ),
    ] = "off"


class TrainerConfig(ConfigStruct):
    """The trainer ranks: engine, batch shape, optimizer, memory savers and checkpoints."""

    engine: Annotated[
        Literal["fsdp", "megatron"],
        Meta(description="Model engine: fsdp (CPU gloo or GPU NCCL) or megatron (GPU only)."),
    ] = "fsdp"
    num_ranks: Annotated[int, Meta(ge=1, description="Trainer processes (data-parallel ranks).")] = 1
    batch_groups: Annotated[
        int, Meta(ge=1, description="Groups (prompts x n samples) per optimizer step, across all ranks.")
    ] = 8
    mini_batches: Annotated[
        int,
        Meta(
            ge=1,
            description="Optimizer steps per batch: the batch is split into this many mini-batches.",
        ),
    ] = 1
    epochs: Annotated[
        int,
        Meta(ge=1, description="Passes over each batch (each pass takes `mini_batches` optimizer steps)."),
    ] = 1
    micro_batch_tokens: Annotated[
        int,
        Meta(
            ge=1,
            description="Token budget of one micro-batch (packed, no padding); gradients accumulate across "
            "micro-batches.",
        ),
    ] = 4096
    lr: Annotated[
        float, Meta(gt=0, description="Peak learning rate of AdamW, reached after warmup_steps.")
    ] = 1e-6
    weight_decay: Annotated[float, Meta(ge=0, description="AdamW weight decay.")] = 0.0
    betas: Annotated[tuple[float, float], Meta(description="AdamW betas (beta1, beta2).")] = (0.9, 0.999)
    warmup_steps: Annotated[
        int, Meta(ge=0, description="Optimizer steps of linear learning-rate warmup up to lr.")
    ] = 0
    grad_clip: Annotated[
        float, Meta(gt=0, description="Gradients are clipped to this global norm before each optimizer step.")
    ] = 1.0
    lr_schedule: Annotated[
        Literal["constant", "cosine"],
        Meta(
            description="Learning-rate schedule after warmup: `constant`, or `cosine` decay to min_lr_ratio "
            "* lr over run.total_steps.",
        ),
    ] = "constant"
    min_lr_ratio: Annotated[
        float, Meta(ge=0, le=1, description="Where the cosine schedule ends, as a fraction of lr.")
    ] = 0.0
    activation_checkpointing: Annotated[
        bool,
        Meta(
            description="Recompute each decoder layer's activations in backward instead of keeping them "
            "(HF's switch; the recipes turn it on for long responses). Off by default: on small CPU runs "
            "memory is not the limit.",
        ),
    ] = False
    logits_chunk_tokens: Annotated[
        int,
        Meta(
            ge=0,
            description="Tokens whose full-vocabulary logits exist at once while computing logprobs and "
            "entropy (trainer/logprobs.py): the output layer runs chunk by chunk and backward recomputes "
            "each chunk, so a 32K-token micro-batch never holds [32K, vocab] fp32 logits. 0 = the plain "
            "path (all of a micro-batch's logits at once); models whose output layer is not a plain linear "
            "map always take the plain path.",
        ),
    ] = 4096
    sequence_parallel_size: Annotated[
        int,
        Meta(
            ge=1,
            description="Ulysses sequence parallelism (trainer/seqpar.py, fsdp only): each group of this "
            "many consecutive ranks trains on the same samples, splitting every packed micro-batch's tokens "
            "between them (attention exchanges heads for tokens with all-to-all). Needs pack_sequences and "
            "attention heads (and KV heads, or a divisor of this) divisible by it. 1 = off.",
        ),
    ] = 1
    pack_sequences: Annotated[
        bool,
        Meta(
            description="Pack samples end to end (no padding; position ids restart per sample). False pads "
            "every micro-batch to the longest sample of the batch: the baseline `slipstream bench train` "
            "measures against.",
        ),
    ] = True
    share_prompt_prefix: Annotated[
        bool,
        Meta(
            description="Run each group's shared prompt once per micro-batch instead of once per sample "
            "(trainer/engine/prefix.py): the samples of a group keep the tokens they have in common as one "
            "copy and attend to it; logprobs and gradients are unchanged. Packed fsdp micro-batches with the "
            "sdpa_varlen kernel; elsewhere it has no effect.",
        ),
    ] = True
    device: Annotated[
        Literal["auto", "cpu", "cuda"],
        Meta(description="Where the engine runs: auto picks cuda when available (NCCL), else cpu (gloo)."),
    ] = "auto"
    attn_implementation: Annotated[
        str | None,
        Meta(
            description="HF attention kernel; null picks flash_attention_2 on GPU when installed, else "
            "sdpa_varlen (per-sample causal sdpa on packed rows, trainer/engine/varlen.py); sdpa and eager "
            "also work.",
        ),
    ] = None
    batch_timeout_s: Annotated[
        float, Meta(gt=0, description="Seconds a step waits for a full batch from the queue before it fails.")
    ] = 3600.0
    peak_tflops: (
        Annotated[
            float,
            Meta(
                gt=0,
                description="Peak dense bf16 TFLOP/s of one GPU for MFU; null looks the device name up "
                "(H100/H200/A100/...).",
            ),
        ]
        | None
    ) = None
    mixed_precision: Annotated[
        bool,
        Meta(
            description="Mixed precision on GPU: parameters in bf16 for compute, fp32 master weights and "
            "reductions.",
        ),
    ] = True
    checkpoint_every: Annotated[
        int,
        Meta(ge=0, description="A checkpoint (with the queue snapshot) every this many steps; 0 disables."),
    ] = 50
    keep_checkpoints: Annotated[
        int, Meta(ge=1, description="Keep only the newest this many checkpoints.")
    ] = 2
    algorithm: AlgorithmConfig = msgspec.field(default_factory=AlgorithmConfig)
    lora: LoRAConfig = msgspec.field(default_factory=LoRAConfig)
    moe: MoEConfig = msgspec.field(default_factory=MoEConfig)
    freeze_vision_tower: Annotated[
        bool,
        Meta(
            description="Vision-language models (Qwen2-VL family): keep the vision tower (patch embedding, "
            "vision blocks, merger) at the checkpoint's weights; the optimizer holds the language model alone. "
            "Weight pushes still carry the unchanged tower, so every version is whole (the servers' receivers "
            "apply whole versions only); with weightsync.delta it travels as an empty delta. false trains it "
            "and pushes it with the rest. Ignored for text models.",
        ),
    ] = False
    tensor_parallel: Annotated[
        int, Meta(ge=1, description="Megatron tensor-parallel size (ignored by fsdp).")
    ] = 1
    pipeline_parallel: Annotated[
        int, Meta(ge=1, description="Megatron pipeline-parallel size (ignored by fsdp).")
    ] = 1
    megatron_layer_spec: Annotated[
        Literal["auto", "te", "local"],
        Meta(
            description="Megatron layer implementation: auto (Transformer Engine when it is installed, else "
            "megatron-core's local spec: plain torch modules, padded attention), te or local.",
        ),
    ] = "auto"

    def __post_init__(self) -> None:
        if self.algorithm.kl_reference == "reference" and self.engine != "fsdp":
            raise ValueError("algorithm.kl_reference `reference` is supported with engine `fsdp` only")
        if self.lora.enabled and self.engine != "fsdp":
            raise ValueError("lora (rank > 0) is supported with engine `fsdp` only")
        if self.moe.aux_loss_coef > 0 and self.engine != "fsdp":
            raise ValueError("moe.aux_loss_coef > 0 is supported with engine `fsdp` only")
        if self.moe.routing_replay == "rollout" and self.engine != "fsdp":
            raise ValueError(
                "moe.routing_replay `rollout` is supported with engine `fsdp` only (megatron-core's routing "
                "replay is not wired)"
            )
