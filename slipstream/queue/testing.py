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
) -> TrajectoryGroup:
    """A group of ``n`` samples with uids ``{gid}-{i}``, every response token at weight ``version``.

    ``payload`` adds a response-aligned uint8 column ``payload`` of that many bytes per response token, to
    make groups of a chosen size; its bytes are a fixed pattern, so a receiver can check them.
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
        )
        for i in range(n)
    ]
    group = TrajectoryGroup.from_trajectories(trajs)
    if payload:
        rows = n * response_len
        group.tensors["payload"] = (torch.arange(rows * payload) % 251).to(torch.uint8).reshape(rows, payload)
    return group
