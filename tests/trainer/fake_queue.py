"""An in-process stand-in for the trainer's side of the queue (a :class:`QueueConsumer`: the same
lease/ack/nack/snapshot/restore contract), and a reference collate in the documented packed layout, for
trainer tests that need no server process."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch
from tensordict import TensorDict

from slipstream.queue.base import Lease, QueueConsumer
from slipstream.queue.types import Trajectory, TrajectoryGroup


@dataclass
class FakeQueue(QueueConsumer):
    ready: list[TrajectoryGroup] = field(default_factory=list)
    leased: dict[str, Lease] = field(default_factory=dict)
    acked: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    _ids: itertools.count = field(default_factory=itertools.count)
    # Like the server's queue.snapshot_dir: snapshot names resolve inside it.
    snapshot_dir: Path = Path(".")

    def put(self, group: TrajectoryGroup) -> None:
        self.ready.append(group)

    def lease(
        self,
        n_groups: int,
        *,
        partition: str = "train",
        timeout_s: float | None = None,
        min_groups: int | None = None,
        consumer_version: int | None = None,
    ) -> Lease | None:
        if not self.ready:
            return None
        take, self.ready = self.ready[:n_groups], self.ready[n_groups:]
        lease = Lease(f"L{next(self._ids)}", take, math.inf)
        self.leased[lease.lease_id] = lease
        return lease

    def ack(self, lease: Lease | str, *, dropped: Sequence[str] = ()) -> None:
        held = self.leased.pop(lease if isinstance(lease, str) else lease.lease_id)
        self.acked.extend(g.group_id for g in held.groups if g.group_id not in set(dropped))
        self.dropped.extend(dropped)

    def nack(self, lease: Lease | str) -> None:
        self.ready = self.leased.pop(lease if isinstance(lease, str) else lease.lease_id).groups + self.ready

    def snapshot(self, name: str) -> dict:
        groups = [t for lease in self.leased.values() for g in lease.groups for t in g.to_trajectories()]
        groups += [t for g in self.ready for t in g.to_trajectories()]
        (self.snapshot_dir / name).write_bytes(msgspec.json.encode(groups))
        return {"groups": len(self.ready) + sum(len(lease.groups) for lease in self.leased.values())}

    def restore(self, name: str) -> dict:
        trajs = msgspec.json.decode((self.snapshot_dir / name).read_bytes(), type=list[Trajectory])
        by_group: dict[str, list[Trajectory]] = {}
        for t in trajs:
            by_group.setdefault(t.group_id, []).append(t)
        self.ready = [TrajectoryGroup.from_trajectories(ts) for ts in by_group.values()]
        self.leased = {}
        return {"groups": len(self.ready)}


def make_group(gid: str, n: int, *, version: int, vocab: int = 200, seed: int = 0) -> TrajectoryGroup:
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(n):
        p, r = int(torch.randint(2, 6, (1,), generator=g)), int(torch.randint(1, 8, (1,), generator=g))
        trajs.append(
            Trajectory(
                uid=f"{gid}-{i}",
                group_id=gid,
                prompt_ids=torch.randint(0, vocab, (p,), generator=g).tolist(),
                response_ids=torch.randint(0, vocab, (r,), generator=g).tolist(),
                loss_mask=[1] * r,
                logprobs=(-torch.rand(r, generator=g) * 4).tolist(),
                versions=[version] * r,
                reward=float(i % 2),
            )
        )
    return TrajectoryGroup.from_trajectories(trajs)


def collate(groups: list[TrajectoryGroup]) -> TensorDict:
    ids, pos, mask, old, ver, plen, rlen, rew, minv, gidx, uids, gids = ([] for _ in range(12))
    for gi, group in enumerate(groups):
        for t in group.to_trajectories():
            p, r = len(t.prompt_ids), len(t.response_ids)
            ids += t.prompt_ids + t.response_ids
            pos += list(range(p + r))
            mask += [False] * p + [bool(x) for x in t.loss_mask]
            old += [0.0] * p + t.logprobs
            ver += [-1] * p + t.versions
            plen.append(p), rlen.append(r), rew.append(t.reward), minv.append(t.min_version), gidx.append(gi)
            uids.append(t.uid), gids.append(t.group_id)
    lengths = torch.tensor([a + b for a, b in zip(plen, rlen, strict=True)])
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    td = TensorDict(
        {
            "input_ids": torch.tensor(ids, dtype=torch.int64),
            "position_ids": torch.tensor(pos, dtype=torch.int64),
            "loss_mask": torch.tensor(mask),
            "old_logprobs": torch.tensor(old, dtype=torch.float32),
            "versions": torch.tensor(ver, dtype=torch.int32),
            "cu_seqlens": cu,
            "prompt_lens": torch.tensor(plen, dtype=torch.int32),
            "response_lens": torch.tensor(rlen, dtype=torch.int32),
            "rewards": torch.tensor(rew, dtype=torch.float32),
            "min_versions": torch.tensor(minv, dtype=torch.int32),
            "group_index": torch.tensor(gidx, dtype=torch.int64),
        },
        batch_size=[],
    )
    td.set_non_tensor("uids", uids)
    td.set_non_tensor("group_ids", gids)
    return td
