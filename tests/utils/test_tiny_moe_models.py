"""The tiny MoE checkpoints load as the family's HF model, every layer sparse, experts fused in memory and
one tensor per expert on disk, and the same seed writes the same weights."""

from __future__ import annotations

import json

import pytest
import torch

from slipstream.utils.tiny_models import MOE_FAMILIES, make_tiny_moe_model


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_tiny_moe_checkpoint_loads_sparse_and_seeded(tiny_moe_models, tmp_path, family):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_moe_models[family]
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == family
    assert model.config.num_experts == 4 and model.config.num_experts_per_tok == 2
    assert model.config.hidden_size // model.config.num_attention_heads == 64
    names = dict(model.named_parameters())
    for layer in range(model.config.num_hidden_layers):
        assert names[f"model.layers.{layer}.mlp.experts.gate_up_proj"].shape == (4, 64, 128)
        assert names[f"model.layers.{layer}.mlp.experts.down_proj"].shape == (4, 128, 32)
        assert names[f"model.layers.{layer}.mlp.gate.weight"].shape == (4, 128)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in f.keys()
    assert json.loads((path / "slipstream_tiny.json").read_text())["kind"] == f"tiny-{family}"
    assert AutoTokenizer.from_pretrained(path).eos_token == "<|im_end|>"

    again = AutoModelForCausalLM.from_pretrained(make_tiny_moe_model(tmp_path / "again", family))
    for name, tensor in again.named_parameters():
        assert torch.equal(tensor, names[name]), name


def test_unknown_family_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown MoE family 'deepseek'"):
        make_tiny_moe_model(tmp_path, "deepseek")
