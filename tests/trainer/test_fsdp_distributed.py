"""FSDP2 over 2 gloo ranks computes the same loss, gradients and update as one process, and a checkpoint
written by 2 ranks resumes in 1 (DCP reshards): for the dense tiny model and each tiny MoE family, whose
fused expert tensors FSDP shards by expert."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slipstream.trainer.algos.aggregation import global_counts
from slipstream.trainer.batching import partition_for_ranks, sample_lengths, select_samples
from slipstream.trainer.engine.fsdp import FSDPEngine
from slipstream.trainer.synthetic import make_packed_batch
from slipstream.utils.net import free_port
from slipstream.utils.tiny_models import MOE_FAMILIES
from tests.trainer.conftest import trainer_settings


def _batch():
    # lengths 7, 6, 9, 7, 11: with an 8-token budget the two ranks get 3 and 2 micro-batches
    return make_packed_batch([3, 5, 2, 4, 6], [4, 1, 7, 3, 5], vocab_size=200, seed=3, group_size=5)


def _loss_fn(global_tokens):
    def loss_fn(outputs, mb):
        mask = mb["loss_mask"].float()
        return -(outputs["logprobs"] * mask).sum() / global_tokens, {}

    return loss_fn


def _run(engine, rank, world):
    batch = _batch()
    tokens, _ = global_counts(batch["loss_mask"], batch["cu_seqlens"])
    shard = select_samples(batch, partition_for_ranks(sample_lengths(batch), world)[rank])
    out = engine.forward_backward_batch(shard, _loss_fn(tokens))
    grads = {n: p.grad.full_tensor().clone() for n, p in engine.model.named_parameters()}
    norm = engine.optimizer_step()
    second = engine.forward_backward_batch(shard, _loss_fn(tokens), forward_only=True).metrics["loss"]
    return {
        "loss": out.metrics["loss"],
        "micro": out.num_micro_batches,
        "norm": norm,
        "second": second,
    }, grads


def _worker(rank, world, port, model_path, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        engine = FSDPEngine(trainer_settings(model_path, "trainer.micro_batch_tokens=8"))
        engine.initialize()
        result, grads = _run(engine, rank, world)
        engine.save_checkpoint(f"{out_dir}/ckpt")
        if rank == 0:
            torch.save({"result": result, "grads": grads}, f"{out_dir}/dist.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", ["dense", *MOE_FAMILIES])
def test_two_gloo_ranks_match_one_process(
    tiny_model_path, tiny_moe_models, single_process_group, tmp_path, family
):
    if family != "dense":
        tiny_model_path = tiny_moe_models[family]
    port = free_port()
    mp.start_processes(
        _worker, args=(2, port, str(tiny_model_path), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    got = torch.load(tmp_path / "dist.pt", weights_only=False)

    engine = FSDPEngine(trainer_settings(tiny_model_path, "trainer.micro_batch_tokens=8"))
    engine.initialize()
    want, grads = _run(engine, 0, 1)
    assert got["result"]["micro"] == 3  # rank 0 ran one zero-weight micro-batch to match rank 1
    assert got["result"]["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["result"]["norm"] == pytest.approx(want["norm"], rel=1e-4)
    assert got["result"]["second"] == pytest.approx(want["second"], rel=1e-4)
    for name, grad in grads.items():
        torch.testing.assert_close(got["grads"][name], grad, atol=1e-6, rtol=1e-4)

    # the 2-rank checkpoint loads into this 1-rank engine and holds the same weights
    ref = dict(engine.get_per_tensor_param())
    fresh = FSDPEngine(engine.settings)
    fresh.initialize()
    fresh.load_checkpoint(tmp_path / "ckpt")
    for name, tensor in fresh.get_per_tensor_param():
        torch.testing.assert_close(tensor, ref[name], atol=1e-6, rtol=1e-5)
