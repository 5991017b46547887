"""Ulysses sequence parallelism over 2 gloo ranks (each runs half of every packed micro-batch, attention
exchanging heads for tokens) gives the logprobs, entropy, loss and gradients of one unsplit process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slipstream.trainer.algos import ADVANTAGES, AdvantageInputs, global_counts
from slipstream.trainer.engine.fsdp import FSDPEngine
from slipstream.trainer.loss import GlobalCounts, PolicyLoss
from slipstream.trainer.synthetic import make_packed_batch
from slipstream.utils.net import free_port
from tests.trainer.conftest import trainer_settings

# micro-batches of 13, 16 and 11 tokens under a 16-token budget: odd ones exercise the padding sample
COMMON = (
    "trainer.micro_batch_tokens=16",
    "trainer.algorithm.entropy_coef=0.01",
    "trainer.logits_chunk_tokens=5",
)


def _batch():
    batch = make_packed_batch([3, 5, 2, 4, 6], [4, 1, 7, 3, 5], vocab_size=200, seed=3, group_size=5)
    batch["advantages"] = ADVANTAGES.get("grpo")(
        AdvantageInputs(batch["rewards"], batch["group_index"], batch["loss_mask"], batch["cu_seqlens"])
    ).advantages
    return batch


def _run(engine):
    batch = _batch()
    tokens, seqs = global_counts(batch["loss_mask"], batch["cu_seqlens"])
    loss_fn = PolicyLoss(engine.settings.trainer.algorithm, GlobalCounts(tokens, seqs, 1.0))
    out = engine.forward_backward_batch(batch, loss_fn)
    grads = {n: p.grad.full_tensor().clone() for n, p in engine.model.named_parameters()}
    engine.optimizer.zero_grad(set_to_none=True)
    fwd = engine.forward_backward_batch(batch, loss_fn, forward_only=True)
    return {"metrics": out.metrics, "micro": out.num_micro_batches, "tokens": fwd.tokens, "grads": grads}


def _worker(rank, world, port, model_path, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        cfg = trainer_settings(
            model_path, *COMMON, "trainer.sequence_parallel_size=2", "trainer.activation_checkpointing=true"
        )
        engine = FSDPEngine(cfg)
        engine.initialize()
        assert engine.model.config._attn_implementation == "ulysses_sdpa_varlen"
        assert (engine.dp_rank, engine.dp_size) == (0, 1)  # both ranks are one replica
        torch.save(_run(engine), f"{out_dir}/sp{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_rank_ulysses_matches_one_process(tiny_model_path, single_process_group, tmp_path):
    port = free_port()
    mp.start_processes(
        _worker, args=(2, port, str(tiny_model_path), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    got = [torch.load(tmp_path / f"sp{r}.pt", weights_only=False) for r in range(2)]

    engine = FSDPEngine(trainer_settings(tiny_model_path, *COMMON))
    engine.initialize()
    want = _run(engine)
    assert got[0]["micro"] == want["micro"] == 3
    mask = _batch()["loss_mask"].float()  # per-token outputs are defined on the loss mask (engine/base.py)
    for key in ("logprobs", "entropy"):
        for g in got:  # every rank of the group returns the whole micro-batch's outputs
            assert ((g["tokens"][key] - want["tokens"][key]) * mask).abs().max().item() <= 1e-5, key
    for key, value in want["metrics"].items():
        assert got[0]["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got[0]["grads"][name], grad, atol=1e-6, rtol=1e-4)
