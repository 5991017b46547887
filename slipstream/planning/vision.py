"""The vision tower of a Qwen2-VL / Qwen2.5-VL model in the memory plan: its parameters, its activations per
image and the tokens an image becomes.

The tower (transformers' ``Qwen2VisionTransformerPretrainedModel`` / ``Qwen2_5_VisionTransformerPretrainedModel``)
cuts an image into ``patch x patch`` pixel squares (``temporal_patch`` frames deep: a still image is repeated),
embeds each with a bias-free 3D convolution, runs them through ``depth`` blocks of ``hidden`` width (attention
with q/k/v and output biases, then an MLP: Qwen2-VL's ``fc1``/``fc2`` of ``hidden * mlp_ratio``, Qwen2.5-VL's
gated ``gate``/``up``/``down`` of ``intermediate_size``, all with biases), and its merger folds each
``merge x merge`` patches into one token of the language model's width (``out_hidden``). So an image resized to
``H x W`` pixels adds ``(H / patch) * (W / patch) / merge**2`` tokens to its sequence and the tower computes
``merge**2`` patches per token.

How large an image gets is the model's image processor's ``max_pixels`` (``preprocessor_config.json``, which the
rollouter and the trainer resize with too, ``agents/multimodal.py``); a prompt holding an image is still at most
``data.max_prompt_tokens`` long, since the rollouter skips longer prompts, image tokens counted.

The two config layouts are read: Qwen2-VL names the tower's width ``embed_dim`` and its output ``hidden_size``,
Qwen2.5-VL names them ``hidden_size`` and ``out_hidden_size``; published checkpoints spell ``in_channels``
``in_chans``. ``tests/planning`` checks the count against the transformers model built on the meta device and
the activation bytes against what autograd's saved-tensor hooks list on a small tower.

Worked example (Qwen2.5-VL-7B's tower)::

    tower = vision_shape_from_hf(config["vision_config"], max_pixels=12845056)
    tower.params                                  # 676,550,144 (0.68B)
    tower.image_tokens                            # 16,384: 3584 x 3584 pixels / 28**2
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slipstream.agents.multimodal import ImageTokens

# A model without a preprocessor config is planned with transformers' Qwen2-VL image processor default
# (28 x 28 x 1280 pixels, 1,280 tokens), which the rollouter counts prompts with too.
DEFAULT_MAX_PIXELS = ImageTokens().max_pixels


@dataclass(frozen=True)
class VisionShape:
    depth: int
    hidden: int
    intermediate: int  # the MLP's width
    heads: int
    patch: int
    merge: int  # spatial_merge_size: merge x merge patches make one token
    temporal_patch: int
    in_channels: int
    out_hidden: int  # the language model's width, the merger's output
    gated: bool  # Qwen2.5-VL: gate/up/down projections and RMSNorms; Qwen2-VL: fc1/fc2 and LayerNorms
    max_pixels: int = DEFAULT_MAX_PIXELS  # the image processor's largest resize

    @property
    def block_params(self) -> int:
        """One vision block: two norms, q/k/v and output projections and the MLP, with their biases."""
        norms = 2 * self.hidden * (1 if self.gated else 2)  # RMSNorm: a weight; LayerNorm: weight and bias
        attention = 3 * self.hidden * (self.hidden + 1) + self.hidden * (self.hidden + 1)
        projections = 3 if self.gated else 2
        mlp = (
            projections * self.hidden * self.intermediate
            + (projections - 1) * self.intermediate
            + self.hidden
        )
        return norms + attention + mlp

    @property
    def root_params(self) -> int:
        """The patch embedding and the merger: outside the blocks, so in FSDP2's root module."""
        patch_embed = self.in_channels * self.temporal_patch * self.patch * self.patch * self.hidden
        merged = self.hidden * self.merge**2
        norm = self.hidden * (1 if self.gated else 2)
        return patch_embed + norm + merged * (merged + 1) + self.out_hidden * (merged + 1)

    @property
    def params(self) -> int:
        return self.depth * self.block_params + self.root_params

    @property
    def image_tokens(self) -> int:
        """Tokens the largest image adds to its sequence: ``max_pixels / (patch * merge)**2``."""
        return self.max_pixels // (self.patch * self.merge) ** 2

    @property
    def pixel_values_per_patch(self) -> int:
        return self.in_channels * self.temporal_patch * self.patch * self.patch

    def block_bytes_per_patch(self, compute: int) -> int:
        """Bytes one patch saves for backward in one block, as autograd's saved-tensor hooks list them on
        Qwen2.5-VL's block: per norm its fp32 input, the normalised product and its output (as the text
        layers); q/k/v, the rotated q and k, the attention's output and its contiguous copy (the output
        projection's input); the MLP's four intermediate-wide tensors; the attention's fp32 log-sum-exp per
        head and 8 bytes of indexing."""
        norms = 2 * (4 + 2 * compute) * self.hidden
        return norms + compute * (7 * self.hidden + 4 * self.intermediate) + 4 * self.heads + 8

    def outside_bytes_per_patch(self, compute: int) -> int:
        """Bytes saved outside the blocks per patch: the pixel values (the convolution's input), the rotary
        cos and sin (fp32, one head wide), the merger's norm and its GELU's input and output."""
        head_dim = self.hidden // self.heads
        rest = (4 + 2 * compute) * self.hidden + 2 * compute * self.hidden + 8 * head_dim + 8
        return compute * self.pixel_values_per_patch + rest

    def activation_bytes(self, patches: int, compute: int, checkpointing: bool, frozen: bool) -> int:
        """A micro-batch's tower activations over ``patches`` patches. Trained, every block's saved tensors
        (with checkpointing, as the text layers: one hidden state per block, one block recomputed and its
        MLP-wide gradients); frozen, autograd saves nothing in the tower (no parameter and no input needs a
        gradient), so one block's working set while it runs and the merged output the text model takes."""
        block = patches * self.block_bytes_per_patch(compute)
        if frozen:
            return block + patches // self.merge**2 * self.out_hidden * compute
        outside = patches * self.outside_bytes_per_patch(compute)
        if checkpointing:
            kept = self.depth * patches * self.hidden * compute
            return kept + block + 2 * patches * self.intermediate * compute + outside
        return self.depth * block + outside


# The towers the plan counts, by the checkpoint's model_type: whether its MLP is gated (module docstring).
TOWERS = {"qwen2_vl": False, "qwen2_5_vl": True}


def vision_shape_from_hf(
    vision: dict[str, Any], max_pixels: int | None = None, model_type: str | None = None
) -> VisionShape:
    """The tower of a config's ``vision_config`` block (either layout: module docstring); ``model_type`` is
    the checkpoint's (without one, the layout is told by Qwen2.5-VL's keys). Another family's tower (its
    blocks built otherwise) is a ValueError naming it, rather than a wrong count."""
    if model_type is not None and model_type not in TOWERS:
        raise ValueError(
            f"model.path: the memory plan counts the vision towers of {', '.join(TOWERS)} models, not "
            f"`{model_type}`"
        )
    gated = TOWERS[model_type] if model_type else "out_hidden_size" in vision
    if gated:
        hidden, out_hidden = vision["hidden_size"], vision["out_hidden_size"]
        intermediate = vision["intermediate_size"]
    else:
        hidden, out_hidden = vision["embed_dim"], vision["hidden_size"]
        intermediate = int(hidden * vision.get("mlp_ratio", 4))
    return VisionShape(
        depth=vision["depth"],
        hidden=hidden,
        intermediate=intermediate,
        heads=vision["num_heads"],
        patch=vision.get("patch_size", 14),
        merge=vision.get("spatial_merge_size", 2),
        temporal_patch=vision.get("temporal_patch_size", 2),
        in_channels=vision.get("in_channels") or vision.get("in_chans") or 3,
        out_hidden=out_hidden,
        gated=gated,
        max_pixels=max_pixels or DEFAULT_MAX_PIXELS,
    )


def image_tokens_per_sequence(tower: VisionShape, max_prompt_tokens: int) -> int:
    """The most image tokens one image brings to a sequence: the processor's largest image, or the prompt's
    whole budget when that is smaller (the rollouter skips a prompt longer than ``data.max_prompt_tokens``)."""
    return max(1, min(tower.image_tokens, max_prompt_tokens))


def micro_batch_patches(
    tower: VisionShape, micro_batch_tokens: int, max_prompt_tokens: int
) -> tuple[int, int]:
    """(images, patches) planned for one trainer micro-batch: as many images of the largest size a prompt
    holds as the micro-batch's tokens have room for (at least one). A bound: a micro-batch also holds the
    responses and the prompts' text, which are no image's."""
    per_image = image_tokens_per_sequence(tower, max_prompt_tokens)
    images = max(1, micro_batch_tokens // per_image)
    return images, images * per_image * tower.merge**2


# The memory plan's items (planning/memory.py), present only for a vision-language model.
TOWER_ACTIVATIONS = "vision tower activations"
VISION_ENCODER = "vision encoder: cache and one batch's forward"


def tower_state(tower: VisionShape | None, frozen: bool, ranks: int) -> dict[str, int]:
    """A trainer rank's share of the tower's state: fp32 weights and AdamW moments, or fp32 weights alone when
    frozen (the optimizer holds the language model only); its gradients, unless frozen, are among the plan's
    sharded gradients."""
    if tower is None:
        return {}
    if frozen:
        return {"sharded vision tower (frozen): parameters": tower.params * 4 // ranks}
    return {"sharded vision tower: parameters, AdamW moments": tower.params * 12 // ranks}


def tower_activations(tower: VisionShape | None, cfg, compute: int, frozen: bool) -> dict[str, int]:
    """The tower's activations over the images of one trainer micro-batch (:func:`micro_batch_patches`). Not
    split over sequence-parallel ranks: a vision-language model trains without sequence parallelism."""
    if tower is None:
        return {}
    t = cfg.trainer
    _, patches = micro_batch_patches(tower, t.micro_batch_tokens, cfg.data.max_prompt_tokens)
    return {TOWER_ACTIVATIONS: tower.activation_bytes(patches, compute, t.activation_checkpointing, frozen)}


def encoder_bytes(
    tower: VisionShape | None, args: dict[str, str], bytes_per_value: int, tp: int, length: int
) -> int:
    """What a server's vision encoder takes beside the weights (the plan's weights count every parameter,
    the tower's too). vLLM sizes its encoder budget, the image tokens it encodes at once and caches, as the
    larger of ``--max-num-batched-tokens`` and the largest image a sequence of ``length`` tokens holds, and
    profiles a forward over it at start-up, which the KV cache gives up. Counted: that many tokens' cached
    embeddings and one block's tensors over their patches (split over tensor parallelism), an estimate of the
    profiled peak."""
    if tower is None:
        return 0
    tokens = max(int(args.get("--max-num-batched-tokens") or 0), min(tower.image_tokens, length))
    cache = tokens * tower.out_hidden * bytes_per_value
    return cache + tokens * tower.merge**2 * tower.block_bytes_per_patch(bytes_per_value) // tp


def plan_fields(tower: VisionShape | None, cfg) -> dict[str, int]:
    """The plan's vision figures: the tower's parameters, the tokens of the largest image a prompt holds
    and the images planned per trainer micro-batch."""
    if tower is None:
        return {}
    max_prompt = cfg.data.max_prompt_tokens
    images, _ = micro_batch_patches(tower, cfg.trainer.micro_batch_tokens, max_prompt)
    return {
        "vision_params": tower.params,
        "image_tokens": image_tokens_per_sequence(tower, max_prompt),
        "images_per_micro_batch": images,
    }
