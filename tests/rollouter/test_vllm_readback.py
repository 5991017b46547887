"""Reading a version back from a model laid out as vLLM lays it out: fused q/k/v and gate/up, a padded
vocabulary, a weight packed away into a kernel, a tensor-parallel shard."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream.rollouter.vllm_readback import read_back

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def checkpoint() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    return {
        "model.embed_tokens.weight": r(10, 8),
        "model.layers.0.self_attn.q_proj.weight": r(8, 8),
        "model.layers.0.self_attn.k_proj.weight": r(4, 8),
        "model.layers.0.self_attn.v_proj.weight": r(4, 8),
        "model.layers.0.mlp.gate_proj.weight": r(6, 8),
        "model.layers.0.mlp.up_proj.weight": r(6, 8),
        "model.layers.0.mlp.down_proj.weight": r(8, 6),
        "model.norm.weight": r(8),
    }


def served(w: dict[str, torch.Tensor]) -> nn.Module:
    """The checkpoint as vLLM serves it: fused projections, the vocabulary padded to 16 rows."""

    def p(t):
        return nn.Parameter(t.clone(), requires_grad=False)

    layer = nn.Module()
    layer.self_attn, layer.mlp = nn.Module(), nn.Module()
    attn = [w[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"]
    layer.self_attn.qkv_proj = nn.Module()
    layer.self_attn.qkv_proj.weight = p(torch.cat(attn))
    layer.mlp.gate_up_proj = nn.Module()
    layer.mlp.gate_up_proj.weight = p(
        torch.cat([w["model.layers.0.mlp.gate_proj.weight"], w["model.layers.0.mlp.up_proj.weight"]])
    )
    layer.mlp.down_proj = nn.Module()
    layer.mlp.down_proj.weight = p(w["model.layers.0.mlp.down_proj.weight"])
    inner = nn.Module()
    inner.embed_tokens = nn.Module()
    inner.embed_tokens.weight = p(
        torch.cat([w["model.embed_tokens.weight"], torch.zeros(6, 8, dtype=torch.bfloat16)])
    )
    inner.layers = nn.ModuleList([layer])
    inner.norm = nn.Module()
    inner.norm.weight = p(w["model.norm.weight"])
    model = nn.Module()
    model.model = inner
    return model


def test_every_tensor_reads_back_equal_through_the_fused_and_padded_parameters():
    w = checkpoint()
    report = read_back(served(w), w, PACKED)
    assert report.compared == len(w) and report.mismatched == [] and report.unreadable == []
    report.raise_if_mismatched()


def test_one_bit_flipped_in_a_fused_parameter_names_its_checkpoint_tensor():
    w = checkpoint()
    model = served(w)
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    bits = qkv.data.view(torch.int16)
    bits[9, 3] ^= 1  # row 9: the second row of k_proj, its lowest mantissa bit
    report = read_back(model, w, PACKED)
    assert report.mismatched == ["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"`model.layers.0.self_attn.k_proj.weight` failed verification"):
        report.raise_if_mismatched()


def test_what_cannot_be_read_is_counted_not_guessed():
    w = checkpoint()
    model = served(w)
    # packed away into a kernel (vLLM's CPU build leaves an empty weight), and a tensor-parallel shard
    model.model.layers[0].mlp.down_proj.weight = nn.Parameter(
        torch.empty(0, dtype=torch.bfloat16), requires_grad=False
    )
    model.model.norm.weight = nn.Parameter(w["model.norm.weight"][:4].clone(), requires_grad=False)
    gate_up = model.model.layers[0].mlp.gate_up_proj
    gate_up.weight = nn.Parameter(
        gate_up.weight[::2].clone(), requires_grad=False
    )  # half of each part's rows
    report = read_back(model, w, PACKED)
    assert sorted(report.unreadable) == [
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.mlp.gate_up_proj.weight",
        "model.norm.weight",
    ]
    assert report.compared == 4 and report.mismatched == []
    assert read_back(model, {}, PACKED).compared == 0  # names the version lacks are not compared either


def test_same_bits_compares_bits_not_values():
    from slipstream.rollouter.vllm_readback import same_bits

    x = torch.randn(64, 8).to(torch.bfloat16)
    assert same_bits(x[16:32], x.clone()[16:32])  # a row slice of a larger parameter, as a fused one is read
    flipped = x.clone()
    flipped.view(torch.int16)[3, 5] ^= 1  # the lowest bit of one element
    assert not same_bits(x, flipped)
    zeros, negative = torch.zeros(4), -torch.zeros(4)
    assert torch.equal(zeros, negative) and not same_bits(zeros, negative)  # == calls them equal
    nan = torch.full((4,), float("nan"))
    assert not torch.equal(nan, nan) and same_bits(nan, nan.clone())
    assert not same_bits(x, x.reshape(32, 16)) and not same_bits(x, x.float())
