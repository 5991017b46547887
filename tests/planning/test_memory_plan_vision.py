"""The memory plan of vision-language models: the tower's parameters against transformers' own models (Qwen2.5-VL-7B
built on the meta device, a tiny Qwen2-VL checkpoint), its activation bytes against what autograd saves, the
image tokens an image adds, a frozen tower's smaller state, and the servers holding the tower."""

from __future__ import annotations

import json

import pytest

from slipstream.config import load_config
from slipstream.planning.memory import KNOWN, main, model_shape, plan, shape_from_hf
from slipstream.planning.vision import VisionShape, micro_batch_patches, vision_shape_from_hf
from tests.planning.saved_activations import saved_bytes

RECIPE = "configs/recipes/qwen2.5-vl-7b-grpo-geometry-vllm-fsdp.yaml"
TEXT = {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "intermediate_size": 18944, "vocab_size": 152064, "max_position_embeddings": 128000,
        "tie_word_embeddings": False}  # fmt: skip
VISION = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "patch_size": 14,
          "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3, "out_hidden_size": 3584,
          "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]}  # fmt: skip


def _meta_qwen2_5_vl_7b() -> dict:
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION, tie_word_embeddings=False)
    with torch.device("meta"):
        return dict(Qwen2_5_VLForConditionalGeneration(config).named_parameters())


def test_qwen2_5_vl_7b_counts_as_transformers_builds_it_on_the_meta_device():
    named = _meta_qwen2_5_vl_7b()
    tower = sum(p.numel() for n, p in named.items() if n.startswith("model.visual."))
    shape = KNOWN["Qwen2.5-VL-7B-Instruct"]
    assert shape.vision_params == tower == 676_550_144
    # the language model's q/k/v biases (129,024) are the only parameters the plan leaves out
    assert shape.params == pytest.approx(sum(p.numel() for p in named.values()), rel=0.01)
    # flat, as Qwen's published config.json, and nested, as transformers writes it
    assert shape_from_hf({**TEXT, "vision_config": VISION}, max_pixels=12845056) == shape
    assert shape_from_hf({"text_config": TEXT, "vision_config": VISION}, max_pixels=12845056) == shape


def test_a_qwen2_vl_checkpoint_is_read_in_its_own_layout(tmp_path):
    """Qwen2-VL names the tower's width embed_dim and its output hidden_size; LayerNorms and fc1/fc2 have biases."""
    from transformers import AutoModelForImageTextToText

    from slipstream.utils.tiny_vlm import make_tiny_qwen2_vl

    path = make_tiny_qwen2_vl(tmp_path / "vlm", max_pixels=224 * 224)
    shape = model_shape(str(path))
    assert shape.vision is not None and not shape.vision.gated
    assert (shape.vision.hidden, shape.vision.out_hidden, shape.vision.intermediate) == (32, 64, 64)
    assert shape.vision.image_tokens == 64  # the preprocessor's max_pixels: 224 x 224 / 28**2
    named = dict(AutoModelForImageTextToText.from_pretrained(path).named_parameters())
    assert shape.vision_params == sum(p.numel() for n, p in named.items() if n.startswith("model.visual."))
    biases = sum(p.numel() for n, p in named.items() if n.endswith("_proj.bias") and ".language_model." in n)
    assert shape.params == sum(p.numel() for p in named.values()) - biases


def _saved_bytes(dtype, depth: int, grid=(1, 8, 8)) -> int:
    """Bytes of the distinct tensors autograd saves in a forward of a small Qwen2.5-VL tower (parameters aside)."""
    import torch
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    torch.manual_seed(0)
    vision = {**VISION, "depth": depth, "hidden_size": 128, "intermediate_size": 96, "num_heads": 4,
              "out_hidden_size": 64, "window_size": 56, "fullatt_block_indexes": [0]}  # fmt: skip
    config = Qwen2_5_VLConfig(vision_config=vision, text_config={**TEXT, "hidden_size": 64}).vision_config
    config._attn_implementation = "sdpa"
    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(config).to(dtype)
    patches = grid[0] * grid[1] * grid[2]
    pixels = torch.randn(patches, 3 * 2 * 14 * 14, dtype=dtype)
    return saved_bytes(tower, lambda: tower(pixels, grid_thw=torch.tensor([grid])))


@pytest.mark.parametrize("dtype_name, compute", [("float32", 4), ("bfloat16", 2)])
def test_the_towers_activation_bytes_are_what_autograd_saves(dtype_name, compute):
    import torch

    dtype = getattr(torch, dtype_name)
    one, three = _saved_bytes(dtype, 1), _saved_bytes(dtype, 3)
    tower = VisionShape(1, 128, 96, 4, 14, 2, 2, 3, 64, gated=True)
    assert (three - one) / 2 / 64 == tower.block_bytes_per_patch(compute)
    assert one / 64 == tower.block_bytes_per_patch(compute) + tower.outside_bytes_per_patch(compute)
    assert tower.activation_bytes(64, compute, checkpointing=False, frozen=False) == one


def test_an_image_adds_its_merged_patches_as_tokens_capped_by_the_prompt():
    tower = vision_shape_from_hf(VISION, max_pixels=28 * 28 * 1280)
    assert tower.image_tokens == 1280
    # a 16K micro-batch with 1K-token prompts: 16 images of 1,024 tokens, 4 patches per token
    assert micro_batch_patches(tower, 16384, 1024) == (16, 16 * 1024 * 4)
    assert micro_batch_patches(tower, 16384, 4096) == (12, 12 * 1280 * 4)
    assert micro_batch_patches(tower, 512, 4096) == (1, 1280 * 4)  # at least one image


def test_a_frozen_tower_holds_no_moments_gradients_or_saved_activations():
    trained = plan(load_config(RECIPE, []))
    frozen = plan(load_config(RECIPE, ["trainer.freeze_vision_tower=true"]))
    shape, ranks = KNOWN["Qwen2.5-VL-7B-Instruct"], 16
    tower = shape.vision
    state = trained.trainer.items["sharded vision tower: parameters, AdamW moments"]
    assert state == tower.params * 12 // ranks
    assert frozen.trainer.items["sharded vision tower (frozen): parameters"] == tower.params * 4 // ranks
    assert trained.trainer.items["sharded gradients"] == shape.params * 4 // ranks
    assert frozen.trainer.items["sharded gradients"] == (shape.params - tower.params) * 4 // ranks
    # frozen, the tower saves nothing for backward: one block's tensors while it runs and the merged output
    patches = 16 * 1024 * 4
    acts = patches * tower.block_bytes_per_patch(2) + 16 * 1024 * tower.out_hidden * 2
    assert frozen.trainer.items["vision tower activations"] == acts
    assert trained.trainer.items["vision tower activations"] > 2 * acts
    assert frozen.trainer.total < trained.trainer.total


def test_the_servers_hold_the_tower_and_its_encoder(capsys):
    assert main([RECIPE, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    shape = KNOWN["Qwen2.5-VL-7B-Instruct"]
    assert out["vision"] == {
        "params": shape.vision_params,
        "image_tokens": 1024,
        "images_per_micro_batch": 16,
    }
    weights = out["inference_gpu"]["items_gib"]["weights"]
    assert weights == round(shape.params * 2 / 2 / (1 << 30), 2)  # bf16 over TP 2, the tower's included
    assert out["inference_gpu"]["items_gib"]["vision encoder: cache and one batch's forward"] > 0
    main([RECIPE])
    text = capsys.readouterr().out
    assert "vision tower 0.68B parameters; an image up to 1024 tokens" in text


def test_a_text_model_plans_no_vision_item(capsys):
    assert main(["configs/recipes/qwen2.5-7b-dapo-math-64x64.yaml", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "vision" not in out
    assert not [k for k in out["trainer_gpu"]["items_gib"] if "vision" in k]
    assert not [k for k in out["inference_gpu"]["items_gib"] if "vision" in k]


def test_another_familys_tower_is_refused_naming_it_rather_than_miscounted(capsys, tmp_path):
    config = {**TEXT, "model_type": "qwen3_vl", "vision_config": VISION}
    with pytest.raises(ValueError, match="qwen2_vl, qwen2_5_vl models, not `qwen3_vl`"):
        shape_from_hf(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main([RECIPE, f"model.path={tmp_path}"]) == 2
    assert "not `qwen3_vl`" in capsys.readouterr().err
