"""Routing replay end to end on the embedded server: a tiny Qwen3-MoE (fp32) generates with routes over
HTTP, the routes ride in the trajectories through the queue's columns into the trainer's batch, and the FSDP
engine at the serving version, replaying them, gives the server's logprobs within 1e-4; the same trainer a
few optimizer steps later (as it is in an async run when these samples are trained) picks other experts for
some tokens without replay, which is what replay is for. The serving, batching and route counting are
``slipstream bench moe``'s (system/bench_moe.py), which reports the same figures."""

from __future__ import annotations

import numpy as np
import torch

from slipstream.system.bench_moe import PROMPTS, batch_of, hf_model, route_mismatch, serve
from tests.trainer.conftest import trainer_settings


def test_trainer_replays_the_servers_routes(tiny_moe_models, single_process_group):
    from slipstream.trainer.engine.fsdp import FSDPEngine

    path = tiny_moe_models["qwen3_moe"]
    outs = serve(path, PROMPTS)
    assert all(o.routed_experts is not None and o.routed_experts.dtype == np.uint8 for o in outs)
    batch = batch_of(PROMPTS, outs)
    scored = batch["loss_mask"].bool()
    assert batch["routed_experts"].shape[:1] == batch["input_ids"].shape
    assert batch["routed_experts"].dtype == torch.int16
    # the last token of each sample: no forward saw it, so its routes are unknown
    assert (batch["routed_experts"][batch["cu_seqlens"][1:].long() - 1] == -1).all()

    engine = FSDPEngine(trainer_settings(path, "trainer.micro_batch_tokens=4096"))
    engine.initialize()
    got = engine.forward_backward_batch(batch, None, forward_only=True).tokens["logprobs"]
    err = float((got[scored] - batch["old_logprobs"][scored]).abs().max())
    assert err <= 1e-4, f"replay at the serving version: max |logprob error| {err:.2e}"

    # a few optimizer steps later, as the trainer is in an async run when these samples are trained
    engine = FSDPEngine(trainer_settings(path, "trainer.micro_batch_tokens=4096", "trainer.lr=0.0001"))
    engine.initialize()
    weight = float(scored.sum())
    assert route_mismatch(hf_model(path), batch) == 0  # at the serving version fp32 routes agree

    def loss(outputs, mb):
        return -(outputs["logprobs"] * mb["loss_mask"].float()).sum() / weight, {}

    for _ in range(3):
        engine.forward_backward_batch(batch, loss)
        engine.optimizer_step()
    share = route_mismatch(hf_model(path, dict(engine.get_per_tensor_param())), batch)
    assert share > 0, (
        "three steps later the routers pick the server's experts everywhere: the test shows nothing"
    )
    without = batch.clone()
    del without["routed_experts"]
    free = engine.forward_backward_batch(without, None, forward_only=True).tokens["logprobs"]
    replayed = engine.forward_backward_batch(batch, None, forward_only=True).tokens["logprobs"]
    assert float((free[scored] - replayed[scored]).abs().max()) > 1e-3
    print(f"replay_logprob_max_abs_err={err:.2e} no_replay_route_mismatch={share:.3f}")
