"""FSDP2 engine for Hugging Face causal LMs (and value-head models for a critic).

Parallelism lives here and nowhere else: every decoder layer and then the root module are wrapped with
``torch.distributed.fsdp.fully_shard`` over one data-parallel mesh (gloo on CPU, NCCL on GPU). On GPU with
``trainer.mixed_precision`` the sharded parameters stay fp32 (the master weights the optimizer updates)
and are cast to bf16 for compute, with gradients reduced in fp32 (``MixedPrecisionPolicy``).

Packed sequences: a micro-batch is one row of samples laid end to end, with ``position_ids`` restarting at
0 for each sample and no attention mask. The sample boundaries go to every attention layer as
``cu_seq_lens_q/k``: flash-attention (GPU) and our ``sdpa_varlen`` kernel (the default elsewhere,
``engine/varlen.py``) attend within each sample only, at sum(len^2) cost; with plain sdpa/eager
transformers builds a block-diagonal causal mask from the restarting position ids instead. Either way no
token attends across samples and no padding is computed (``tests/trainer/test_fsdp_engine.py`` checks that
packed logits equal per-sample logits, for sdpa_varlen and for sdpa). With
``trainer.pack_sequences=false`` micro-batches are padded to the batch's longest sample instead: the
baseline of ``slipstream bench train``.

Micro-batches are cut by token budget (``trainer.micro_batch_tokens``); FSDP collectives run inside every
forward and backward, so all ranks must run the same number of them: a rank with fewer micro-batches runs
zero-weight ones (one token, loss multiplied by 0) to match the busiest rank. FSDP averages gradients
over ranks while our loss is each micro-batch's share of the global mean, so the loss is multiplied by the
world size before backward.

Logprobs and entropy (``trainer.logits_chunk_tokens``, default on): the model's output layer is replaced,
before sharding, by a ``LogprobHead`` sharing its weight (``trainer/logprobs.py``), which turns the final
hidden states into per-token logprobs (and entropy) chunk by chunk inside the model's forward, so FSDP
all-gathers and reshards the output weight with its own hooks and no [tokens, vocab] logits outlive a chunk.
0 keeps the full-logits path. Both paths replay the rollouts' top-k / top-p filter (``rollout.sampling``;
``trainer/logprobs.py``, "Sampling masks"). Activation checkpointing is HF's own switch
(``trainer.activation_checkpointing``).

Sequence parallelism (``trainer.sequence_parallel_size = n``, Ulysses, ``trainer/seqpar.py``): groups of n
consecutive ranks form one data-parallel replica (``dp_rank``/``dp_size``/``dp_group`` say so to the
trainer); each runs 1/n of every packed micro-batch, attention trading tokens for heads by all-to-all, and
the per-token results are gathered so the loss sees the whole micro-batch. FSDP still shards over all ranks.

LoRA (``trainer.lora.rank > 0``, ``engine/lora.py``): after the logprob head is installed and before
sharding, the targeted linear layers get adapters and every base weight is frozen; the optimizer holds the
adapters alone. ``get_per_tensor_param`` then yields the merged model under its HF names (what a server
serves), ``get_adapter_params`` the adapter tensors alone, and the KL reference is this engine with its
adapters off (``base_reference``). Checkpoints hold only the adapters and their optimizer state (the base
is model.path's) and record rank, alpha and targets, checked on load.

Mixture-of-experts models (Qwen3-MoE, OLMoE, ...) need nothing of their own here: HF keeps each layer's
experts as fused 3-D tensors, which FSDP shards along the expert dimension like any other parameter, and
their HF names are what ``get_per_tensor_param`` yields. ``trainer.moe.aux_loss_coef > 0`` adds the routers'
load-balancing loss to the policy loss (``engine/moe.py``). A micro-batch that carries ``routed_experts``
(per token and layer, the experts the server used) is run with every router held to them (routing replay,
``engine/moe.py`` ``RouteReplay``), for the proximal, reference and training passes alike.

Vision-language models (Qwen2-VL family, ``engine/vision.py``) load as ``AutoModelForImageTextToText``, the
vision tower with plain sdpa; a micro-batch's ``pixel_values`` / ``image_grid_thw`` go through the HF forward
with multi-modal rotary positions computed per sample. ``trainer.freeze_vision_tower`` takes the tower out of
the optimizer; ``get_per_tensor_param`` still yields it, unchanged, so every push is a whole version. Packed
micro-batches only, without shared-prompt rows or sequence parallelism.

Checkpoints are torch DCP (sharded model + optimizer, any world size can load them), plus the scheduler on
rank 0 and each rank's RNG state in its own small file.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tensordict import TensorDict

from slipstream.trainer.batching import (
    sample_lengths,
    select_samples,
    split_by_token_budget,
    truncate_to_one_token,
)
from slipstream.trainer.engine import lora, vision
from slipstream.trainer.engine.base import EngineOutput, LossFn, ModelEngine
from slipstream.trainer.engine.moe import ROUTES_KEY, RouteReplay, RouterRecorder, forward_routes, is_moe
from slipstream.trainer.logprobs import (
    LogprobHead,
    install_logprob_head,
    plain_entropy,
    sampling_truncation,
    truncate_logits,
)
from slipstream.utils.logging import get_logger

if TYPE_CHECKING:
    from slipstream.trainer.settings import TrainerSettings

log = get_logger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FSDPEngine(ModelEngine):
    """FSDP2-sharded HF model + AdamW + warmup/cosine schedule.

    Invariants: every public method except the properties is collective over the default process group;
    parameters keep their HF names (activation checkpointing uses HF's own switch, which adds no wrapper);
    ``get_per_tensor_param`` yields exactly ``model.named_parameters()`` (tied weights once; with LoRA the
    base parameters, adapted weights merged).

    Example (one process; ``initialize`` starts a 1-rank group when none exists)::

        engine = FSDPEngine(settings)        # slipstream.config.trainer_settings(cfg)
        engine.initialize()
        out = engine.forward_backward_batch(batch, loss_fn)
        grad_norm = engine.optimizer_step()
    """

    def __init__(
        self,
        settings: TrainerSettings,
        *,
        value_head: bool = False,
        model_path: str | None = None,
        frozen: bool = False,
    ) -> None:
        self.settings = settings
        self.frozen = frozen  # a reference model: forward only, no gradients, no optimizer
        self.tcfg = settings.trainer
        self.value_head = value_head
        self.model_path = model_path or settings.model.path
        self.temperature = float(settings.sampling_temperature) or 1.0
        # the rollouts' top-k / top-p, replayed on every logprob this engine computes (None: off)
        self.truncation = sampling_truncation(
            settings.sampling_temperature, settings.sampling_top_k, settings.sampling_top_p
        )
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self._device = torch.device("cpu")
        self._num_params = 0
        self._arch: tuple[int, int] = (0, 0)  # (layers, hidden) for attention FLOPs
        self._head: LogprobHead | None = None  # chunked logprobs inside the forward (None: plain logits)
        self._sp = int(self.tcfg.sequence_parallel_size)  # Ulysses group size (1: off)
        self._share_prefix = bool(self.tcfg.share_prompt_prefix)  # engine/prefix.py; needs sdpa_varlen
        self._sp_group = self._dp_group = None
        self._aux: RouterRecorder | None = None  # records router logits for the load-balancing loss
        self._replay: RouteReplay | None = None  # holds the routers to a micro-batch's routed_experts
        self._vision = False  # a vision-language model (engine/vision.py), known once loaded
        # LoRA adapters on the policy only: a critic and a frozen reference stay full models
        lcfg = self.tcfg.lora
        self._lora = lcfg if lcfg.enabled and not frozen and not value_head else None

    # ---------------------------------------------------------------- setup
    def initialize(self) -> None:
        self._init_distributed()
        if self._sp > 1:
            self._init_sequence_parallel()
        model = self._load_model()
        self._num_params = sum(p.numel() for p in model.parameters())
        if self.tcfg.moe.aux_loss_coef > 0 and not self.frozen and not self.value_head:
            self._aux = RouterRecorder(model)
        if not self.value_head and is_moe(model):
            self._replay = RouteReplay(model)
        if self.frozen:
            model.requires_grad_(False)
        self._shard(model)
        self.model = model
        if self.frozen:
            return
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],  # LoRA: the adapters alone
            lr=self.tcfg.lr,
            betas=tuple(self.tcfg.betas),
            weight_decay=self.tcfg.weight_decay,
            foreach=True,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_lambda)

    def _init_distributed(self) -> None:
        want = self.tcfg.device
        use_cuda = want == "cuda" or (want == "auto" and torch.cuda.is_available())
        if use_cuda:
            local = int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))
            torch.cuda.set_device(local % torch.cuda.device_count())
            self._device = torch.device("cuda", torch.cuda.current_device())
        if not dist.is_initialized():
            dist.init_process_group(
                "nccl" if use_cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1
            )
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def _init_sequence_parallel(self) -> None:
        from slipstream.trainer import seqpar

        if self.value_head:
            raise ValueError(
                "sequence_parallel_size > 1 is supported for the policy, not a value-head critic"
            )
        if not self.tcfg.pack_sequences:
            raise ValueError("sequence_parallel_size > 1 needs trainer.pack_sequences=true")
        self._sp_group, self._dp_group = seqpar.build_groups(self.world_size, self._sp)
        self._sp_rank = dist.get_rank(self._sp_group)

    # Sequence-parallel peers receive the same shard of a batch (see ModelEngine's parallel layout).
    @property
    def dp_rank(self) -> int:
        return self.rank // self._sp

    @property
    def dp_size(self) -> int:
        return self.world_size // self._sp

    @property
    def dp_group(self):  # noqa: ANN201
        return self._dp_group

    def _load_model(self) -> torch.nn.Module:
        from transformers import (
            AutoConfig,
            AutoModelForCausalLM,
            AutoModelForImageTextToText,
            AutoModelForTokenClassification,
        )

        on_gpu = self._device.type == "cuda"
        mixed = on_gpu and self.tcfg.mixed_precision
        dtype = torch.float32 if mixed else _DTYPES[self.settings.model.dtype]
        attn = self.tcfg.attn_implementation or _default_attention(on_gpu)
        if attn == "sdpa_varlen":
            from slipstream.trainer.engine import varlen  # noqa: F401  (registers the kernel)
        self._share_prefix = self._share_prefix and attn == "sdpa_varlen" and not self.value_head
        if self._sp > 1:
            from slipstream.trainer import seqpar

            attn = seqpar.register(attn)
        remote = self.settings.model.trust_remote_code
        self._vision = vision.is_vision_config(
            AutoConfig.from_pretrained(self.model_path, trust_remote_code=remote)
        )
        if self._vision and (self.value_head or self._sp > 1):
            raise ValueError(
                "a vision-language model is supported as the policy (or reference) without sequence parallelism"
            )
        kwargs = dict(
            dtype=dtype,
            attn_implementation=vision.attention_kernels(attn) if self._vision else attn,
            trust_remote_code=remote,
        )
        if self.value_head:
            model = AutoModelForTokenClassification.from_pretrained(self.model_path, num_labels=1, **kwargs)
        elif self._vision:
            model = AutoModelForImageTextToText.from_pretrained(self.model_path, **kwargs)
            self._share_prefix = False  # the shared-prompt row has no multi-modal positions
        else:
            model = AutoModelForCausalLM.from_pretrained(self.model_path, **kwargs)
        model.config.use_cache = False
        if not self.value_head and (self.tcfg.logits_chunk_tokens > 0 or self._sp > 1):
            # before sharding, so FSDP sees the same parameter (tied or not) under the same name
            self._head = install_logprob_head(
                model, self.tcfg.logits_chunk_tokens, self.temperature, self.truncation
            )
            if self._head is None and self._sp > 1:
                raise ValueError(
                    f"sequence parallelism: {type(model).__name__}'s output layer is not supported"
                )
            if self._head is None:
                log.info(
                    "%s: output layer is not a plain linear map; logprobs use full logits",
                    type(model).__name__,
                )
        if self._lora is not None:
            adapted = lora.apply_lora(model, self._lora, seed=self.settings.run.seed)
            log.info("LoRA r=%d on %d linear layers", self._lora.rank, len(adapted))
        if self.tcfg.activation_checkpointing:
            # HF's own switch keeps parameter names (torch's checkpoint_wrapper would rename them).
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(
                    activation_checkpointing_kwargs={"use_reentrant": False}
                )
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self._vision and self.tcfg.freeze_vision_tower:
            log.info("vision tower frozen: %d tensors", vision.freeze_vision_tower(model))
        config = getattr(model.config, "text_config", None) or model.config
        self._arch = (int(getattr(config, "num_hidden_layers", 0)), int(getattr(config, "hidden_size", 0)))
        return model

    def _shard(self, model: torch.nn.Module) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self._device.type, (self.world_size,))
        kwargs = {"mesh": mesh}
        if self._device.type == "cuda" and self.tcfg.mixed_precision:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        block_names = set(getattr(model, "_no_split_modules", None) or [])
        blocks = [m for m in model.modules() if type(m).__name__ in block_names]
        if not blocks:
            raise ValueError(f"{type(model).__name__}: no `_no_split_modules` blocks found to shard")
        for block in blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)

    def _lr_lambda(self, step: int) -> float:
        warmup = self.tcfg.warmup_steps
        if warmup and step < warmup:
            return (step + 1) / warmup
        total = self.settings.run.total_steps
        if self.tcfg.lr_schedule == "constant" or total <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        floor = self.tcfg.min_lr_ratio
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    # ---------------------------------------------------------------- forward / backward
    def forward_backward_batch(
        self, data: TensorDict, loss_fn: LossFn | None, forward_only: bool = False
    ) -> EngineOutput:
        if self.model is None:
            raise RuntimeError("FSDPEngine.initialize() must run before forward_backward_batch")
        if not forward_only and loss_fn is None:
            raise ValueError("forward_backward_batch needs a loss_fn unless forward_only=True")
        lengths = sample_lengths(data)
        if not lengths:
            raise ValueError("forward_backward_batch: this rank's data has no sample")
        padded = not self.tcfg.pack_sequences
        plan = split_by_token_budget(lengths, self.tcfg.micro_batch_tokens, padded=padded)
        steps = self._max_over_ranks(len(plan))
        pad_to = max(lengths) if padded else 0
        aux = None if forward_only else self._aux
        aux_tokens = self._sum_over_ranks({"t": torch.tensor(float(sum(lengths)))})["t"] if aux else 1.0
        entropy = "grad" if getattr(loss_fn, "entropy_grad", False) else None
        if entropy is None and getattr(loss_fn, "needs_entropy", False):
            entropy = "metric"
        sums: dict[str, torch.Tensor] = {}
        pieces: dict[str, list[torch.Tensor]] = {}
        self.model.train(not forward_only)
        for i in range(steps):
            real = i < len(plan)
            mb = select_samples(data, plan[i]) if real else truncate_to_one_token(data)
            mb = mb.to(self._device)
            with torch.set_grad_enabled(not forward_only):
                with aux.armed() if aux is not None else contextlib.nullcontext():
                    outputs = self._forward(mb, pad_to if real else 0, entropy)
                loss, metrics = loss_fn(outputs, mb) if loss_fn is not None else (None, {})
                if not real and loss is not None:
                    loss = loss * 0.0 + _touch_all(outputs)
                    metrics = {k: v * 0.0 for k, v in metrics.items()}
                if aux is not None:
                    share = mb["input_ids"].numel() / aux_tokens if real else 0.0
                    loss, metrics = self._add_aux_loss(loss, metrics, mb, pad_to if real else 0, share)
                if not forward_only:
                    (loss * self.world_size).backward()
            if loss is not None:
                metrics = {"loss": loss, **metrics}
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value.detach().float()
            if forward_only and real:
                for key, value in outputs.items():
                    pieces.setdefault(key, []).append(value.detach().float().cpu())
        result = EngineOutput(num_micro_batches=steps, num_tokens=sum(lengths))
        result.metrics = self._sum_over_ranks(sums)
        result.tokens = {k: torch.cat(v) for k, v in pieces.items()}
        return result

    def _add_aux_loss(self, loss, metrics: dict, mb: TensorDict, pad_to: int, share: float):  # noqa: ANN001, ANN202
        """``loss`` plus this micro-batch's load-balancing loss, weighted by ``share`` (its tokens over the
        mini-batch's, all ranks; see ``engine/moe.py``). Sequence-parallel peers each hold 1/n of the tokens'
        router logits and the same micro-batch: their n terms add up to one, and so do their metrics once
        ``_sum_over_ranks`` divides by n."""
        mask = _padded_grid(mb["input_ids"].long(), mb["cu_seqlens"].long(), pad_to)[1] if pad_to else None
        aux = self._aux.take_aux_loss(mask) * share
        metrics = {**metrics, "moe_aux_loss": aux.detach()}
        return loss + (self.tcfg.moe.aux_loss_coef / self._sp) * aux, metrics

    def _forward(self, mb: TensorDict, pad_to: int, entropy: str | None) -> dict[str, torch.Tensor]:
        """Run the model on one micro-batch; return flat per-token outputs aligned with ``mb``'s tokens.

        ``entropy``: None (not computed), "metric" (computed without gradient) or "grad" (differentiable).
        Row j of the model's per-token results scores token j + 1; outputs are shifted to align with the
        tokens and zeroed at each sample's first token (nothing predicts it).
        """
        ids, pos, cu = mb["input_ids"].long(), mb["position_ids"].long(), mb["cu_seqlens"].long()
        starts = cu[:-1]
        if self.value_head:
            logits = self._run_model(ids, pos, cu, pad_to)
            values = torch.cat([logits.new_zeros(1), logits[:-1, 0].float()])
            values[starts] = 0.0
            return {"values": values}
        images = self._image_kwargs(mb, pad_to)
        if self._head is not None:
            rows = _scored_rows(mb) if self._sp == 1 else None
            layout = self._replay_routes(mb, pad_to, self._prefix_layout(mb, pad_to))
            logp_next, ent_next = self._head_forward(ids, pos, cu, pad_to, entropy, rows, layout, images)
        else:
            self._replay_routes(mb, pad_to, None)
            logp_next, ent_next = self._full_logits_forward(ids, pos, cu, pad_to, entropy, images)
        out = {"logprobs": _align_next(logp_next, starts)}
        if ent_next is not None:
            out["entropy"] = _align_next(ent_next, starts)
        return out

    def _image_kwargs(self, mb: TensorDict, pad_to: int) -> dict:
        """The forward's image inputs and multi-modal positions for ``mb`` (``engine/vision.py``); none for
        a text micro-batch."""
        if not vision.mb_has_images(mb):
            return {}
        if not self._vision:
            raise ValueError(f"the batch has images but {self.model_path} is not a vision-language model")
        if pad_to:
            raise ValueError("image prompts need trainer.pack_sequences=true")
        return vision.forward_kwargs(self.model, mb)

    def _replay_routes(self, mb: TensorDict, pad_to: int, layout):  # noqa: ANN001, ANN202
        """Hold the routers to ``mb``'s routes, on the rows this forward runs, until the next micro-batch's
        forward (its backward, which may re-run the forward, replays them too); none: route freely. Returns
        the shared-prompt layout to run (None where the samples' routes of a shared row differ)."""
        if self._replay is None:
            return layout
        if ROUTES_KEY not in mb.keys():
            self._replay.clear()
            return layout
        if self._sp > 1:
            raise NotImplementedError("routing replay with trainer.sequence_parallel_size > 1")
        grid = _padded_grid(mb["input_ids"], mb["cu_seqlens"].long(), pad_to)[1] if pad_to else None
        routes, layout = forward_routes(mb[ROUTES_KEY], layout=layout, grid_mask=grid)
        self._replay.set(routes)
        return layout

    def _prefix_layout(self, mb: TensorDict, pad_to: int):  # noqa: ANN202
        """The shared-prompt layout of ``mb`` (``engine/prefix.py``) where it applies, else None."""
        if not self._share_prefix or pad_to or self._sp > 1 or mb["input_ids"].numel() < 2:
            return None
        from slipstream.trainer.engine.prefix import build_layout

        return build_layout(mb)

    def _head_forward(self, ids, pos, cu, pad_to, entropy, rows=None, layout=None, images=None):  # noqa: ANN001, ANN202
        """Logprobs (and entropy) of tokens 1.. computed chunk by chunk inside the model's forward.

        ``rows`` (see :func:`_scored_rows`): the only rows to score; the others come back as zeros. The
        output layer and the log-softmax over the vocabulary then run on the response tokens alone, which
        in RL batches are a fraction of the tokens (the prompts are scored by no loss). ``layout``: run the
        micro-batch as its shared-prompt row (``engine/prefix.py``) and score each token from its row there.
        ``images``: the forward's image inputs and positions (``_image_kwargs``).
        """
        if self._sp > 1:
            return self._sequence_parallel_forward(ids, pos, cu, entropy)
        src = None
        if pad_to:
            _, attn, _ = _padded_grid(ids, cu, pad_to)
            src = attn.flatten().nonzero()[:-1, 0]  # flat grid rows of every real token but the last
        elif layout is not None:
            src = layout.index[:-1]  # token j + 1 is scored from the row holding token j
        targets = ids[1:]
        if rows is not None:
            targets = targets.index_select(0, rows)
            src = rows if src is None else src.index_select(0, rows)
        with self._head.request(targets=targets, src=src, entropy=entropy):
            if layout is None:
                logp, ent = self._run_model(ids, pos, cu, pad_to, raw=True, images=images)
            else:
                logp, ent = self.model(
                    input_ids=layout.ids[None],
                    position_ids=layout.positions[None],
                    use_cache=False,
                    prefix_blocks=layout.blocks,
                ).logits
        if rows is None:
            return logp, ent
        n = ids.numel() - 1
        scatter = lambda x: None if x is None else x.new_zeros(n).index_put((rows,), x)  # noqa: E731
        return scatter(logp), scatter(ent)

    def _sequence_parallel_forward(self, ids, pos, cu, entropy):  # noqa: ANN001, ANN202
        """This rank's 1/n of the packed row through the model (attention all-to-all inside, see
        ``trainer/seqpar.py``); the per-token results of the group joined back into the whole row's."""
        from slipstream.trainer import seqpar

        n, t = self._sp, ids.numel()
        pad = (-t) % n
        if pad:  # a dummy sample at the end makes the row divide evenly
            ids = torch.cat([ids, ids.new_zeros(pad)])
            pos = torch.cat([pos, torch.arange(pad, device=pos.device)])
            cu = torch.cat([cu, cu.new_tensor([t + pad])])
        local = (t + pad) // n
        a, b = self._sp_rank * local, (self._sp_rank + 1) * local
        targets = torch.cat([ids[1:], ids.new_zeros(1)])[a:b]  # row j scores token j + 1
        with self._head.request(targets=targets, entropy=entropy):
            logp, ent = self.model(
                input_ids=ids[None, a:b],
                position_ids=pos[None, a:b],
                use_cache=False,
                ulysses_group=self._sp_group,
                **self._varlen_kwargs(cu),
            ).logits
        logp = seqpar.gather_sequence(logp, self._sp_group)[: t - 1]
        if ent is not None:
            ent = seqpar.gather_sequence(ent, self._sp_group)[: t - 1]
        return logp, ent

    def _full_logits_forward(self, ids, pos, cu, pad_to, entropy, images=None):  # noqa: ANN001, ANN202
        """The plain path: every token's full-vocabulary fp32 logits at once."""
        logits = self._run_model(ids, pos, cu, pad_to, images=images)
        logits = truncate_logits(logits.float()[:-1] / self.temperature, ids[1:], self.truncation)
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[1:, None])[:, 0]
        if entropy is None:
            return logp, None
        source = logits if entropy == "grad" else logits.detach()
        return logp, plain_entropy(source, self.truncation is not None)

    def _run_model(self, ids, pos, cu, pad_to: int, raw: bool = False, images=None):  # noqa: ANN001, ANN201
        """The model on the packed row (or, with ``pad_to``, the padded grid). Returns what its output layer
        gives: with ``raw`` as is, else as flat per-token rows aligned with ``ids``. ``images`` (packed row
        only): pixel inputs and the multi-modal positions that replace ``pos``."""
        if pad_to:
            grid, attn, gpos = _padded_grid(ids, cu, pad_to)
            out = self.model(input_ids=grid, attention_mask=attn.long(), position_ids=gpos, use_cache=False)
            return out.logits if raw else out.logits[attn]
        # cu_seq_lens_q reaches every attention layer: flash-attention and sdpa_varlen use it as varlen
        # boundaries; other kernels ignore it and rely on the restarting position ids.
        images = dict(images or {})
        positions = images.pop("position_ids", pos[None])
        out = self.model(
            input_ids=ids[None], position_ids=positions, use_cache=False, **images, **self._varlen_kwargs(cu)
        )
        return out.logits if raw else out.logits[0]

    def _varlen_kwargs(self, cu: torch.Tensor) -> dict:
        from slipstream.trainer.seqpar import inner_kernel

        if inner_kernel(self.model.config._attn_implementation) not in (
            "sdpa_varlen",
            "flash_attention_2",
            "flash_attention_3",
        ):
            return {}
        cu32 = cu.to(torch.int32)
        longest = int((cu[1:] - cu[:-1]).max())
        return {
            "cu_seq_lens_q": cu32,
            "cu_seq_lens_k": cu32,
            "max_length_q": longest,
            "max_length_k": longest,
        }

    def _max_over_ranks(self, n: int) -> int:
        if self.world_size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=self._device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _sum_over_ranks(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        keys = sorted(sums)
        if not keys:
            return {}
        vec = torch.stack([torch.as_tensor(sums[k], dtype=torch.float32, device=self._device) for k in keys])
        if self.world_size > 1:
            dist.all_reduce(vec)
        # sequence-parallel peers computed the same micro-batches' metrics: count each replica once
        vec = vec / self._sp if self._sp > 1 else vec
        return dict(zip(keys, vec.tolist(), strict=True))

    # ---------------------------------------------------------------- optimisation
    def optimizer_step(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.tcfg.grad_clip) if params else torch.tensor(0.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        value = float(norm)
        if math.isfinite(value):
            self.optimizer.step()
        else:
            log.warning("non-finite grad norm %s: update skipped", value)
        self.optimizer.zero_grad(set_to_none=True)
        return value

    def lr_scheduler_step(self) -> float:
        self.scheduler.step()
        return float(self.scheduler.get_last_lr()[0])

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    # ---------------------------------------------------------------- weights out
    def get_per_tensor_param(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        if self._lora is not None:  # the merged model, under the base model's names
            yield from lora.merged_named_tensors(self.model, dtype)
            return
        # A frozen vision tower goes too: every receiver applies whole versions only (each weight it serves),
        # and a server that loaded another tower (a resumed run that trained it before) must get this one.
        for name, param in self.model.named_parameters():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param.data
            full = full.detach()
            if self._vision:  # the servers load the checkpoint's names
                name = vision.checkpoint_name(name)
            yield name, (full.to(dtype) if dtype is not None else full)
            del full

    def get_adapter_params(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(``<module>.lora_A.weight`` / ``lora_B.weight``, full tensor) of every adapter. Collective."""
        if self._lora is None:
            raise RuntimeError("get_adapter_params: this engine has no LoRA adapters (trainer.lora.rank 0)")
        yield from lora.adapter_named_tensors(self.model, dtype)

    def base_reference(self) -> ModelEngine:
        """The KL reference of a LoRA policy: this engine with its adapters off (no second model)."""
        if self._lora is None:
            raise RuntimeError("base_reference: this engine has no LoRA adapters")
        return lora.BaseModelReference(self)

    def to(
        self, device: str | torch.device, model: bool = True, optimizer: bool = True, grad: bool = True
    ) -> None:
        device = torch.device(device)
        if model:
            self.model.to(device)
        if grad:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad = p.grad.to(device)
        if optimizer:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        state[key] = value.to(device)

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str | Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._state_options())
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "dcp"))
        if self.rank == 0:
            extra = {"scheduler": self.scheduler.state_dict()}
            if self._lora is not None:
                extra["lora"] = lora.describe(self._lora)
            torch.save(extra, path / "engine_extra.pt")
        torch.save(_rng_state(), path / f"rng_rank{self.rank}.pt")
        dist.barrier()

    def load_checkpoint(self, path: str | Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        path = Path(path)
        if not (path / "dcp").is_dir():
            raise FileNotFoundError(f"{path}: no engine checkpoint (missing dcp/)")
        extra = torch.load(path / "engine_extra.pt", weights_only=True)
        lora.check_checkpoint(path, extra.get("lora"), self._lora)
        options = self._state_options()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path / "dcp"))
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=options,
        )
        self.scheduler.load_state_dict(extra["scheduler"])
        rng_file = path / f"rng_rank{self.rank}.pt"
        if rng_file.is_file():
            _set_rng_state(torch.load(rng_file, weights_only=True))
        dist.barrier()

    def _state_options(self):  # noqa: ANN202
        """LoRA checkpoints hold the adapters and their optimizer state, not the frozen base weights."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        if self._lora is None:
            return None
        return StateDictOptions(ignore_frozen_params=True, strict=False)

    # ---------------------------------------------------------------- introspection
    @property
    def device(self) -> torch.device:
        return self._device

    def model_flops(self, lengths: list[int]) -> float:
        """6 * params per token (forward + backward) plus causal attention, 6 * layers * hidden * len^2 / 1."""
        layers, hidden = self._arch
        tokens = sum(lengths)
        # LoRA: frozen base weights take no weight-gradient matmul in backward (2 of the 6 FLOPs)
        per_param = 4.0 if self._lora is not None else 6.0
        return per_param * self._num_params * tokens + 6.0 * layers * hidden * sum(n * n for n in lengths)


def _scored_rows(mb: TensorDict) -> torch.Tensor | None:
    """Rows j of the packed row whose next token j + 1 is in ``mb``'s loss mask (row j scores token j + 1),
    or None (score every row) when the micro-batch has no loss mask. Every consumer of the logprobs and
    entropy (losses, KL, metrics, the proximal and reference passes) reads them through that mask, so the
    rows left out are never read. At least one row is kept, so that the output layer takes part in the
    backward of a micro-batch without response tokens as it does in every other."""
    if "loss_mask" not in mb.keys() or mb["loss_mask"].numel() < 2:
        return None
    rows = mb["loss_mask"][1:].bool().nonzero()[:, 0]
    return rows if rows.numel() else rows.new_zeros(1)


def _align_next(per_next: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """[t-1] results for tokens 1.. -> [t] aligned with the tokens, 0 at each sample's first token."""
    return torch.cat([per_next.new_zeros(1), per_next]).index_fill(0, starts, 0.0)


def _padded_grid(ids: torch.Tensor, cu: torch.Tensor, pad_to: int):  # noqa: ANN202
    """The padded baseline's layout: rows of ``pad_to`` tokens, their mask and position ids."""
    n = cu.numel() - 1
    lengths = cu[1:] - cu[:-1]
    grid = torch.zeros(n, pad_to, dtype=torch.long, device=ids.device)
    attn = torch.arange(pad_to, device=ids.device)[None, :] < lengths[:, None]
    grid[attn] = ids
    pos = torch.arange(pad_to, device=ids.device).expand(n, -1)
    return grid, attn, pos


def _touch_all(outputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """A zero that depends on every output, so backward visits every FSDP module (zero-weight micro-batch)."""
    return sum(v.sum() for v in outputs.values()) * 0.0


def _default_attention(on_gpu: bool) -> str:
    if on_gpu:
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa_varlen"


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
