"""Routing replay's hooks on the HF routers (trainer/engine/moe.py ``RouteReplay``), on the tiny MoE
families: replaying the routes a model picks changes nothing, replaying another version's routes makes the
model use exactly those experts (where without replay it picks others), the router still gets a gradient,
and routes of the wrong shape or range are refused."""

from __future__ import annotations

import pytest
import torch

from slipstream.trainer.engine.moe import RouteReplay, record_routes
from slipstream.utils.tiny_models import MOE_FAMILIES

IDS = torch.tensor([[5, 17, 99, 3, 250, 42, 7, 8, 11, 12, 13, 14, 15, 16, 60, 61]])


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


def _moved_routers(model, scale=1.0, seed=0):
    """The model a few optimizer steps later, as far as its routing goes: router weights moved."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(scale * p.std() * torch.randn(p.shape, generator=gen))
    return model


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replaying_a_models_own_routes_changes_nothing(tiny_moe_models, family):
    model = _model(tiny_moe_models[family])
    with torch.no_grad():
        want = model(input_ids=IDS).logits
    routes = record_routes(model, input_ids=IDS)
    assert routes.shape == (IDS.numel(), model.config.num_hidden_layers, model.config.num_experts_per_tok)
    replay = RouteReplay(model)
    replay.set(routes)
    with torch.no_grad():
        got = model(input_ids=IDS).logits
    replay.clear()
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replay_makes_a_later_version_use_the_servers_experts(tiny_moe_models, family):
    path = tiny_moe_models[family]
    served = record_routes(_model(path), input_ids=IDS)  # the version that generated
    trainer = _moved_routers(_model(path))
    own = record_routes(trainer, input_ids=IDS)
    differ = (own.sort(-1).values != served.sort(-1).values).any(-1).any(-1)
    assert differ.any(), "the moved routers pick the same experts: the test shows nothing"
    with torch.no_grad():
        free = trainer(input_ids=IDS).logits

    replay = RouteReplay(trainer)
    replay.set(served)
    assert torch.equal(record_routes(trainer, input_ids=IDS), served)  # the experts the server used
    out = trainer(input_ids=IDS).logits
    assert not torch.allclose(out.detach(), free)
    out.logsumexp(-1).sum().backward()
    replay.clear()
    for layer in trainer.model.layers:
        grad = layer.mlp.gate.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().max() > 0


def test_routes_of_the_wrong_shape_or_range_are_refused(tiny_moe_models, tiny_model_path):
    model = _model(tiny_moe_models["qwen3_moe"])
    replay = RouteReplay(model)
    with pytest.raises(ValueError, match=r"want \[rows, 2, 2\]"):
        replay.set(torch.zeros(16, 2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="outside 0..3"):
        replay.set(torch.full((16, 2, 2), 4))
    replay.set(torch.zeros(15, 2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="15 rows, but the router sees 16 tokens"):
        model(input_ids=IDS)
    replay.clear()
    with pytest.raises(ValueError, match="needs a mixture-of-experts model; LlamaForCausalLM"):
        RouteReplay(_model(tiny_model_path))
