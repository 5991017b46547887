"""The vLLM target's MoE names (rollouter/vllm_moe.py), without vLLM: the specs it builds from a tiny MoE
checkpoint are exactly the HF model's parameters, its fused tensors joined from disk are what transformers
loads, and splitting them back gives the checkpoint's per-expert tensors."""

from __future__ import annotations

import torch

from slipstream.rollouter.vllm_moe import (
    fuse_expert_specs,
    has_per_expert_tensors,
    hf_parameter_names,
    split_fused,
)
from slipstream.rollouter.vllm_weights import _read_checkpoint, checkpoint_specs


def test_moe_specs_are_the_hf_models_and_round_trip_the_checkpoint(tiny_moe_models):
    from transformers import AutoModelForCausalLM

    path = tiny_moe_models["qwen3_moe"]
    disk = checkpoint_specs(path, torch.float32)
    assert has_per_expert_tensors(disk)
    specs, fused = fuse_expert_specs(disk, hf_parameter_names(path))
    hf = dict(AutoModelForCausalLM.from_pretrained(path).named_parameters())
    assert specs == {n: (tuple(p.shape), torch.float32) for n, p in hf.items()}
    assert len(fused) == 4  # gate_up_proj and down_proj of 2 layers

    names = [p for f in fused.values() for e in f.parts for p in e]
    read = _read_checkpoint(path, names)
    for name, f in fused.items():
        joined = f.join(read)
        assert torch.equal(joined, hf[name].detach()), name
        split = dict(split_fused([(name, joined)], fused))
        assert set(split) == {p for e in f.parts for p in e}
        for part, tensor in split.items():
            assert torch.equal(tensor, read[part]), part


def test_dense_and_unbuildable_checkpoints_keep_their_names(tiny_model_path, tiny_moe_models, tmp_path):
    dense = checkpoint_specs(tiny_model_path, torch.float32)
    assert not has_per_expert_tensors(dense)
    assert fuse_expert_specs(dense, hf_parameter_names(tiny_model_path)) == (dense, {})
    moe = checkpoint_specs(tiny_moe_models["olmoe"], torch.float32)
    assert fuse_expert_specs(moe, None) == (moe, {})
    assert hf_parameter_names(tmp_path) is None  # no config: the checkpoint's names are kept
    # a layer missing one expert's tensor stays per-expert
    partial = {n: s for n, s in moe.items() if n != "model.layers.0.mlp.experts.2.up_proj.weight"}
    specs, fused = fuse_expert_specs(partial, hf_parameter_names(tiny_moe_models["olmoe"]))
    assert "model.layers.0.mlp.experts.gate_up_proj" not in fused
    assert (
        "model.layers.0.mlp.experts.down_proj" in fused and "model.layers.1.mlp.experts.gate_up_proj" in fused
    )
    assert "model.layers.0.mlp.experts.2.gate_proj.weight" in specs
