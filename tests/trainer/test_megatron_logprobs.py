"""The Megatron engine's vocab-parallel chunked logprobs: over a real 2-rank gloo group with the vocabulary
split in two, values and gradients equal the single-device plain path (full fp32 logits), entropy included;
and on one rank the chunked result equals the unchunked one."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slipstream.trainer.engine.megatron_logprobs import vocab_parallel_token_logprobs
from slipstream.trainer.logprobs import full_token_logprobs
from slipstream.utils.net import free_port

N, H, V, TEMP = 23, 16, 40, 0.7


def _inputs():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float32)
    weight = torch.randn(V, H, generator=g, dtype=torch.float32) * 0.5
    targets = torch.randint(0, V, (N,), generator=g)
    g_logp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return hidden, weight, targets, g_logp, g_ent


def _run(hidden, weight, targets, g_logp, g_ent, **kw):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, ent = kw.pop("fn")(h, w, targets, temperature=TEMP, entropy=True, **kw)
    ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        hidden, weight, targets, g_logp, g_ent = _inputs()
        half = V // 2
        local = weight[rank * half : (rank + 1) * half]
        logp, ent, gh, gw = _run(
            hidden, local, targets, g_logp, g_ent,
            fn=vocab_parallel_token_logprobs, group=dist.group.WORLD, vocab_start=rank * half, chunk=5,
        )  # fmt: skip
        dist.all_reduce(gh)  # what the TP mapping in front of the head does in backward
        torch.save({"logp": logp, "ent": ent, "gh": gh, "gw": gw}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_two_rank_vocab_split_equals_the_full_logits_path(tmp_path):
    mp.start_processes(_worker, args=(free_port(), str(tmp_path / "r")), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"r.{r}") for r in range(2)]
    hidden, weight, targets, g_logp, g_ent = _inputs()
    logp, ent, gh, gw = _run(hidden, weight, targets, g_logp, g_ent, fn=full_token_logprobs)
    for got in ranks:
        torch.testing.assert_close(got["logp"], logp.float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["ent"], ent.float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["gh"], gh, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat([ranks[0]["gw"], ranks[1]["gw"]]), gw, atol=2e-5, rtol=1e-4)


def test_chunks_change_nothing_on_one_rank():
    hidden, weight, targets, g_logp, g_ent = _inputs()
    whole = _run(hidden, weight, targets, g_logp, g_ent, fn=vocab_parallel_token_logprobs, chunk=0)
    chunked = _run(hidden, weight, targets, g_logp, g_ent, fn=vocab_parallel_token_logprobs, chunk=4)
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
