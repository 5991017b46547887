"""Megatron-core engine (GPU only): tensor + pipeline parallel training of HF Llama/Qwen2 models.

Written against megatron-core 0.16.1 (``pip install 'slipstream[megatron]'``). The model is ``GPTModel``
built from the HF config (RoPE mapped by ``megatron_setup.py``); HF weights are loaded by converting
each rank's TP/PP shard (``megatron_convert.py``, unit-tested on CPU), and ``get_per_tensor_param`` turns
the shards back into full HF tensors one at a time: all-gather over the TP group, broadcast from the owning
pipeline stage over the PP group, so every rank of the world yields the same (name, tensor) sequence.

Data parallelism is Megatron's ``DistributedDataParallel`` + distributed optimizer over the DP group;
``dp_rank``/``dp_size`` tell the trainer how to shard batches (TP and PP peers of one replica see the same
shard). Gradients are finalised by megatron-core's ``finalize_model_grads`` before each optimizer step: DP
reduction, layer-norm grads across TP under sequence parallelism, tied embedding grads between the first
and last pipeline stages (whose copy of a tied embedding is loaded from the same HF tensor).

Two layer implementations (``trainer.megatron_layer_spec``): with Transformer Engine, micro-batches are
packed rows with ``PackedSeqParams(qkv_format="thd")`` and the sample boundaries; with megatron-core's local
spec (no Transformer Engine) a micro-batch is a padded [samples, longest] batch under a causal mask, since
its attention takes no sample boundaries (and megatron's RoPE numbers positions 0.. along a row, which is
right for one sample per row). With pipeline parallelism every micro-batch has one shape (padding), because
stages exchange fixed-shape activations.

Device: GPUs (bf16 compute with ``trainer.mixed_precision``, fp32 otherwise). ``trainer.device=cpu`` builds
the model on the CPU in fp32 with dropout off (megatron's CUDA RNG tracker is replaced by its no-op one);
megatron-core 0.16.1 still allocates some buffers on ``"cuda"`` by name (schedules, optimizer), so a CPU run
needs those redirected, as ``tests/trainer/megatron_cpu.py`` does for the tests.

Logprobs and entropy: the last stage's output layer is turned into a chunked, vocab-parallel head
(``megatron_logprobs.py``, ``trainer.logits_chunk_tokens`` rows at a time): no [tokens, vocab/tp] fp32 logits
outlive a chunk, so long responses fit as with FSDP, and the entropy is differentiable (the entropy bonus
trains, with the same gradient as the FSDP engine's).

Loss scaling: Megatron's schedules divide each micro-batch loss by the number of micro-batches and DDP
averages gradients over the DP group, while our loss is each micro-batch's share of the global mean
(``algos/aggregation.py``), so the loss handed to Megatron is multiplied by both (as verl documents).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from slipstream.trainer.batching import (
    sample_lengths,
    select_samples,
    split_by_token_budget,
    truncate_to_one_token,
)
from slipstream.trainer.engine.base import EngineOutput, LossFn, ModelEngine
from slipstream.trainer.engine.megatron_convert import (
    ArchSpec,
    hf_to_mcore,
    mcore_to_hf,
    stage_rules,
    unshard,
)
from slipstream.trainer.engine.megatron_setup import layer_spec, layer_spec_kind, rope_kwargs

if TYPE_CHECKING:
    from slipstream.trainer.settings import TrainerSettings


class MegatronEngine(ModelEngine):
    """``ModelEngine`` over megatron-core; every method is collective over the world group."""

    def __init__(self, settings: TrainerSettings, *, value_head: bool = False) -> None:
        if value_head:
            raise NotImplementedError(
                "the Megatron engine has no value head yet; use trainer.engine=fsdp for gae"
            )
        self.settings, self.tcfg = settings, settings.trainer
        self.temperature = float(settings.sampling_temperature) or 1.0
        self.model = self.optimizer = self.scheduler = None
        self.spec: ArchSpec | None = None
        self.te = True
        self._head = None  # the last stage's chunked logprob head (megatron_logprobs.py)
        want = self.tcfg.device
        on_gpu = want == "cuda" or (want == "auto" and torch.cuda.is_available())
        self._device = torch.device("cuda") if on_gpu else torch.device("cpu")
        self._dtype = torch.bfloat16 if on_gpu and self.tcfg.mixed_precision else torch.float32

    # ---------------------------------------------------------------- setup
    def initialize(self) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from transformers import AutoConfig

        if self._device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("trainer.device=cuda but no CUDA GPU is visible")
        if not dist.is_initialized():
            raise RuntimeError("initialise torch.distributed before MegatronEngine.initialize()")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        tp, pp = self.tcfg.tensor_parallel, self.tcfg.pipeline_parallel
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        if self._device.type == "cuda":
            torch.cuda.set_device(self.rank % torch.cuda.device_count())
            self._device = torch.device("cuda", torch.cuda.current_device())
            tensor_parallel.model_parallel_cuda_manual_seed(self.settings.run.seed)
        else:  # dropout is off, so no RNG fork draws anything: megatron's no-op tracker stands in
            torch.manual_seed(self.settings.run.seed)
            tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        hf_config = AutoConfig.from_pretrained(
            self.settings.model.path, trust_remote_code=self.settings.model.trust_remote_code
        )
        self.spec = ArchSpec.from_hf_config(hf_config)
        self.te = layer_spec_kind(self.tcfg.megatron_layer_spec) == "te"
        self.model = self._build_model(hf_config)
        self._load_hf_weights()
        self._head = None
        if ps.is_pipeline_last_stage():
            from slipstream.trainer.engine.megatron_logprobs import OutputLayerHead

            self._head = OutputLayerHead(
                self.model.module.output_layer, self.tcfg.logits_chunk_tokens, self.temperature
            )
        self._build_optimizer()

    def _build_model(self, hf_config: Any) -> torch.nn.Module:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer import TransformerConfig

        s, dtype = self.spec, self._dtype
        rope = rope_kwargs(hf_config)  # before building anything: refuses a rope it cannot reproduce
        config = TransformerConfig(
            num_layers=s.num_layers,
            hidden_size=s.hidden,
            num_attention_heads=s.num_heads,
            num_query_groups=s.num_kv_heads,
            kv_channels=s.head_dim,
            ffn_hidden_size=s.ffn_hidden,
            normalization="RMSNorm",
            layernorm_epsilon=hf_config.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            add_qkv_bias=s.qkv_bias,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            use_cpu_initialization=self._device.type == "cpu",
            tensor_model_parallel_size=self.tcfg.tensor_parallel,
            pipeline_model_parallel_size=self.tcfg.pipeline_parallel,
            sequence_parallel=self.tcfg.tensor_parallel > 1,
            recompute_granularity="full" if self.tcfg.activation_checkpointing else None,
            recompute_method="uniform" if self.tcfg.activation_checkpointing else None,
            recompute_num_layers=1 if self.tcfg.activation_checkpointing else None,
            attention_dropout=0.0,
            hidden_dropout=0.0,
        )
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec("te" if self.te else "local"),
            vocab_size=s.vocab_size,
            max_sequence_length=hf_config.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=s.tied,
            **rope,
        ).to(self._device)
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
        return DistributedDataParallel(config=config, ddp_config=ddp, module=model)

    def _load_hf_weights(self) -> None:
        from megatron.core import parallel_state as ps
        from safetensors.torch import load_file

        files = sorted(Path(self.settings.model.path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.settings.model.path}: no *.safetensors weights")
        hf: dict[str, torch.Tensor] = {}
        for f in files:
            hf.update(load_file(str(f)))
        shard = hf_to_mcore(
            hf,
            self.spec,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            te=self.te,
        )
        unloaded = [n for n, _ in self.model.module.named_parameters() if n not in shard]
        if unloaded:  # a parameter left at its random init would train silently wrong
            raise RuntimeError(f"HF checkpoint conversion left these parameters unloaded: {unloaded}")
        own = self.model.module.state_dict()
        with torch.no_grad():
            for name, tensor in shard.items():
                own[name].copy_(tensor.to(own[name].dtype))

    def _build_optimizer(self) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        t = self.tcfg
        ocfg = OptimizerConfig(
            optimizer="adam",
            lr=t.lr,
            weight_decay=t.weight_decay,
            adam_beta1=t.betas[0],
            adam_beta2=t.betas[1],
            clip_grad=t.grad_clip,
            bf16=self._dtype == torch.bfloat16,
            use_distributed_optimizer=True,
        )
        self.optimizer = get_megatron_optimizer(ocfg, [self.model])
        from slipstream.trainer.engine.fsdp import FSDPEngine

        lam = FSDPEngine._lr_lambda.__get__(self)  # the same warmup/cosine schedule as the FSDP engine
        self.scheduler = _LambdaSchedule(self.optimizer, lam, t.lr)

    # ---------------------------------------------------------------- parallel layout
    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_world_size()

    @property
    def dp_group(self) -> Any:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

    @property
    def device(self) -> torch.device:
        return self._device

    # ---------------------------------------------------------------- forward / backward
    def forward_backward_batch(
        self, data: TensorDict, loss_fn: LossFn | None, forward_only: bool = False
    ) -> EngineOutput:
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        lengths = sample_lengths(data)
        plan = split_by_token_budget(lengths, self.tcfg.micro_batch_tokens)
        steps = _max_over(len(plan), self.dp_group, self.device)
        mbs = [
            select_samples(data, p) if i < len(plan) else truncate_to_one_token(data)
            for i, p in enumerate(plan + [plan[0]] * (steps - len(plan)))
        ]
        real = [i < len(plan) for i in range(steps)]
        seq_len, rows = self._shape(mbs)
        sums: dict[str, torch.Tensor] = {}
        pieces: list[torch.Tensor] = []
        scale = steps * self.dp_size
        it = iter(zip(mbs, real, strict=True))
        entropy = "grad" if getattr(loss_fn, "entropy_grad", False) else None
        if entropy is None and getattr(loss_fn, "needs_entropy", False):
            entropy = "metric"

        def forward_step(_iter, model):
            mb, is_real = next(it)
            mb = mb.to(self.device)
            ids, pos, mask, packed, src = self._model_inputs(mb, seq_len, rows)
            flat = mb["input_ids"].long()
            with self._scoring(src, torch.roll(flat, -1), entropy):
                out = model(ids, pos, mask, packed_seq_params=packed)

            def loss_func(scored):
                outputs = self._token_outputs(scored, mb["cu_seqlens"], entropy)
                if forward_only and is_real:
                    pieces.append(outputs["logprobs"].detach().float().cpu())
                if loss_fn is None:
                    return scored.sum() * 0.0, {}
                loss, metrics = loss_fn(outputs, mb)
                weight = 1.0 if is_real else 0.0
                for k, v in {"loss": loss, **metrics}.items():
                    sums[k] = sums.get(k, 0.0) + v.detach().float() * weight
                return loss * weight * scale, {}

            return out, loss_func

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(range(steps)),
            model=[self.model],
            num_microbatches=steps,
            seq_length=seq_len,
            micro_batch_size=rows or 1,
            forward_only=forward_only,
        )
        result = EngineOutput(num_micro_batches=steps, num_tokens=sum(lengths))
        result.metrics = self._reduce_metrics(sums)
        if forward_only:
            local = torch.cat(pieces) if pieces else torch.zeros(sum(lengths))
            if ps.get_pipeline_model_parallel_world_size() > 1:
                local = local.to(self.device)
                dist.broadcast(
                    local,
                    ps.get_pipeline_model_parallel_last_rank(),
                    group=ps.get_pipeline_model_parallel_group(),
                )
                local = local.cpu()
            result.tokens = {"logprobs": local}
        return result

    def _shape(self, mbs: list[TensorDict]) -> tuple[int, int]:
        """(sequence length, rows) of the model input; rows 0 = one packed row (THD).

        Under pipeline parallelism every micro-batch gets the same shape; sequence parallelism splits the
        sequence over TP ranks, so it is a multiple of the TP size."""
        tp, pp = self.tcfg.tensor_parallel, self.tcfg.pipeline_parallel
        if self.te:
            n = max(int(mb["input_ids"].numel()) for mb in mbs)
            if pp > 1:
                n = max(n, self.tcfg.micro_batch_tokens)
            return math.ceil(n / tp) * tp, 0
        longest = max(max(sample_lengths(mb)) for mb in mbs)
        rows = max(len(sample_lengths(mb)) for mb in mbs) if pp > 1 else 0
        return math.ceil(longest / tp) * tp, rows

    def _model_inputs(self, mb: TensorDict, seq_len: int, rows: int):
        """(input_ids, position_ids, attention_mask, packed_seq_params, src) of one micro-batch, where ``src``
        are the rows of the model's batch-major [rows * seq, H] hidden states holding its real tokens, in
        packed order (what the output head scores)."""
        ids, cu = mb["input_ids"].long(), mb["cu_seqlens"].long()
        n_real, tp = ids.numel(), self.tcfg.tensor_parallel
        if self.te:  # one packed row, sample boundaries for TE's THD attention
            total = seq_len if self.tcfg.pipeline_parallel > 1 else math.ceil(n_real / tp) * tp
            pos = mb["position_ids"].long()
            if total > n_real:  # a trailing padding sample
                ids = torch.cat([ids, ids.new_zeros(total - n_real)])
                pos = torch.cat([pos, torch.arange(total - n_real, device=pos.device)])
                cu = torch.cat([cu, cu.new_tensor([total])])
            src = torch.arange(n_real, device=ids.device)
            return ids[None], pos[None], None, self._packed_params(cu.int()), src
        # local spec: a padded [samples, seq_len] batch; causal masking keeps the padding out of real tokens
        lengths = cu[1:] - cu[:-1]
        seq_len = seq_len if self.tcfg.pipeline_parallel > 1 else math.ceil(int(lengths.max()) / tp) * tp
        valid = torch.arange(seq_len, device=ids.device)[None] < lengths[:, None]
        grid = ids.new_zeros(max(rows, len(lengths)), seq_len)
        grid[: len(lengths)][valid] = ids
        pos = torch.arange(seq_len, device=ids.device)[None].expand_as(grid)
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=ids.device).triu(1)[None, None]
        return grid, pos, mask, None, valid.flatten().nonzero()[:, 0]

    def _packed_params(self, cu: torch.Tensor):
        from megatron.core.packed_seq_params import PackedSeqParams

        longest = int((cu[1:] - cu[:-1]).max())
        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
        )

    @contextlib.contextmanager
    def _scoring(self, src: torch.Tensor, targets: torch.Tensor, entropy: str | None) -> Iterator[None]:
        """Within: the last stage's output layer returns per-token (logprob, entropy), chunked, not logits."""
        if self._head is None:
            yield
            return
        with self._head.request(src, targets, entropy):
            yield

    def _token_outputs(self, scored, cu, entropy) -> dict[str, torch.Tensor]:
        """Flat logprobs (and entropy) aligned with a micro-batch's tokens, 0 at each sample's first token.

        Row j of ``scored`` is token j's prediction of token j + 1 (the roll crosses into the next sample
        at each sample's end; those rows land on the next sample's first token and are zeroed)."""
        from slipstream.trainer.engine.megatron_logprobs import split_outputs

        logp_next, ent_next = split_outputs(scored)
        starts = cu[:-1].long()
        out = {"logprobs": torch.cat([logp_next.new_zeros(1), logp_next[:-1]]).index_fill(0, starts, 0.0)}
        if entropy is not None:
            out["entropy"] = torch.cat([ent_next.new_zeros(1), ent_next[:-1]]).index_fill(0, starts, 0.0)
        return out

    def _reduce_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """Metrics live on the last stage: summed over DP there, then shared along the pipeline, names
        included (the other stages ran no loss_fn)."""
        from megatron.core import parallel_state as ps

        keys = sorted(sums)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            box = [keys]
            dist.broadcast_object_list(
                box,
                ps.get_pipeline_model_parallel_last_rank(),
                group=ps.get_pipeline_model_parallel_group(),
                device=self.device,
            )
            keys = box[0]
        if not keys:
            return {}
        vec = torch.zeros(len(keys), device=self.device)
        if ps.is_pipeline_last_stage():
            vec = torch.stack([torch.as_tensor(sums[k], device=self.device).float() for k in keys])
        dist.all_reduce(vec, group=self.dp_group)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(
                vec, ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
            )
        return dict(zip(keys, vec.tolist(), strict=True))

    # ---------------------------------------------------------------- optimisation
    def optimizer_step(self) -> float:
        from megatron.core.distributed import finalize_model_grads

        # DP reduction, plus what finish_grad_sync alone misses: TP all-reduce of layer-norm grads under
        # sequence parallelism and the tied embedding grads of the first and last pipeline stages
        finalize_model_grads([self.model])
        ok, grad_norm, _ = self.optimizer.step()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        return float(grad_norm) if ok and grad_norm is not None else float("nan")

    def lr_scheduler_step(self) -> float:
        return self.scheduler.step()

    # ---------------------------------------------------------------- weights out
    def get_per_tensor_param(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        from megatron.core import parallel_state as ps

        tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
        tp_size, pp_size = (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
        )
        my_stage = ps.get_pipeline_model_parallel_rank()
        own = self.model.module.state_dict()
        for stage in range(pp_size):
            for rule in stage_rules(self.spec, stage, pp_size, te=self.te):
                full = None
                if stage == my_stage:
                    local = own[rule.mcore].detach()
                    pieces = [torch.empty_like(local) for _ in range(tp_size)]
                    dist.all_gather(pieces, local, group=tp_group)
                    full = unshard(pieces, rule.kind)
                full = _broadcast_from_stage(full, stage, pp_group, self.device, self._dtype)
                for name, tensor in mcore_to_hf(rule, full):
                    yield name, (tensor.to(dtype) if dtype is not None else tensor)
                del full

    def to(
        self, device: str | torch.device, model: bool = True, optimizer: bool = True, grad: bool = True
    ) -> None:
        raise NotImplementedError("offloading the Megatron engine is not supported yet")

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str | Path) -> None:
        """megatron-core's dist_checkpointing (torch DCP underneath): model + distributed optimizer."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        (path / "mcore").mkdir(parents=True, exist_ok=True)
        model_sd = self.model.module.sharded_state_dict()
        state = {"model": model_sd, "optim": self.optimizer.sharded_state_dict(model_sd)}
        dist_checkpointing.save(state, str(path / "mcore"))
        if self.rank == 0:
            torch.save({"scheduler_step": self.scheduler.step_count}, path / "engine_extra.pt")
        torch.save(self._rng_state(), path / f"rng_rank{self.rank}.pt")
        dist.barrier()

    def load_checkpoint(self, path: str | Path) -> None:
        from megatron.core import dist_checkpointing

        path = Path(path)
        sharded = {"model": self.model.module.sharded_state_dict()}
        sharded["optim"] = self.optimizer.sharded_state_dict(sharded["model"], is_loading=True)
        state = dist_checkpointing.load(sharded, str(path / "mcore"))
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self.scheduler.step_count = int(
            torch.load(path / "engine_extra.pt", weights_only=True)["scheduler_step"]
        )
        self.scheduler.apply()
        rng_file = path / f"rng_rank{self.rank}.pt"
        if rng_file.is_file():
            self._set_rng_state(torch.load(rng_file, weights_only=True))
        dist.barrier()

    def _rng_state(self) -> dict[str, Any]:
        """This rank's generators: torch CPU, CUDA, and megatron's tracked TP/expert CUDA states."""
        from megatron.core import tensor_parallel

        state: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if self._device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state()
            state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
        return state

    def _set_rng_state(self, state: dict[str, Any]) -> None:
        from megatron.core import tensor_parallel

        torch.set_rng_state(state["cpu"])
        if self._device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"])
            tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])

    def model_flops(self, lengths: list[int]) -> float:
        s = self.spec
        params = s.vocab_size * s.hidden * (1 if s.tied else 2) + s.num_layers * (
            s.hidden * (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
            + s.num_heads * s.head_dim * s.hidden
            + 3 * s.hidden * s.ffn_hidden
        )
        return 6.0 * params * sum(lengths) + 6.0 * s.num_layers * s.hidden * sum(n * n for n in lengths)


class _LambdaSchedule:
    """Learning rate = base * lam(step) on every param group of a Megatron optimizer."""

    def __init__(self, optimizer: Any, lam: Any, base_lr: float) -> None:
        self.optimizer, self.lam, self.base_lr, self.step_count = optimizer, lam, base_lr, 0
        self.apply()

    def apply(self) -> float:
        lr = self.base_lr * self.lam(self.step_count)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def step(self) -> float:
        self.step_count += 1
        return self.apply()


def _max_over(n: int, group: Any, device: torch.device) -> int:
    t = torch.tensor([n], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def _broadcast_from_stage(
    full: torch.Tensor | None, stage: int, group: Any, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return full
    src = dist.get_global_rank(group, stage)
    meta = torch.zeros(8, dtype=torch.int64, device=device)
    if full is not None:
        meta[0] = full.dim()
        meta[1 : 1 + full.dim()] = torch.tensor(full.shape, device=device)
    dist.broadcast(meta, src, group=group)
    shape = tuple(meta[1 : 1 + int(meta[0])].tolist())
    buf = full.contiguous() if full is not None else torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(buf, src, group=group)
    return buf
