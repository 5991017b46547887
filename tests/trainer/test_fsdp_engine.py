"""FSDP2 engine on one process: packing is exact, training moves the loss, checkpoints resume exactly."""

from __future__ import annotations

import pytest
import torch

from slipstream.trainer.batching import select_samples
from slipstream.trainer.engine.fsdp import FSDPEngine
from slipstream.trainer.synthetic import make_packed_batch
from tests.trainer.conftest import trainer_settings  # noqa: F401  (module import path in pytest rootdir)


def _engine(model_path, *overrides):
    engine = FSDPEngine(trainer_settings(model_path, *overrides))
    engine.initialize()
    return engine


def _batch(seed=0, n=5):
    return make_packed_batch(
        [3, 5, 2, 4, 6][:n], [4, 1, 7, 3, 5][:n], vocab_size=200, seed=seed, group_size=n
    )


def _nll(outputs, mb):
    mask = mb["loss_mask"].float()
    return -(outputs["logprobs"] * mask).sum() / 20.0, {"tokens": mask.sum()}


@pytest.mark.parametrize("attn", ["sdpa_varlen", "sdpa"])
def test_packed_logprobs_equal_per_sample_and_padded(tiny_model_path, single_process_group, attn):
    engine = _engine(
        tiny_model_path, "trainer.micro_batch_tokens=4096", f"trainer.attn_implementation={attn}"
    )
    assert engine.model.config._attn_implementation == attn
    batch = _batch()
    packed = engine.forward_backward_batch(batch, None, forward_only=True).tokens["logprobs"]
    alone = torch.cat(
        [
            engine.forward_backward_batch(select_samples(batch, [i]), None, True).tokens["logprobs"]
            for i in range(5)
        ]
    )
    torch.testing.assert_close(packed, alone, atol=2e-5, rtol=1e-5)
    engine.tcfg.pack_sequences = False
    padded = engine.forward_backward_batch(batch, None, forward_only=True).tokens["logprobs"]
    torch.testing.assert_close(packed, padded, atol=2e-5, rtol=1e-5)
    # the first token of each sample has no prediction
    assert (packed[batch["cu_seqlens"][:-1].long()] == 0).all()


def test_micro_batches_accumulate_to_the_same_gradient(tiny_model_path, single_process_group):
    engine = _engine(tiny_model_path, "trainer.micro_batch_tokens=4096")
    batch = _batch()
    out = engine.forward_backward_batch(batch, _nll)
    whole = {n: p.grad.full_tensor().clone() for n, p in engine.model.named_parameters()}
    engine.optimizer.zero_grad(set_to_none=True)
    engine.tcfg.micro_batch_tokens = 8
    split = engine.forward_backward_batch(batch, _nll)
    assert split.num_micro_batches > 1 and out.num_micro_batches == 1
    assert split.metrics["loss"] == pytest.approx(out.metrics["loss"], rel=1e-5)
    assert split.metrics["tokens"] == 20.0
    for name, param in engine.model.named_parameters():
        torch.testing.assert_close(param.grad.full_tensor(), whole[name], atol=1e-6, rtol=1e-4)


def test_loss_falls_on_a_fixed_batch(tiny_model_path, single_process_group):
    engine = _engine(tiny_model_path, "trainer.activation_checkpointing=true")
    batch = _batch()
    losses = []
    for _ in range(8):
        losses.append(engine.forward_backward_batch(batch, _nll).metrics["loss"])
        assert engine.optimizer_step() > 0
        engine.lr_scheduler_step()
    assert losses[-1] < losses[0] * 0.8, losses


def test_checkpoint_save_load_continue_gives_the_same_step(tiny_model_path, single_process_group, tmp_path):
    engine = _engine(tiny_model_path, "trainer.warmup_steps=3")
    batch_a, batch_b = _batch(1), _batch(2)
    engine.forward_backward_batch(batch_a, _nll)
    engine.optimizer_step()
    engine.lr_scheduler_step()
    engine.save_checkpoint(tmp_path / "ckpt")
    ref_loss = engine.forward_backward_batch(batch_b, _nll).metrics["loss"]
    ref_norm = engine.optimizer_step()
    ref_lr = engine.lr_scheduler_step()
    ref = dict(engine.get_per_tensor_param())

    fresh = FSDPEngine(engine.settings)
    fresh.initialize()
    fresh.load_checkpoint(tmp_path / "ckpt")
    assert fresh.forward_backward_batch(batch_b, _nll).metrics["loss"] == pytest.approx(ref_loss, rel=1e-6)
    assert fresh.optimizer_step() == pytest.approx(ref_norm, rel=1e-6)
    assert fresh.lr_scheduler_step() == pytest.approx(ref_lr)
    for name, tensor in fresh.get_per_tensor_param():
        torch.testing.assert_close(tensor, ref[name], atol=0, rtol=0)


def test_per_tensor_params_are_hf_names_and_full_shapes(tiny_model_path, single_process_group):
    from transformers import AutoModelForCausalLM

    engine = _engine(tiny_model_path)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    want = {n: p.shape for n, p in hf.named_parameters()}
    got = {n: t.shape for n, t in engine.get_per_tensor_param(dtype=torch.bfloat16)}
    assert got == want
    engine.to("cpu")  # offload round trip keeps the engine usable
    engine.forward_backward_batch(_batch(), _nll)
    assert engine.optimizer_step() > 0
