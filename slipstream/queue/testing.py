"""Hand-built trajectory groups for tests and benchmarks (of the queue and of everything fed by it)."""

from __future__ import annotations

import torch

from slipstream.queue.types import Trajectory, TrajectoryGroup


def make_group(
    gid: str,
    n: int = 2,
    prompt_len: int = 3,
    response_len: int = 4,
    version: int = 0,
    payload: int = 0,
    reward: float = 1.0,
    routes: tuple[int, int] | None = None,
) -> TrajectoryGroup:
    """A group of ``n`` samples with uids ``{gid}-{i}``, every response token at weight ``version``.

    ``payload`` adds a response-aligned uint8 column ``payload`` of that many bytes per response token, to
    make groups of a chosen size; its bytes are a fixed pattern, so a receiver can check them. ``routes``
    ``(layers, k)``: each sample carries ``routed_experts`` (uint8, a fixed pattern per sample).
    """
    trajs = [
        Trajectory(
            uid=f"{gid}-{i}",
            group_id=gid,
            prompt_ids=list(range(1, prompt_len + 1)),
            response_ids=[100 + i] * response_len,
            loss_mask=[1] * response_len,
            logprobs=[-0.5] * response_len,
            versions=[version] * response_len,
            reward=reward,
            routed_experts=None
            if routes is None
            else _routes(prompt_len + response_len - 1, *routes, seed=i),
        )
        for i in range(n)
    ]
    group = TrajectoryGroup.from_trajectories(trajs)
    if payload:
        rows = n * response_len
        group.tensors["payload"] = (torch.arange(rows * payload) % 251).to(torch.uint8).reshape(rows, payload)
    return group


def _routes(rows: int, layers: int, k: int, seed: int) -> torch.Tensor:
    return ((torch.arange(rows * layers * k) * 7 + seed) % 64).to(torch.uint8).reshape(rows, layers, k)
