"""FSDP2 engine on the tiny MoE families: logprobs equal a plain HF forward, a step moves every expert, and
trainer.moe.aux_loss_coef adds exactly HF's load-balancing loss (times the coefficient) to the gradient.
The 2-rank equality is tests/trainer/test_fsdp_distributed.py, parametrised over the same families."""

from __future__ import annotations

import pytest
import torch

from slipstream.trainer.engine.fsdp import FSDPEngine
from slipstream.trainer.synthetic import make_packed_batch
from slipstream.utils.tiny_models import MOE_FAMILIES
from tests.trainer.conftest import trainer_settings


def _engine(model_path, *overrides):
    engine = FSDPEngine(trainer_settings(model_path, *overrides))
    engine.initialize()
    return engine


def _batch(n=5, seed=0):
    return make_packed_batch(
        [3, 5, 2, 4, 6][:n], [4, 1, 7, 3, 5][:n], vocab_size=200, seed=seed, group_size=n
    )


def _nll(outputs, mb):
    mask = mb["loss_mask"].float()
    return -(outputs["logprobs"] * mask).sum() / 20.0, {}


def _hf_logprobs(model, batch):
    """Per-sample plain HF forward: each token's logprob under the model, 0 at each sample's first token."""
    cu, ids, out = batch["cu_seqlens"].long(), batch["input_ids"].long(), []
    with torch.no_grad():
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            seq = ids[a:b]
            logp = torch.log_softmax(model(seq[None]).logits[0].float(), -1)[:-1]
            out += [logp.new_zeros(1), logp.gather(-1, seq[1:, None])[:, 0]]
    return torch.cat(out)


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize(
    "overrides",
    [(), ("trainer.logits_chunk_tokens=0",), ("trainer.attn_implementation=sdpa",)],
    ids=["chunked-shared-prompt", "full-logits", "sdpa"],
)
def test_moe_logprobs_equal_a_plain_hf_forward(tiny_moe_models, single_process_group, family, overrides):
    from transformers import AutoModelForCausalLM

    path = tiny_moe_models[family]
    engine = _engine(path, "trainer.micro_batch_tokens=4096", *overrides)
    batch = _batch()
    if overrides == ():  # one group's samples share their prompt: run once (engine/prefix.py)
        batch = make_packed_batch([4] * 4, [4, 1, 7, 3], vocab_size=200, group_size=4, shared_prompts=True)
    got = engine.forward_backward_batch(batch, None, forward_only=True).tokens["logprobs"]
    want = _hf_logprobs(AutoModelForCausalLM.from_pretrained(path), batch)
    scored = batch["loss_mask"].bool()  # the chunked head scores the response tokens only
    torch.testing.assert_close(got[scored], want[scored], atol=1e-5, rtol=0)
    if overrides == ("trainer.logits_chunk_tokens=0",):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_step_moves_every_expert_and_router(tiny_moe_models, single_process_group, family):
    engine = _engine(tiny_moe_models[family], "trainer.micro_batch_tokens=4096")
    before = {n: t.clone() for n, t in engine.get_per_tensor_param()}
    engine.forward_backward_batch(_batch(), _nll)
    assert engine.optimizer_step() > 0
    after = dict(engine.get_per_tensor_param())
    assert set(after) == set(before)
    layers = engine.model.config.num_hidden_layers
    for layer in range(layers):
        prefix = f"model.layers.{layer}.mlp"
        assert not torch.equal(after[f"{prefix}.gate.weight"], before[f"{prefix}.gate.weight"])
        for name in ("gate_up_proj", "down_proj"):
            moved = (after[f"{prefix}.experts.{name}"] - before[f"{prefix}.experts.{name}"]).abs()
            assert (moved.flatten(1).amax(1) > 0).all(), f"{prefix}.experts.{name}: an expert did not move"


def _grads(engine, batch):
    engine.forward_backward_batch(batch, _nll)
    grads = {n: p.grad.full_tensor().clone() for n, p in engine.model.named_parameters()}
    engine.optimizer.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_aux_loss_coef_adds_hf_load_balancing_gradient(tiny_moe_models, single_process_group, family):
    from transformers import AutoModelForCausalLM

    path = tiny_moe_models[family]
    batch = _batch(n=1)  # one sample, one micro-batch: the engine's aux loss is HF's for that sample
    plain = _grads(_engine(path, "trainer.micro_batch_tokens=4096"), batch)
    off = _grads(_engine(path, "trainer.micro_batch_tokens=4096", "trainer.moe.aux_loss_coef=0"), batch)
    engine = _engine(path, "trainer.micro_batch_tokens=4096", "trainer.moe.aux_loss_coef=0.5")
    on = _grads(engine, batch)
    for name, grad in plain.items():
        assert torch.equal(off[name], grad), name  # 0 changes nothing

    hf = AutoModelForCausalLM.from_pretrained(path)
    aux = hf(batch["input_ids"].long()[None], output_router_logits=True).aux_loss
    aux.backward()
    routers = [n for n in plain if n.endswith("mlp.gate.weight")]
    assert len(routers) == hf.config.num_hidden_layers
    for name in routers:
        hf_grad = dict(hf.named_parameters())[name].grad
        assert hf_grad.abs().max() > 0
        torch.testing.assert_close(on[name] - plain[name], 0.5 * hf_grad, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(on["lm_head.weight"], plain["lm_head.weight"], atol=0, rtol=0)
    metrics = engine.forward_backward_batch(batch, _nll).metrics
    assert metrics["moe_aux_loss"] == pytest.approx(aux.item(), rel=1e-5)


def test_aux_loss_needs_an_moe_model_and_fsdp(tiny_model_path, single_process_group):
    from slipstream.config import load_config

    with pytest.raises(ValueError, match="needs a mixture-of-experts model; LlamaForCausalLM"):
        _engine(tiny_model_path, "trainer.moe.aux_loss_coef=0.1")
    with pytest.raises(Exception, match="moe.aux_loss_coef > 0 is supported with engine fsdp only"):
        load_config(
            None, [f"model.path={tiny_model_path}", "trainer.engine=megatron", "trainer.moe.aux_loss_coef=1"]
        )


def test_the_trainer_steps_and_publishes_an_moe_model(tiny_moe_models, single_process_group):
    """The whole trainer step on an MoE model: proximal pass, two mini-batches, the aux loss as a metric, and
    a push of the fused expert tensors under their HF names."""
    from slipstream.trainer.engine import make_aux_engines
    from slipstream.trainer.trainer import Trainer
    from tests.trainer.conftest import RecordingPublisher
    from tests.trainer.fake_queue import FakeQueue, collate, make_group

    cfg = trainer_settings(
        tiny_moe_models["qwen3_moe"],
        "trainer.batch_groups=2",
        "trainer.mini_batches=2",
        "trainer.algorithm.policy_loss=decoupled_ppo",
        "trainer.moe.aux_loss_coef=0.01",
        "async.sync_every=1",
    )
    queue = FakeQueue()
    for i in range(2):
        queue.put(make_group(f"g{i}", 4, version=0, seed=i))
    engine = FSDPEngine(cfg)
    engine.initialize()
    publisher = RecordingPublisher()
    trainer = Trainer(
        cfg,
        engine,
        queue,
        rank=0,
        world_size=1,
        collate_fn=collate,
        publisher=publisher,
        **make_aux_engines(cfg),
    )
    (metrics,) = trainer.fit(1)
    assert [(v, sent) for v, sent, _ in publisher.pushes] == [(1, "full")]
    pushed = publisher.pushes[0][2]
    assert pushed["model.layers.0.mlp.experts.gate_up_proj"] == (4, 64, 128)
    assert set(pushed) == {n for n, _ in engine.model.named_parameters()}
    assert metrics["trainer/moe_aux_loss"] > 0 and metrics["trainer/grad_norm"] > 0
