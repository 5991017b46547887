"""MoE routing replay through the queue: routes ride as two uint8 columns (never pickled), come back bit for
bit from a live server, collate into the micro-batch's ``routed_experts``, and routes that do not match the
tokens are refused at put with the reason."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slipstream.queue import codec as C
from slipstream.queue.batch import collate
from slipstream.queue.client import QueueClient
from slipstream.queue.testing import make_group
from slipstream.queue.types import Trajectory, TrajectoryGroup


def _traj(uid: str, routes, prompt=(1, 2, 3), response=(7, 8)) -> Trajectory:
    n = len(response)
    return Trajectory(
        uid=uid,
        group_id="g",
        prompt_ids=list(prompt),
        response_ids=list(response),
        loss_mask=[1] * n,
        logprobs=[-0.5] * n,
        versions=[0] * n,
        routed_experts=routes,
    )


def test_routes_roundtrip_through_the_columns():
    group = make_group("g", n=3, prompt_len=3, response_len=4, routes=(2, 2))
    assert (
        group.tensors["prompt_routes"].shape == (9, 2, 2)
        and group.tensors["response_routes"].dtype == torch.uint8
    )
    assert (group.tensors["response_routes"][3] == 255).all()  # the first sample's last token: unknown
    back = TrajectoryGroup.from_trajectories(group.to_trajectories())
    for name, t in group.tensors.items():
        assert torch.equal(back.tensors[name], t), name


def test_routes_that_do_not_match_the_tokens_are_refused_with_the_reason():
    short = np.zeros((3, 2, 2), dtype=np.uint8)  # prompt 3 + response 2 - 1 = 4 rows expected
    with pytest.raises(
        ValueError, match=r"`routed_experts` has shape \(3, 2, 2\), expected \[4, layers, k\]"
    ):
        TrajectoryGroup.from_trajectories([_traj("a", short)])
    with pytest.raises(ValueError, match="carry no routed_experts while others"):
        TrajectoryGroup.from_trajectories([_traj("a", np.zeros((4, 2, 2), np.uint8)), _traj("b", None)])
    group = make_group("g", routes=(2, 2))
    specs, size = C.layout_region(
        {"prompt_routes": group.tensors["prompt_routes"]}
        | {k: v for k, v in group.tensors.items() if k != "response_routes"},
        inline_bytes=16,
    )
    with pytest.raises(C.WireError, match="come together"):
        C.validate_group(group.meta, specs, [size])


def test_wide_expert_ids_travel_as_int16_and_collate_to_minus_one_where_unknown():
    routes = torch.tensor([[[0, 300]], [[5, 6]], [[-1, -1]], [[9, 255]]], dtype=torch.int16)
    group = TrajectoryGroup.from_trajectories([_traj("a", routes)])
    assert group.tensors["prompt_routes"].dtype == torch.int16
    batch = collate([group, make_group("h", n=1, prompt_len=2, response_len=2, routes=(1, 2))])
    got = batch["routed_experts"]
    assert got.shape == (9, 1, 2) and got.dtype == torch.int16
    assert torch.equal(got[:4], routes) and (got[4] == -1).all()  # sample a's last token
    assert (got[8] == -1).all() and (got[5:8] >= 0).all()


def test_routes_come_back_bit_for_bit_from_a_live_queue(server):
    srv = server(shm_min_group_bytes=1024)
    producer = QueueClient(srv.address, timeout_s=30)
    consumer = QueueClient(srv.address, timeout_s=30, shared_memory=False)
    try:
        groups = [make_group("g0", routes=(3, 2)), make_group("g1", n=4, response_len=50, routes=(3, 2))]
        assert all(producer.put(g) for g in groups)
        lease = consumer.lease(2, timeout_s=5)
        for got, sent in zip(lease.groups, groups, strict=True):
            for name in ("prompt_routes", "response_routes"):
                assert torch.equal(got.tensors[name], sent.tensors[name]), name
        trajs = lease.groups[1].to_trajectories()
        assert np.array_equal(trajs[2].routed_experts, groups[1].to_trajectories()[2].routed_experts)
        consumer.ack(lease)
    finally:
        producer.close()
        consumer.close()


def _with_routes(group: TrajectoryGroup, name: str, routes: torch.Tensor) -> TrajectoryGroup:
    return TrajectoryGroup(group.meta, {**group.tensors, name: routes})


def _wire_check(group: TrajectoryGroup) -> None:
    specs, size = C.layout_region(group.tensors, inline_bytes=16)
    C.validate_group(group.meta, specs, [size])


def test_a_put_whose_routes_do_not_match_its_tokens_is_refused_with_the_reason(server):
    group = make_group("g", n=2, prompt_len=3, response_len=4, routes=(2, 2))
    short = _with_routes(group, "response_routes", group.tensors["response_routes"][:-1])
    other_model = _with_routes(group, "prompt_routes", torch.zeros((6, 3, 2), dtype=torch.uint8))
    wide = _with_routes(group, "prompt_routes", group.tensors["prompt_routes"].to(torch.int16))
    # the server's check of what arrives (a producer that skipped its own)
    with pytest.raises(C.WireError, match=r"`response_routes`.*7.*expected.*8|`response_routes`.*8"):
        _wire_check(short)
    with pytest.raises(C.WireError, match=r"`prompt_routes` is uint8 \[tokens, 3, 2\] but `response_routes`"):
        _wire_check(other_model)
    with pytest.raises(C.WireError, match=r"`prompt_routes` is int16 .* but `response_routes` is uint8"):
        _wire_check(wide)
    # the producer's put refuses them before sending, naming the column, and the queue stays empty
    srv = server()
    producer = QueueClient(srv.address, timeout_s=30)
    try:
        with pytest.raises(
            ValueError, match=r"column `response_routes` has shape \(7, 2, 2\), expected .* 8"
        ):
            producer.put(short)
        for bad in (other_model, wide):
            with pytest.raises(ValueError, match="a group's routes are of one model"):
                producer.put(bad)
        assert producer.put(group)
        assert producer.stats().held_groups == 1
    finally:
        producer.close()
