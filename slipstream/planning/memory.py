"""`slipstream plan memory CONFIG [key=value ...] [--gpu-mem GiB] [--json]`: will the run fit its GPUs?

An estimate, per trainer GPU and per inference-server GPU, of what a config asks for, and whether a response
of the configured length fits the model's positions, made before anything launches (no weights are read:
the shapes come from the checkpoint's ``config.json`` or, for the models the shipped recipes name, from a
table). It fails naming the key to change.

Trainer GPU, FSDP2 over ``trainer.num_ranks`` (fp32 master weights, bf16 compute with mixed precision):

* sharded state: parameters and AdamW's two moments, ``P * 12 / ranks`` bytes, and fp32 gradients,
  ``P * 4 / ranks``, which exist from the end of backward to the optimizer step (with the root module's
  gradients, while the activations and logits are gone: the larger of the two phases counts);
* gathered layers: the layer being computed and the next one prefetched, in the compute dtype, plus that
  layer's unsharded fp32 gradient before it is reduced;
* the root module (embeddings, output layer, final norm), which FSDP2 keeps unsharded from its forward to
  the end of backward, and its unsharded gradients (compute dtype, plus the fp32 copy the reduce-scatter
  takes under mixed precision);
* activations of one micro-batch of ``trainer.micro_batch_tokens`` tokens (divided by
  ``trainer.sequence_parallel_size`` when set): every layer's saved tensors, or with
  ``trainer.activation_checkpointing`` one hidden state per layer plus one layer recomputed and its
  backward's MLP-wide gradients;
* logits: fp32 logits and softmax of ``chunk x vocab`` (and the compute-dtype matmul output), where ``chunk`` is ``trainer.logits_chunk_tokens`` when the
  trainer computes logprobs by chunks, else the micro-batch, the scored hidden states and the output
  weight's fp32 gradient accumulator;
* with ``trainer.algorithm.kl_reference: reference``, the frozen reference's sharded fp32 weights;
* a fixed reserve for the CUDA context, kernels' workspaces and allocator fragmentation.

Trainer GPU, Megatron (``trainer.engine: megatron``): its own formulas (:func:`megatron_trainer_gpu`):
the largest pipeline stage's ``tp``-shard of parameters, fp32 gradient buffers, the distributed
optimizer's state over the data-parallel ranks, activations split over TP and held for ``pp`` micro-batches.

Inference GPU: vLLM/SGLang take ``--gpu-memory-utilization`` of the GPU (weights over
``--tensor-parallel-size``, then KV cache), counted in full-length sequences (prompt + response); fewer than
one and they refuse to start. The embedded server takes its weights, ``rollout.embedded.kv_cache_tokens``
of KV cache and the reserve. With ``cluster.colocate`` a trainer rank and a server share one GPU: the
trainer is planned against what the server leaves, not the whole GPU.

Per-token activation bytes are the tensors a Llama/Qwen decoder layer saves for backward with an attention
kernel that keeps no score matrix (flash / SDPA varlen), as autograd's saved-tensor hooks list them;
MoE layers count the experts a token is routed to. For an MoE model the plan also reports the parameters a
token runs through (``active_params``) and the routed experts' share (``expert_params``); the experts'
weights, gradients and AdamW moments are all held (sharded like the rest: FSDP2 shards the fused expert
tensors by expert), so a trainer GPU's state follows the total count, its activations the active one, and a
server's weights the total. ``tests/planning`` checks the per-layer count against
those hooks and the whole estimate against a measured CPU step (within 1.2x).

Vision-language models (Qwen2-VL, Qwen2.5-VL: a ``vision_config`` block, ``planning/vision.py``): the tower's
parameters are among the weights everywhere (a server holds them too) and, on a trainer GPU, sharded with their
AdamW moments and gradients as the rest, or as fp32 weights alone with ``trainer.freeze_vision_tower``; its patch
embedding and merger join FSDP2's unsharded root module. A micro-batch is planned holding as many of the largest
images a prompt takes (the image processor's ``max_pixels``, at most ``data.max_prompt_tokens`` tokens) as its
tokens have room for, and the tower's activations over their patches (``merge**2`` per image token) sit beside
the text layers'. A vLLM server also gives its encoder's cache and profiled forward out of the KV cache.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from slipstream.agents.multimodal import ImageTokens
from slipstream.cli_args import (
    JSON_OBJECT,
    add_config_positionals,
    add_json_flag,
    command_parser,
    doc_paragraph,
)
from slipstream.planning.vision import (
    TOWER_ACTIVATIONS,
    VISION_ENCODER,
    VisionShape,
    encoder_bytes,
    plan_fields,
    tower_activations,
    tower_state,
    vision_shape_from_hf,
)
from slipstream.serverkinds import server_kind
from slipstream.utils.tensors import dtype_bytes

GIB = 1 << 30
RESERVE_BYTES = int(2.5 * GIB)  # CUDA context, cuBLAS/NCCL workspaces, allocator fragmentation


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    max_positions: int
    experts: int = 0  # MoE: routed experts per layer (0: dense MLP)
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # MoE: an always-active shared expert's width (Qwen2-MoE), 0: none
    dense_layers: int = 0  # MoE: layers whose MLP is dense, `intermediate` wide (Qwen3-MoE's mlp_only_layers)
    vision: VisionShape | None = None  # a vision-language model's tower (planning/vision.py)

    @property
    def layer_params(self) -> int:
        """One decoder layer's parameters; an MoE's sparse layer (its largest)."""
        if not self.experts:
            return self._dense_layer_params
        mlp = self.experts * 3 * self.hidden * self.expert_intermediate + self.hidden * self.experts
        if self.shared_intermediate:
            mlp += 3 * self.hidden * self.shared_intermediate + self.hidden  # and its sigmoid gate
        return self._attn_params + mlp + 2 * self.hidden

    @property
    def _attn_params(self) -> int:
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    @property
    def _dense_layer_params(self) -> int:
        return self._attn_params + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def params(self) -> int:
        """Every parameter: the language model's and a vision tower's."""
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        sparse = self.layers - self.dense_layers
        return (
            embeddings
            + sparse * self.layer_params
            + self.dense_layers * self._dense_layer_params
            + self.hidden
            + self.vision_params
        )

    @property
    def vision_params(self) -> int:
        """The vision tower's share of :attr:`params`; 0 for a text model."""
        return self.vision.params if self.vision else 0

    @property
    def expert_params(self) -> int:
        """The routed experts' weights of every sparse layer (gate, up and down projections; not the routers
        nor a shared expert): the share of :attr:`params` a token mostly does not run through. 0 for a
        dense model."""
        return (self.layers - self.dense_layers) * self.experts * 3 * self.hidden * self.expert_intermediate

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: :attr:`params` less the experts it is not routed to (the
        ``3B`` of Qwen3-30B-A3B); :attr:`params` for a dense model."""
        if not self.experts:
            return self.params
        return self.params - self.expert_params * (self.experts - self.experts_per_token) // self.experts

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers (and vision blocks): embeddings, output layer (unless tied),
        final norm, and a vision tower's patch embedding and merger."""
        tower = self.vision.root_params if self.vision else 0
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden + tower

    def activation_bytes_per_token_layer(self, compute: int) -> int:
        """Bytes one token saves for backward in one decoder layer, as listed by autograd's saved-tensor
        hooks on a Llama/Qwen layer (``tests/planning``): per RMSNorm its input in fp32 (HF norms upcast),
        the normalised product cast back to the compute dtype and its output; q, k, v and the attention output, which is
        also the output projection's input (a view, with flash / SDPA kernels); the MLP's gate, up, activation and product (MoE: per routed expert, plus
        the router's logits)."""
        norms = 2 * (4 + 2 * compute) * self.hidden
        attn = self.head_dim * (2 * self.heads + 2 * self.kv_heads) + self.heads
        if self.experts:
            mlp = (
                4 * (self.experts_per_token * self.expert_intermediate + self.shared_intermediate)
                + self.experts
            )
        else:
            mlp = 4 * self.intermediate
        return norms + compute * (attn + mlp)


# Shapes of the models the shipped recipes name (their config.json), so a plan needs no checkpoint.
KNOWN: dict[str, ModelShape] = {
    "Qwen2.5-Math-7B": ModelShape(3584, 28, 28, 4, 128, 18944, 152064, False, 4096),
    "Qwen2.5-7B": ModelShape(3584, 28, 28, 4, 128, 18944, 152064, False, 32768),
    "Qwen3-30B-A3B": ModelShape(2048, 48, 32, 4, 128, 6144, 151936, False, 40960, 128, 8, 768),
}
KNOWN["Qwen3-30B-A3B-Base"] = KNOWN["Qwen3-30B-A3B"]
# Qwen2.5-VL-7B-Instruct: config.json's text and vision_config blocks, and its preprocessor's max_pixels
KNOWN["Qwen2.5-VL-7B-Instruct"] = ModelShape(
    3584, 28, 28, 4, 128, 18944, 152064, False, 128000,
    vision=VisionShape(32, 1280, 3420, 16, 14, 2, 2, 3, 3584, gated=True, max_pixels=12845056),
)  # fmt: skip


def shape_from_hf(config: dict, max_pixels: int | None = None) -> ModelShape:
    """The shape a checkpoint's ``config.json`` describes; a vision-language config's language model may sit
    under ``text_config`` (as transformers writes it) or at the top (as Qwen's published files do), its tower
    under ``vision_config``, whose largest image is ``max_pixels`` (the image processor's)."""
    vision, model_type = config.get("vision_config"), config.get("model_type")
    config = {**config, **(config.get("text_config") or {})}
    heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    experts = config.get("num_experts") or config.get("num_local_experts") or 0  # Mixtral: num_local_experts
    return ModelShape(
        hidden=hidden,
        layers=config["num_hidden_layers"],
        heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads,
        intermediate=config.get("intermediate_size", 4 * hidden),
        vocab=config["vocab_size"],
        tied=bool(config.get("tie_word_embeddings", False)),
        max_positions=config.get("max_position_embeddings", 0),
        experts=experts,
        experts_per_token=(config.get("num_experts_per_tok") or 0) if experts else 0,
        # Qwen3-MoE names the experts' width moe_intermediate_size; OLMoE and Mixtral use intermediate_size
        expert_intermediate=(config.get("moe_intermediate_size") or config.get("intermediate_size", 0))
        if experts
        else 0,
        shared_intermediate=(config.get("shared_expert_intermediate_size") or 0) if experts else 0,
        dense_layers=_dense_layers(config) if experts else 0,
        vision=vision_shape_from_hf(vision, max_pixels, model_type) if vision else None,
    )


def _dense_layers(config: dict) -> int:
    """Layers of an MoE config whose MLP is dense: Qwen-MoE's ``mlp_only_layers`` and the layers
    ``decoder_sparse_step`` skips (layer i is sparse when (i + 1) % step == 0), as transformers builds them."""
    only = set(config.get("mlp_only_layers") or [])
    step = config.get("decoder_sparse_step") or 1
    layers = config["num_hidden_layers"]
    return sum(1 for i in range(layers) if i in only or (i + 1) % step != 0)


def model_shape(path: str) -> ModelShape:
    """From ``path/config.json`` when it is here, else the table of known models; ValueError otherwise."""
    local = Path(path).expanduser() / "config.json"
    if local.is_file():
        processor = ImageTokens.from_model(local.parent)
        try:
            return shape_from_hf(json.loads(local.read_text()), processor.max_pixels if processor else None)
        except KeyError as err:
            raise ValueError(
                f"model.path: {local} has no {err} (not a decoder config the planner reads)"
            ) from err
    from slipstream.rollouter.models import KNOWN_MODELS, resolve_model_path

    if path in KNOWN_MODELS:
        return shape_from_hf(json.loads((Path(resolve_model_path(path)) / "config.json").read_text()))
    name = Path(path).name
    if name in KNOWN:
        return KNOWN[name]
    raise ValueError(
        f"model.path: no config.json at {path!r} and {name!r} is not a model whose shape is known "
        f"({', '.join(sorted(KNOWN))}); point model.path at the checkpoint or plan on a node that has it"
    )


@dataclass
class Part:
    """A device's (or process's) memory: named items, of which those in ``phases`` never coexist.

    ``phases`` lists groups of items that peak at different times of a step (a trainer's activations and
    logits during forward and the head's backward; its gradients at the end of backward, when the
    activations are gone): the total counts the largest group, plus every item outside the groups."""

    name: str
    items: dict[str, int]
    limit: int
    phases: tuple[tuple[str, ...], ...] = ()

    @property
    def total(self) -> int:
        grouped = {k for group in self.phases for k in group}
        steady = sum(v for k, v in self.items.items() if k not in grouped)
        return steady + max((sum(self.items[k] for k in group) for group in self.phases), default=0)

    @property
    def fits(self) -> bool:
        return self.total <= self.limit


def _compute_bytes(cfg, on_cpu: bool) -> int:
    t = cfg.trainer
    return 4 if on_cpu else 2 if t.mixed_precision or cfg.model.dtype != "float32" else 4


def _on_cpu(cfg) -> bool:
    t = cfg.trainer
    return t.device == "cpu" or (t.device == "auto" and cfg.cluster.gpus_per_trainer_rank == 0)


def _activations(shape: ModelShape, tokens: int, layers: int, compute: int, checkpointing: bool) -> int:
    per_layer = tokens * shape.activation_bytes_per_token_layer(compute)
    if checkpointing:
        # one hidden state per layer kept; one layer recomputed at a time, and while its backward runs two
        # MLP-wide gradients (of the product and of one projection) are alive beside its saved tensors
        width = shape.experts_per_token * shape.expert_intermediate if shape.experts else shape.intermediate
        return layers * tokens * shape.hidden * compute + per_layer + 2 * tokens * width * compute
    return layers * per_layer


def _logits(chunk: int, vocab: int, hidden: int, tokens: int, compute: int) -> int:
    """The logprob head (trainer/logprobs.py): per chunk of rows, fp32 logits and softmax (the gradient
    reuses the logits' buffer) and, in a lower compute dtype, the matmul's output before the upcast; the
    scored rows' hidden states; the output weight's fp32 gradient accumulator."""
    block = 8 + (compute if compute != 4 else 0)
    return min(chunk, tokens) * vocab * block + tokens * hidden * compute + vocab * hidden * 4


def trainer_gpu(shape: ModelShape, cfg, gpu_bytes: int) -> Part:
    """One trainer rank's device (a CPU trainer is planned against this machine's memory, no reserve)."""
    if cfg.trainer.engine == "megatron":
        return megatron_trainer_gpu(shape, cfg, gpu_bytes)
    t = cfg.trainer
    on_cpu = _on_cpu(cfg)
    ranks = t.num_ranks
    compute = _compute_bytes(cfg, on_cpu)
    sp = max(1, getattr(t, "sequence_parallel_size", 1))
    tokens = -(-t.micro_batch_tokens // sp)
    chunk = getattr(t, "logits_chunk_tokens", 0) or tokens
    root = shape.root_params
    frozen = shape.vision is not None and t.freeze_vision_tower
    untrained, untrained_root = (shape.vision_params, shape.vision.root_params) if frozen else (0, 0)
    layer = max(shape.layer_params, shape.vision.block_params if shape.vision else 0)
    text_dense = shape.params - shape.expert_params - shape.vision_params
    # FSDP2 keeps the root module (embeddings, output layer, final norm) unsharded from its forward to the
    # end of backward; its gradients exist unsharded in the compute dtype and, under mixed precision, in
    # the fp32 reduce dtype before the reduce-scatter
    return Part(
        "trainer process (CPU)" if on_cpu else "trainer GPU",
        {
            "sharded parameters, AdamW moments": text_dense * 12 // ranks,
            # MoE: every expert is trained (each takes the tokens routed to it), so all of them carry
            # fp32 weights and both moments, although a token runs through experts_per_token of them
            "sharded experts: parameters, AdamW moments": shape.expert_params * 12 // ranks,
            **tower_state(shape.vision, frozen, ranks),
            "sharded gradients": (shape.params - untrained) * 4 // ranks,
            "gathered layers": layer * (2 * compute + 4),
            "unsharded root module (embeddings, output layer)": root * compute,
            "root module gradients": (root - untrained_root) * (compute + (4 if compute != 4 else 0)),
            "activations": _activations(shape, tokens, shape.layers, compute, t.activation_checkpointing),
            **tower_activations(shape.vision, cfg, compute, frozen),
            "logits": _logits(chunk, shape.vocab, shape.hidden, tokens, compute),
            "frozen reference model": shape.params * 4 // ranks
            if t.algorithm.kl_reference == "reference"
            else 0,
            "reserve": 0 if on_cpu else RESERVE_BYTES,
        },
        _machine_memory() if on_cpu else gpu_bytes,
        phases=(
            ("activations", *([TOWER_ACTIVATIONS] if shape.vision else []), "logits"),
            ("root module gradients", "sharded gradients"),
        ),
    )


def megatron_trainer_gpu(shape: ModelShape, cfg, gpu_bytes: int) -> Part:
    """One Megatron rank (trainer/engine/megatron.py): the model split over ``tp x pp``, parameters in the
    compute dtype, fp32 gradient buffers (``grad_reduce_in_fp32``), the distributed optimizer's fp32 master
    weights and Adam moments sharded over the data-parallel ranks. Activations are split over TP (sequence
    parallelism); the first pipeline stage holds up to ``pp`` micro-batches in flight under 1F1B. The
    largest stage is planned: ``layers / pp`` layers plus one vocabulary matrix (the embedding, or the output
    layer; both when ``pp = 1`` and untied)."""
    t = cfg.trainer
    on_cpu = _on_cpu(cfg)
    compute = _compute_bytes(cfg, on_cpu)
    tp, pp = t.tensor_parallel, t.pipeline_parallel
    dp = max(1, t.num_ranks // (tp * pp))
    layers = -(-shape.layers // pp)
    vocab_mats = 2 if pp == 1 and not shape.tied else 1
    stage = (layers * shape.layer_params + vocab_mats * shape.vocab * shape.hidden) // tp
    tokens = -(-t.micro_batch_tokens // tp)
    in_flight = pp  # 1F1B: the first stage holds pp micro-batches' activations at its peak
    chunk = getattr(t, "logits_chunk_tokens", 0) or t.micro_batch_tokens
    master = 0 if compute == 4 else 4
    acts = _activations(shape, t.micro_batch_tokens, layers, compute, t.activation_checkpointing) // tp
    return Part(
        "trainer process (CPU)" if on_cpu else "trainer GPU",
        {
            "parameters (tp x pp shard)": stage * compute,
            "fp32 gradient buffer": stage * 4,
            "distributed optimizer (fp32 master, Adam moments)": stage * (master + 8) // dp,
            "activations": acts * in_flight,
            "logits": _logits(chunk, -(-shape.vocab // tp), shape.hidden, tokens * tp, compute),
            "reserve": 0 if on_cpu else RESERVE_BYTES,
        },
        _machine_memory() if on_cpu else gpu_bytes,
    )


def _machine_memory() -> int:
    import psutil

    return psutil.virtual_memory().total


def server_args(cfg) -> dict[str, str]:
    args = {}
    for arg in cfg.rollout.server_args:
        key, _, value = arg.partition("=")
        args[key] = value
    return args


def inference_gpu(shape: ModelShape, cfg, gpu_bytes: int, served: str) -> tuple[Part, float]:
    """The server GPU's weights and KV budget, and how many full-length sequences that budget holds.

    vLLM and SGLang take ``--gpu-memory-utilization`` (``--mem-fraction-static``) of the whole GPU and fill
    what their weights leave with KV cache; the embedded server takes its weights, a KV cache of
    ``rollout.embedded.kv_cache_tokens`` tokens and the reserve (which one: the kind's ``kv_cache_tokens``)."""
    args = server_args(cfg)
    own_tokens = server_kind(cfg.rollout.backend).kv_cache_tokens  # None: it takes a share of the GPU
    own = own_tokens is not None
    tp = 1 if own else int(args.get("--tensor-parallel-size") or args.get("--tp-size") or 1)
    bytes_per_value = dtype_bytes(served)
    weights = shape.params * bytes_per_value // tp
    kv_heads_per_gpu = max(1, shape.kv_heads // tp)
    per_token = 2 * shape.layers * kv_heads_per_gpu * shape.head_dim * bytes_per_value
    length = cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_new_tokens
    encoder = encoder_bytes(shape.vision, args, bytes_per_value, tp, length)
    if own_tokens is not None:
        kv_budget = own_tokens(cfg.rollout) * per_token
        budget = weights + RESERVE_BYTES + encoder + kv_budget
    else:
        util = float(args.get("--gpu-memory-utilization") or args.get("--mem-fraction-static") or 0.9)
        budget = int(gpu_bytes * util)
        kv_budget = budget - weights - RESERVE_BYTES - encoder
    sequences = kv_budget / (per_token * length) if kv_budget > 0 else 0.0
    items = {"weights": weights, "reserve": RESERVE_BYTES, "KV cache": max(kv_budget, 0)}
    if shape.vision is not None:
        items = {"weights": weights, VISION_ENCODER: encoder, **items}
    return Part("inference GPU", items, budget if not own else gpu_bytes), sequences


@dataclass
class Plan:
    model: str
    params: int
    positions_needed: int
    max_positions: int
    trainer: Part
    inference: Part | None
    full_length_sequences_per_server: float | None
    active_params: int = 0  # MoE: parameters a token runs through; params for a dense model
    expert_params: int = 0  # MoE: the routed experts' share of params; 0 for a dense model
    vision_params: int = 0  # vision-language: the tower's share of params; 0 for a text model
    image_tokens: int = 0  # vision-language: tokens of the largest image a prompt holds
    images_per_micro_batch: int = 0  # vision-language: images planned in a trainer micro-batch

    @property
    def problems(self) -> list[str]:
        out = []
        if self.max_positions and self.positions_needed > self.max_positions:
            out.append(
                f"data.max_prompt_tokens + rollout.sampling.max_new_tokens = {self.positions_needed} exceeds the "
                f"model's {self.max_positions} positions: lower them or raise rollout.max_position_embeddings"
            )
        if not self.trainer.fits:
            out.append(
                f"{self.trainer.name} needs {self.trainer.total / GIB:.1f} GiB of {self.trainer.limit / GIB:.1f}: "
                f"lower trainer.micro_batch_tokens, turn on trainer.activation_checkpointing, or raise "
                f"trainer.num_ranks (largest item: {max(self.trainer.items, key=self.trainer.items.get)})"
            )
        if self.inference is not None and not self.inference.fits:
            out.append(
                f"{self.inference.name} needs {self.inference.total / GIB:.1f} GiB of "
                f"{self.inference.limit / GIB:.1f} left to it: lower rollout.embedded.kv_cache_tokens or "
                f"--gpu-memory-utilization in rollout.server_args, or turn cluster.colocate off"
            )
        if self.full_length_sequences_per_server is not None and self.full_length_sequences_per_server < 1:
            out.append(
                "inference GPU: the KV cache left after the weights holds no full-length sequence: raise "
                "--tensor-parallel-size or --gpu-memory-utilization in rollout.server_args, or shorten "
                "rollout.sampling.max_new_tokens"
            )
        return out

    def to_dict(self) -> dict:
        def part(p: Part | None):
            return None if p is None else {"items_gib": {k: round(v / GIB, 2) for k, v in p.items.items()},
                                           "total_gib": round(p.total / GIB, 2), "limit_gib": round(p.limit / GIB, 2),
                                           "fits": p.fits}  # fmt: skip

        return {
            "model": self.model,
            "params": self.params,
            "active_params": self.active_params,
            "expert_params": self.expert_params,
            "positions_needed": self.positions_needed,
            "max_positions": self.max_positions,
            "trainer_gpu": part(self.trainer),
            "inference_gpu": part(self.inference),
            "full_length_sequences_per_server": None
            if self.full_length_sequences_per_server is None
            else round(self.full_length_sequences_per_server, 2),
            "fits": not self.problems,
            "problems": self.problems,
            **(self._vision_dict() if self.vision_params else {}),
        }

    def _vision_dict(self) -> dict:
        return {"vision": {"params": self.vision_params, "image_tokens": self.image_tokens,
                           "images_per_micro_batch": self.images_per_micro_batch}}  # fmt: skip


def plan(cfg, gpu_gib: float = 80.0) -> Plan:
    """The memory plan of a loaded config (see the module docstring)."""
    from slipstream.serverkinds import served_dtype

    shape = model_shape(cfg.model.path)
    gpu_bytes = int(gpu_gib * GIB)
    inference, sequences = None, None
    kind = server_kind(cfg.rollout.backend)
    if kind.on_gpu(cfg.rollout):
        inference, sequences = inference_gpu(shape, cfg, gpu_bytes, served_dtype(cfg))
    limit = cfg.rollout.max_position_embeddings or shape.max_positions
    trainer = trainer_gpu(shape, cfg, gpu_bytes)
    if cfg.cluster.colocate and inference is not None:
        # one GPU, two processes: the trainer gets what the server leaves, the server what it asks for
        server = inference.total if kind.kv_cache_tokens is not None else inference.limit
        trainer.name = "trainer (sharing the GPU with a server)"
        trainer.limit = max(0, gpu_bytes - server)
        inference.name = "inference (sharing the GPU with a trainer rank)"
        inference.limit = min(inference.limit, gpu_bytes - trainer.total)
    return Plan(
        model=cfg.model.path,
        params=shape.params,
        positions_needed=cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_new_tokens,
        max_positions=limit,
        trainer=trainer,
        inference=inference,
        full_length_sequences_per_server=sequences,
        active_params=shape.active_params,
        expert_params=shape.expert_params,
        **plan_fields(shape.vision, cfg),
    )


def render(p: Plan) -> str:
    moe = (f" ({p.active_params / 1e9:.2f}B active per token; routed experts {p.expert_params / 1e9:.2f}B)"
           if p.expert_params else "")  # fmt: skip
    lines = [f"model {p.model}: {p.params / 1e9:.2f}B parameters{moe}; "
             f"{p.positions_needed} positions needed of {p.max_positions or '?'}"]  # fmt: skip
    if p.vision_params:
        lines.append(f"vision tower {p.vision_params / 1e9:.2f}B parameters; an image up to {p.image_tokens} "
                     f"tokens, {p.images_per_micro_batch} such images planned per trainer micro-batch")  # fmt: skip
    for part in (p.trainer, p.inference):
        if part is None:
            continue
        lines.append(f"{part.name}: {part.total / GIB:.1f} GiB of {part.limit / GIB:.1f} "
                     f"({'fits' if part.fits else 'does NOT fit'})")  # fmt: skip
        lines += [f"  {name:50s} {value / GIB:8.2f} GiB" for name, value in part.items.items() if value]
        for group in part.phases:
            lines.append(f"  (phase, the larger one counts: {' + '.join(group)})")
    if p.full_length_sequences_per_server is not None:
        lines.append(f"  full-length sequences the KV cache holds: {p.full_length_sequences_per_server:.1f}")
    lines += [f"problem: {text}" for text in p.problems]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("slipstream plan memory", doc_paragraph(__doc__))
    add_config_positionals(parser)
    # Hand-written: the config comes as CONFIG key=value; the GPU's size is the question asked, no key.
    parser.add_argument("--gpu-mem", type=float, default=80.0, help="GiB of memory per GPU (default 80)")
    add_json_flag(parser, JSON_OBJECT)
    args = parser.parse_args(argv)
    from slipstream.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
        result = plan(cfg, args.gpu_mem)
    except (ConfigError, ValueError) as err:
        print(f"slipstream plan memory: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict()) if args.json else render(result))
    return 0 if not result.problems else 1
