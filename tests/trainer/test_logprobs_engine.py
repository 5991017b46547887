"""The FSDP engine's chunked logprobs path equals its full-logits path (values, entropy, loss, gradients, with
the entropy bonus differentiated), packed and padded; activation checkpointing changes neither loss nor
gradients."""

from __future__ import annotations

import pytest

from slipstream.trainer.algos import ADVANTAGES, AdvantageInputs, global_counts
from slipstream.trainer.engine.fsdp import FSDPEngine
from slipstream.trainer.logprobs import LogprobHead
from slipstream.trainer.loss import GlobalCounts, PolicyLoss
from slipstream.trainer.synthetic import make_packed_batch
from tests.trainer.conftest import trainer_settings


def _batch():
    batch = make_packed_batch([3, 5, 2, 4], [6, 1, 7, 3], vocab_size=200, seed=1, group_size=4)
    batch["advantages"] = ADVANTAGES.get("grpo")(
        AdvantageInputs(batch["rewards"], batch["group_index"], batch["loss_mask"], batch["cu_seqlens"])
    ).advantages
    return batch


def _step(model_path, *overrides):
    """Loss, metrics, forward-only outputs and gradients of one step with the entropy bonus on."""
    cfg = trainer_settings(
        model_path, "trainer.algorithm.entropy_coef=0.01", "rollout.sampling.temperature=0.8", *overrides
    )
    engine = FSDPEngine(cfg)
    engine.initialize()
    batch = _batch()
    tokens, seqs = global_counts(batch["loss_mask"], batch["cu_seqlens"])
    loss_fn = PolicyLoss(cfg.trainer.algorithm, GlobalCounts(tokens, seqs, 1.0))
    assert loss_fn.entropy_grad
    out = engine.forward_backward_batch(batch, loss_fn)
    grads = {n: p.grad.full_tensor().clone() for n, p in engine.model.named_parameters()}
    engine.optimizer.zero_grad(set_to_none=True)
    tokens_out = engine.forward_backward_batch(batch, loss_fn, forward_only=True).tokens
    return engine, out.metrics, tokens_out, grads


def _assert_same(a, b, atol):
    _, metrics_a, tokens_a, grads_a = a
    _, metrics_b, tokens_b, grads_b = b
    assert set(tokens_a) == set(tokens_b) == {"logprobs", "entropy"}
    mask = _batch()["loss_mask"].float()  # per-token outputs are defined on the loss mask (engine/base.py)
    for key in tokens_a:
        assert ((tokens_a[key] - tokens_b[key]) * mask).abs().max().item() <= atol, key
    for key in metrics_a:
        assert metrics_a[key] == pytest.approx(metrics_b[key], abs=atol), key
    for name in grads_a:
        assert (grads_a[name] - grads_b[name]).abs().max().item() <= atol, name


@pytest.mark.parametrize("pack", ["true", "false"])
def test_chunked_logprobs_equal_full_logits(tiny_model_path, single_process_group, pack):
    full = _step(tiny_model_path, "trainer.logits_chunk_tokens=0", f"trainer.pack_sequences={pack}")
    assert full[0]._head is None
    chunked = _step(tiny_model_path, "trainer.logits_chunk_tokens=3", f"trainer.pack_sequences={pack}")
    assert isinstance(chunked[0]._head, LogprobHead)
    _assert_same(full, chunked, atol=1e-5)


def checkpointing(model) -> bool:
    """transformers 5.24 names the flag is_activation_checkpointing; 5.19-5.23 is_gradient_checkpointing."""
    flag = getattr(model, "is_activation_checkpointing", None)
    return bool(model.is_gradient_checkpointing if flag is None else flag)


def test_activation_checkpointing_keeps_loss_and_grads(tiny_model_path, single_process_group):
    plain = _step(tiny_model_path, "trainer.activation_checkpointing=false")
    ckpt = _step(tiny_model_path, "trainer.activation_checkpointing=true")
    assert checkpointing(ckpt[0].model) and not checkpointing(plain[0].model)
    _assert_same(plain, ckpt, atol=1e-6)
