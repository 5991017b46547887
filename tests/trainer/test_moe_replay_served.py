"""Routing replay end to end on the embedded server: a tiny Qwen3-MoE (fp32) generates with routes over
HTTP, the routes ride in the trajectories through the queue's columns into the trainer's batch, and the FSDP
engine at the serving version, replaying them, gives the server's logprobs within 1e-4; the same trainer
with its routers moved (as a few optimizer steps move them in an async run) picks other experts for some
tokens without replay, which is what replay is for."""

from __future__ import annotations

import numpy as np
import torch

from slipstream.agents.protocol import SamplingParams
from slipstream.queue.batch import collate
from slipstream.queue.types import Trajectory, TrajectoryGroup
from slipstream.serverapi import EMBEDDED
from slipstream.serverkinds.sglang import SGLangClient
from slipstream.trainer.engine.moe import record_routes
from tests.rollouter.test_engine_weights import LiveServer
from tests.trainer.conftest import trainer_settings
from tests.trainer.test_moe_replay import _model

PROMPTS = [[5, 17, 99, 3, 250], [42, 7, 8, 11], [12, 13, 14, 15, 16, 60], [61, 9, 2, 33, 21]]


def _serve(path) -> list:
    live = LiveServer(path)

    async def main():
        client = SGLangClient(live.url, server_api=EMBEDDED)
        params = SamplingParams(max_new_tokens=12, ignore_eos=True, return_routed_experts=True)
        try:
            return [await client.generate(p, params, rid=f"r{i}") for i, p in enumerate(PROMPTS)]
        finally:
            await client.aclose()

    try:
        return live.call(main())
    finally:
        live.close()


def _batch(outs):
    trajs = [
        Trajectory(
            uid=f"g-{i}",
            group_id="g",
            prompt_ids=prompt,
            response_ids=out.output_ids,
            loss_mask=[1] * len(out.output_ids),
            logprobs=out.logprobs,
            versions=out.versions,
            routed_experts=out.routed_experts,
        )
        for i, (prompt, out) in enumerate(zip(PROMPTS, outs, strict=True))
    ]
    group = TrajectoryGroup.from_trajectories(trajs)
    assert group.tensors["prompt_routes"].dtype == torch.uint8
    return collate([TrajectoryGroup.from_trajectories(group.to_trajectories())])


def _mismatch_share(model, batch) -> float:
    """Share of tokens with known routes whose expert set ``model`` picks differently in some layer."""
    cu, ids, routes = batch["cu_seqlens"].long(), batch["input_ids"].long(), batch["routed_experts"].long()
    own = torch.cat(
        [record_routes(model, input_ids=ids[None, a:b]) for a, b in zip(cu[:-1], cu[1:], strict=True)]
    )
    known = (routes >= 0).all(-1).all(-1)
    differ = (own.sort(-1).values != routes.sort(-1).values).any(-1).any(-1)
    return float(differ[known].float().mean())


def test_trainer_replays_the_servers_routes(tiny_moe_models, single_process_group):
    from slipstream.trainer.engine.fsdp import FSDPEngine

    path = tiny_moe_models["qwen3_moe"]
    outs = _serve(path)
    assert all(o.routed_experts is not None and o.routed_experts.dtype == np.uint8 for o in outs)
    batch = _batch(outs)
    scored = batch["loss_mask"].bool()
    assert batch["routed_experts"].shape[:1] == batch["input_ids"].shape
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
    assert _mismatch_share(_model(path), batch) == 0  # at the serving version fp32 routes agree

    def loss(outputs, mb):
        return -(outputs["logprobs"] * mb["loss_mask"].float()).sum() / weight, {}

    for _ in range(3):
        engine.forward_backward_batch(batch, loss)
        engine.optimizer_step()
    later = _model(path)
    later.load_state_dict(dict(engine.get_per_tensor_param()))
    share = _mismatch_share(later, batch)
    assert share > 0, (
        "three steps later the routers pick the server's experts everywhere: the test shows nothing"
    )
    without = batch.clone()
    del without["routed_experts"]
    free = engine.forward_backward_batch(without, None, forward_only=True).tokens["logprobs"]
    replayed = engine.forward_backward_batch(batch, None, forward_only=True).tokens["logprobs"]
    assert float((free[scored] - replayed[scored]).abs().max()) > 1e-3
    print(f"replay_logprob_max_abs_err={err:.2e} no_replay_route_mismatch={share:.3f}")
