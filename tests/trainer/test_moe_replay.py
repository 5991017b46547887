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


def _served_routes(model, batch):
    """What a server at ``model``'s weights routed each sample's tokens to, laid end to end like the batch."""
    cu, ids = batch["cu_seqlens"].long(), batch["input_ids"].long()
    bounds = zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)
    return torch.cat([record_routes(model, input_ids=ids[None, a:b]) for a, b in bounds])


def _replayed_logprobs(model, batch, routes):
    cu, ids, out = batch["cu_seqlens"].long(), batch["input_ids"].long(), []
    replay = RouteReplay(model)
    with torch.no_grad():
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            replay.set(routes[a:b])
            logp = torch.log_softmax(model(input_ids=ids[None, a:b]).logits[0].float(), -1)[:-1]
            out += [logp.new_zeros(1), logp.gather(-1, ids[a + 1 : b, None])[:, 0]]
    replay.clear()
    return torch.cat(out)


@pytest.mark.parametrize("unknown", [False, True], ids=["all-routes", "some-prompt-routes-unknown"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_engine_replays_a_batchs_routed_experts(
    tiny_moe_models, single_process_group, tmp_path, family, unknown
):
    """Packed on the shared-prompt row (or, when one sample's prompt routes are unknown, -1, packed without
    it), full logits and padded: the engine's logprobs are the HF model's with the same routes replayed."""
    import shutil

    from slipstream.trainer.engine.fsdp import FSDPEngine
    from slipstream.trainer.synthetic import make_packed_batch
    from tests.trainer.conftest import trainer_settings

    path = tiny_moe_models[family]
    batch = make_packed_batch(
        [5] * 4, [6, 2, 9, 4], vocab_size=200, group_size=4, shared_prompts=True, seed=2
    )
    routes = _served_routes(_model(path), batch)
    if unknown:  # prompt tokens the server returned no routes for: the trainer routes them itself
        routes[:3] = -1
    moved = tmp_path / "moved"
    shutil.copytree(path, moved)
    trainer_model = _moved_routers(_model(path), scale=0.5, seed=3)
    trainer_model.save_pretrained(moved)
    want = _replayed_logprobs(trainer_model, batch, routes)
    scored = batch["loss_mask"].bool()

    with_routes = batch.clone()
    with_routes["routed_experts"] = routes
    for overrides in [(), ("trainer.logits_chunk_tokens=0",), ("trainer.pack_sequences=false",)]:
        engine = FSDPEngine(trainer_settings(moved, "trainer.micro_batch_tokens=4096", *overrides))
        engine.initialize()
        got = engine.forward_backward_batch(with_routes, None, forward_only=True).tokens["logprobs"]
        torch.testing.assert_close(got[scored], want[scored], atol=1e-5, rtol=0)
        free = engine.forward_backward_batch(batch, None, forward_only=True).tokens["logprobs"]
        assert (free[scored] - want[scored]).abs().max() > 1e-3  # without replay the routes differ

    def loss(outputs, mb):
        return -(outputs["logprobs"] * mb["loss_mask"].float()).sum() / 20.0, {}

    engine.forward_backward_batch(with_routes, loss)
    for name, p in engine.model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            assert p.grad.full_tensor().abs().max() > 0, name


def test_shared_prompt_rows_take_routes_only_when_their_samples_agree():
    from slipstream.trainer.engine.moe import forward_routes
    from slipstream.trainer.engine.prefix import build_layout
    from slipstream.trainer.synthetic import make_packed_batch

    batch = make_packed_batch([4, 4], [3, 2], vocab_size=200, group_size=2, shared_prompts=True)
    layout = build_layout(batch)
    assert layout is not None and layout.ids.numel() == 9  # 4 shared prompt rows + 3 + 2
    routes = torch.randint(0, 4, (13, 2, 2))
    routes[7:11] = routes[0:4]  # the second sample's prompt routed as the first's
    rows, kept = forward_routes(routes, layout=layout)
    assert kept is layout and torch.equal(rows.index_select(0, layout.index), routes)
    routes[8, 1, 0] = (routes[8, 1, 0] + 1) % 4
    rows, kept = forward_routes(routes, layout=layout)
    assert kept is None and torch.equal(rows, routes)
    grid = torch.tensor([[True] * 7, [True] * 6 + [False]])
    rows, kept = forward_routes(routes, grid_mask=grid)
    assert kept is None and rows.shape == (14, 2, 2) and (rows[13] == -1).all()
