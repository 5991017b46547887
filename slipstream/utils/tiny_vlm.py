"""A tiny, random-initialised Qwen2-VL checkpoint for tests and measurements: nothing is downloaded.

:func:`make_tiny_qwen2_vl` writes an HF checkpoint directory that transformers and vLLM load as a Qwen2-VL
model: config (text and vision towers a few layers deep), safetensors weights, the byte-level tokenizer of
:mod:`slipstream.utils.tiny_models` with Qwen2-VL's vision tokens added, and the image processor's config as
Qwen's checkpoints write it (``preprocessor_config.json``).

The chat template is ChatML; a ``<image>`` in a message's text (verl's placeholder) and an ``{"type":
"image"}`` content part both render as ``<|vision_start|><|image_pad|><|vision_end|>``, one image pad per
image, which the processor (or a server) expands to one pad per merged patch.

Worked example::

    path = make_tiny_qwen2_vl(tmp_path / "vlm")
    processor = AutoProcessor.from_pretrained(path)  # without torchvision: after rollouter.vllm_vision.install()
    ids = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": "<image>How many shapes?"}], add_generation_prompt=True)
"""

from __future__ import annotations

import json
from pathlib import Path

from slipstream.utils.tiny_models import SPECIAL_TOKENS, make_tiny_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE_SLOT = "<|vision_start|><|image_pad|><|vision_end|>"

# ChatML; string content has verl's `<image>` replaced, list content renders text and image parts in order.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] | replace('<image>', '" + IMAGE_SLOT + "') }}"
    "{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}" + IMAGE_SLOT + ""
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_qwen2_vl(
    path: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    vision_depth: int = 2,
    vision_embed_dim: int = 32,
    max_position_embeddings: int = 4096,
    min_pixels: int = 56 * 56,
    max_pixels: int = 224 * 224,
    seed: int = 0,
) -> Path:
    """Write a random Qwen2-VL (text heads ``hidden_size / num_heads`` wide) to ``path``; return the path.

    ``min_pixels``/``max_pixels`` bound the image processor's resize, so an image costs at most
    ``max_pixels / 28**2`` image tokens (64 by default).
    """
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tiny_tokenizer(path)
    tok.add_special_tokens({"additional_special_tokens": [*SPECIAL_TOKENS[1:], *VISION_TOKENS]})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(path))
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    head_dim = hidden_size // num_heads
    # Multi-modal rotary sections (temporal, height, width) share head_dim / 2 frequencies, as 16, 24, 24 of
    # Qwen2-VL's 64.
    half = head_dim // 2
    hw = half * 3 // 8
    mrope = [half - 2 * hw, hw, hw]
    text = {
        "vocab_size": len(tok),
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope},
        "bos_token_id": None,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "tie_word_embeddings": False,
    }
    vision = {
        "depth": vision_depth,
        "embed_dim": vision_embed_dim,
        "hidden_size": hidden_size,
        "num_heads": 2,
        "mlp_ratio": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(str(path))
    _write_processor(path, min_pixels, max_pixels)
    return path


def _write_processor(path: Path, min_pixels: int, max_pixels: int) -> None:
    # As Qwen's own checkpoints write it: the torchvision-backed class's name (transformers falls back to the
    # PIL one, Qwen2VLImageProcessorPil, where torchvision is missing).
    image = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "rescale_factor": 1 / 255,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(image, indent=1))
