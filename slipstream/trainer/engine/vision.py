"""Image prompts through the FSDP engine: the Qwen2-VL family's vision tower and multi-modal rotary positions.

A packed batch of a vision-language model carries, next to its token tensors, the images of its samples as
the model's forward takes them (the queue carries the encoded images once per group, ``queue/batch.py``;
:func:`attach_pixels` turns them into these with the model's :class:`ImageProcessor`):

* ``pixel_values`` [patches, C x T x P x P]: every image's flattened patches, images in sample order;
* ``image_grid_thw`` [images, 3]: each image's (temporal, height, width) patch grid;
* ``image_counts`` [samples]: how many images each sample has (a per-sample key, so a micro-batch's
  images are cut with its samples, ``trainer/batching.py``).

The prompt tokens hold one ``<|image_pad|>`` per merged patch (``t * h * w / merge**2``), expanded as the
servers expand them; the HF model writes each image's merged patch embeddings over its pads.

Positions: Qwen2-VL rotates queries and keys by three position ids per token (temporal, height, width;
``mrope_section``). Text tokens have all three equal; an image's tokens take their place in the patch grid,
and the text after an image resumes at the largest of them plus one, so a sample's positions are not its
token index. :func:`mrope_positions` computes them per sample with the HF model's own ``get_rope_index`` and
stacks the packed row's restarting text positions in front (``[4, 1, T]``): HF's packed-input convention,
from which its mask builder (and our ``cu_seq_lens`` kernels) see the sample boundaries.

Attention: the text tower runs the engine's kernel (``sdpa_varlen`` on CPU); the vision tower runs plain
``sdpa``, because its attention is bidirectional within each image (HF cuts the image boundaries itself),
where ``sdpa_varlen`` is causal and would read the text's ``cu_seq_lens``.

A *generated* ``<|image_pad|>`` in a response cannot be scored: HF's forward takes every pad as an image
slot and refuses the count. :func:`check_image_pads` names the sample.

Worked example::

    processor = ImageProcessor(model_path)
    inputs = processor([[png_bytes], []])          # sample 0 has one image, sample 1 none
    batch.update(inputs)                            # pixel_values, image_grid_thw, image_counts
    engine.forward_backward_batch(batch, None, forward_only=True)
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import torch

COUNT_KEY = "image_counts"
# The vision tower's module, under the HF names of Qwen2-VL / Qwen2.5-VL (Qwen2VLForConditionalGeneration).
VISION_PREFIX = "model.visual."


# In memory transformers nests the text model under ``model.language_model`` and the tower under
# ``model.visual``; Qwen2-VL / Qwen2.5-VL checkpoints (so the servers' weight names) keep ``model.``, ``visual.``.
_CHECKPOINT_PREFIXES = (("model.language_model.", "model."), (VISION_PREFIX, "visual."))


def checkpoint_name(name: str) -> str:
    """A parameter's name in the checkpoint layout the servers load (``model.language_model.layers.0...`` ->
    ``model.layers.0...``, ``model.visual.blocks.0...`` -> ``visual.blocks.0...``; ``lm_head`` as is)."""
    for memory, disk in _CHECKPOINT_PREFIXES:
        if name.startswith(memory):
            return disk + name[len(memory) :]
    return name


def is_vision_config(config: Any) -> bool:
    """Whether an HF config describes a vision-language model (it has a vision tower's config)."""
    return getattr(config, "vision_config", None) is not None


def attention_kernels(text_kernel: str) -> dict[str, str]:
    """Per sub-model attention for ``from_pretrained``: the engine's kernel for text, sdpa for the vision tower."""
    return {"": text_kernel, "text_config": text_kernel, "vision_config": "sdpa"}


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """Take the vision tower's parameters out of training; returns how many tensors were frozen."""
    frozen = 0
    for name, param in model.named_parameters():
        if name.startswith(VISION_PREFIX):
            param.requires_grad_(False)
            frozen += 1
    if not frozen:
        raise ValueError(f"{type(model).__name__}: no parameter under {VISION_PREFIX!r} to freeze")
    return frozen


def mb_has_images(mb: Any) -> bool:
    return COUNT_KEY in mb.keys() and int(mb[COUNT_KEY].sum()) > 0


def check_image_pads(ids: torch.Tensor, cu: torch.Tensor, prompt_lens: torch.Tensor, pad_id: int) -> None:
    """Raise, naming the sample, if a response holds an image pad (the model cannot score it as text)."""
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        response = ids[start + int(prompt_lens[i]) : end]
        if bool((response == pad_id).any()):
            raise ValueError(
                f"sample {i} of the micro-batch has an image pad token ({pad_id}) in its response: the "
                "vision-language model takes every pad as an image slot, so it cannot be scored"
            )


def mrope_positions(model: torch.nn.Module, mb: Any) -> torch.Tensor:
    """[4, 1, T] positions of a packed micro-batch: the restarting text positions, then (t, h, w) per token."""
    inner = model.model
    pad_id = int(model.config.image_token_id)
    ids, pos, cu = mb["input_ids"].long(), mb["position_ids"].long(), mb["cu_seqlens"].long()
    counts = mb[COUNT_KEY].tolist()
    grids = mb["image_grid_thw"].long()
    pieces, first = [], 0
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        n = int(counts[i])
        if n == 0:
            pieces.append(pos[start:end][None].expand(3, -1))
            continue
        sample = ids[start:end][None]
        types = (sample == pad_id).int()
        three, _ = inner.get_rope_index(sample, types, image_grid_thw=grids[first : first + n])
        pieces.append(three[:, 0].to(pos.dtype))
        first += n
    return torch.cat([pos[None], torch.cat(pieces, dim=1)])[:, None]


def forward_kwargs(model: torch.nn.Module, mb: Any) -> dict[str, torch.Tensor]:
    """What the model's forward takes for ``mb``'s images beyond the tokens: none for a text micro-batch."""
    if not mb_has_images(mb):
        return {}
    if "prompt_lens" in mb.keys():
        check_image_pads(
            mb["input_ids"], mb["cu_seqlens"].long(), mb["prompt_lens"], int(model.config.image_token_id)
        )
    return {
        "position_ids": mrope_positions(model, mb),
        "pixel_values": mb["pixel_values"],
        "image_grid_thw": mb["image_grid_thw"].long(),
    }


RAW_IMAGE_KEYS = ("image_bytes", "image_nbytes", "image_groups")


def attach_pixels(batch: Any, processor: ImageProcessor) -> Any:
    """Replace a collated batch's encoded images (``queue/batch.py``: once per group) with the model's pixel
    inputs, per sample: each group's images are processed once and their pixels given to each of its samples
    (every sample's prompt holds the image pads). Returns ``batch``, changed in place."""
    raw, sizes, owners = (batch[k] for k in RAW_IMAGE_KEYS)
    ends = sizes.cumsum(0).tolist()
    blob = raw.numpy().tobytes()
    per_group: dict[int, list[bytes]] = {}
    for i, (end, owner) in enumerate(zip(ends, owners.tolist(), strict=True)):
        per_group.setdefault(owner, []).append(blob[end - int(sizes[i]) : end])
    processed = {g: processor([images]) for g, images in per_group.items()}
    empty = processor([[]])
    samples = [processed.get(g, empty) for g in batch["group_index"].tolist()]
    batch["pixel_values"] = torch.cat([s["pixel_values"] for s in samples])
    batch["image_grid_thw"] = torch.cat([s["image_grid_thw"] for s in samples])
    batch[COUNT_KEY] = torch.cat([s[COUNT_KEY] for s in samples])
    for key in RAW_IMAGE_KEYS:
        del batch[key]
    return batch


class ImageProcessor:
    """The model's own HF image processor (resize, normalise, patchify) on encoded images.

    Where torchvision is missing transformers loads the processor's PIL twin (``Qwen2VLImageProcessorPil``),
    the one vLLM's CPU build serves with (``rollouter/vllm_vision.py``), so both sides compute the same pixels.
    """

    def __init__(self, model_path: str) -> None:
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(model_path)
        self.merge = int(getattr(self.processor, "merge_size", 2))
        p = self.processor
        self.patch_dim = (
            3 * int(getattr(p, "temporal_patch_size", 2)) * int(getattr(p, "patch_size", 14)) ** 2
        )

    def __call__(self, images: Sequence[Sequence[bytes]]) -> dict[str, torch.Tensor]:
        """Per sample, its encoded images -> ``pixel_values``, ``image_grid_thw``, ``image_counts``."""
        from PIL import Image as PILImage

        decoded = [PILImage.open(io.BytesIO(data)).convert("RGB") for sample in images for data in sample]
        counts = torch.tensor([len(sample) for sample in images], dtype=torch.int32)
        if not decoded:
            return {
                "pixel_values": torch.zeros(0, self.patch_dim),
                "image_grid_thw": torch.zeros(0, 3, dtype=torch.int32),
                COUNT_KEY: counts,
            }
        out = self.processor(images=decoded, return_tensors="pt")
        return {
            "pixel_values": out["pixel_values"].float(),
            "image_grid_thw": out["image_grid_thw"].to(torch.int32),
            COUNT_KEY: counts,
        }

    def tokens_per_image(self, grid_thw: torch.Tensor) -> list[int]:
        """How many image pads each image of ``grid_thw`` takes in the prompt."""
        return (grid_thw.long().prod(-1) // (self.merge * self.merge)).tolist()
