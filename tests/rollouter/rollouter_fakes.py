"""In-process stand-ins for the rollouter's neighbours, for tests that control every completion order:
a client whose requests finish when the test says so, a queue that records puts, inline rewards."""

from __future__ import annotations

import asyncio

from slipstream.agents.protocol import GenerateOutput
from slipstream.agents.rewards.runner import RewardResult
from slipstream.queue.base import QueueProducer
from slipstream.queue.types import GroupMeta, TrajectoryGroup


class ControlledClient:
    """Each request waits until the test calls :meth:`finish` (or :meth:`abort_running`); its tokens carry
    the client's ``version`` at the time they are produced."""

    def __init__(self, tokens_per_request: int = 3, eos_id: int = 256):
        self.version = 0
        self.tokens = tokens_per_request
        self.eos_id = eos_id
        self.pending: dict[str, asyncio.Future] = {}
        self.requests: list[tuple[str, list[int], int]] = []  # (rid, input_ids, max_new_tokens)
        self.aborted: list[str] = []

    async def generate(self, input_ids, sampling, *, rid=None, session_id=None) -> GenerateOutput:
        self.requests.append((rid, list(input_ids), sampling.max_new_tokens))
        future = asyncio.get_running_loop().create_future()
        self.pending[rid] = future
        try:
            finish, version = await future
        finally:
            self.pending.pop(rid, None)
        n = (
            min(self.tokens, sampling.max_new_tokens)
            if finish != "abort"
            else min(1, sampling.max_new_tokens)
        )
        ids = [65 + (i % 20) for i in range(n)]
        if finish == "stop":
            ids[-1] = self.eos_id
        return GenerateOutput(
            output_ids=ids, logprobs=[-0.25] * n, versions=[version] * n, finish_reason=finish, rid=rid
        )

    def finish(self, rid: str, reason: str = "stop") -> None:
        future = self.pending.get(rid)
        if future is not None and not future.done():
            future.set_result((reason, self.version))  # tokens carry the version at the time they end

    def abort_running(self) -> None:
        for rid in list(self.pending):
            self.finish(rid, "abort")

    async def abort(self, rid: str) -> None:
        self.aborted.append(rid)
        self.finish(rid, "abort")


class RecordingQueue(QueueProducer):
    """Stores put groups (dedup by group id, like the real queue) and hands out drops the test adds."""

    def __init__(self):
        self.groups: dict[str, TrajectoryGroup] = {}
        self.dropped: list[GroupMeta] = []

    async def put(
        self, group: TrajectoryGroup, *, partition: str = "train", timeout_s: float | None = None
    ) -> bool:
        if group.group_id in self.groups:
            return False
        self.groups[group.group_id] = group
        return True

    async def pop_dropped(self, max_groups: int = 1024) -> list[GroupMeta]:
        out, self.dropped = self.dropped[:max_groups], self.dropped[max_groups:]
        return out

    def drop(self, group_id: str) -> None:
        self.dropped.append(self.groups[group_id].meta)


class InlineRewards:
    """Scores on the event loop (no worker processes): 1.0 when the response text is non-empty."""

    def check(self, data_sources):
        pass

    async def score(self, data_source, response, ground_truth, extra_info) -> RewardResult:
        return RewardResult(score=1.0 if response else 0.0)

    def close(self):
        pass


async def settle(rounds: int = 20) -> None:
    """Let every ready task run until the loop is quiet (a few passes of the event loop)."""
    for _ in range(rounds):
        await asyncio.sleep(0)
