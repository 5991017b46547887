"""Collation of hand-built groups into the packed batch layout the trainer builds on."""

from __future__ import annotations

import pytest
import torch

from slipstream.queue.batch import STANDARD_KEYS, collate
from slipstream.queue.testing import make_group
from slipstream.queue.types import Trajectory, TrajectoryGroup


def _traj(uid, gid, prompt, response, mask, versions, logprobs=None, reward=0.0):
    logprobs = logprobs if logprobs is not None else [-0.1 * (i + 1) for i in range(len(response))]
    return Trajectory(uid=uid, group_id=gid, prompt_ids=prompt, response_ids=response, loss_mask=mask,
                      logprobs=logprobs, versions=versions, reward=reward)  # fmt: skip


def _docstring_groups():
    g0 = TrajectoryGroup.from_trajectories(
        [
            _traj("a", "g0", [1, 2], [5, 6], [1, 1], [3, 4], [-0.5, -0.25], reward=1.0),
            _traj("b", "g0", [1, 2], [7], [1], [3], [-1.0], reward=0.0),
        ]
    )
    g1 = TrajectoryGroup.from_trajectories(
        [_traj("c", "g1", [9], [8, 0, 4], [1, 0, 1], [4, 4, 4], [-2.0, 0.0, -3.0], 0.5)]
    )
    return [g0, g1]


def test_worked_example_of_the_docstring():
    batch = collate(_docstring_groups())
    F, T = False, True
    assert batch["input_ids"].tolist() == [1, 2, 5, 6, 1, 2, 7, 9, 8, 0, 4]
    assert batch["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3]
    assert batch["loss_mask"].tolist() == [F, F, T, T, F, F, T, F, T, F, T]
    assert batch["versions"].tolist() == [-1, -1, 3, 4, -1, -1, 3, -1, 4, 4, 4]
    assert batch["old_logprobs"].tolist() == [0, 0, -0.5, -0.25, 0, 0, -1.0, 0, -2.0, 0.0, -3.0]
    assert batch["cu_seqlens"].tolist() == [0, 4, 7, 11]
    assert batch["prompt_lens"].tolist() == [2, 2, 1]
    assert batch["response_lens"].tolist() == [2, 1, 3]
    assert batch["rewards"].tolist() == [1.0, 0.0, 0.5]
    assert batch["min_versions"].tolist() == [3, 3, 4]
    assert batch["group_index"].tolist() == [0, 0, 1]
    assert batch["uids"] == ["a", "b", "c"]
    assert batch["group_ids"] == ["g0", "g0", "g1"]


def test_dtypes_shapes_and_keys():
    batch = collate([make_group("x", n=3, prompt_len=5, response_len=7), make_group("y", n=2)])
    assert batch.batch_size == torch.Size([])
    assert set(batch.keys()) == set(STANDARD_KEYS)
    want = {"input_ids": torch.int64, "position_ids": torch.int64, "loss_mask": torch.bool,
            "old_logprobs": torch.float32, "versions": torch.int32, "cu_seqlens": torch.int32,
            "prompt_lens": torch.int32, "response_lens": torch.int32, "rewards": torch.float32,
            "min_versions": torch.int32, "group_index": torch.int64}  # fmt: skip
    for key, dtype in want.items():
        assert batch[key].dtype == dtype, key
    n, t = 5, 3 * (5 + 7) + 2 * (3 + 4)
    assert batch["input_ids"].shape == (t,) and batch["cu_seqlens"].shape == (n + 1,)
    assert batch["rewards"].shape == (n,) and len(batch["uids"]) == n


def test_batch_owns_its_memory():
    groups = [make_group("x", n=2)]
    batch = collate(groups)
    groups[0].tensors["response_ids"].fill_(0)
    groups[0].tensors["prompt_ids"].fill_(0)
    assert batch["input_ids"].tolist()[:7] == [1, 2, 3, 100, 100, 100, 100]


def test_extra_response_columns_travel_token_level():
    group = make_group("x", n=2, prompt_len=1, response_len=2, payload=3)
    batch = collate([group])
    assert batch["payload"].shape == (6, 3)
    assert batch["payload"][0].tolist() == [0, 0, 0]  # prompt position
    assert torch.equal(batch["payload"][1:3], group.tensors["payload"][:2])
    assert torch.equal(batch["payload"][4:6], group.tensors["payload"][2:4])


def test_empty_responses_and_errors():
    group = TrajectoryGroup.from_trajectories([_traj("a", "g", [1, 2], [], [], [])])
    batch = collate([group])
    assert batch["input_ids"].tolist() == [1, 2] and batch["loss_mask"].tolist() == [False, False]
    with pytest.raises(ValueError, match="at least one group"):
        collate([])
    bad = make_group("x")
    bad.tensors["rewards"] = torch.zeros(8)
    with pytest.raises(ValueError, match="`rewards` would shadow"):
        collate([bad])
