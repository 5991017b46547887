"""The staleness gate: admission control that bounds how far generation may run ahead of training.

A group is *admitted* when its generation starts. The gate admits a new group only while

    admitted < budget(v) = floor((v + sync_every * (1 + staleness_threshold)) * batch_groups)

where ``v`` is the latest weight version pushed to the servers. Versions count trainer steps (design.md
§3: a version is the trainer's step at publish time), so ``v * batch_groups`` groups have been consumed
by the time version ``v`` is pushed, and the rollouter may be at most ``sync_every * (1 + s)`` steps'
worth of groups ahead of that. This is verl's ``(1 + s) · batch · sync_every`` budget (recomputed from
the version instead of reset at each sync, so nothing depends on when the reset happens) and AReaL's
``(η + v + 1) · B`` capacity.

* ``staleness_threshold = 0, sync_every = 1`` is the sync mode: exactly one batch per version.
* A group the trainer dropped as too stale was admitted but never trained on: :meth:`refund` returns
  its unit, so generating its prompt again does not consume budget twice.
* :meth:`close` stops admission until the next :meth:`set_version` (``partial_rollout = off``: the
  controller drains in-flight groups before a weight push).

Invariant (tested with hypothesis over random arrival, completion and version orders):
``admitted <= budget(version)`` at every instant, where ``admitted`` is net of refunds.

Worked example (batch_groups 4, sync_every 1, threshold 0.5)::

    gate = StalenessGate(batch_groups=4, sync_every=1, staleness_threshold=0.5)
    gate.budget               # 6: one batch for version 0 plus half a batch ahead
    [gate.try_admit() for _ in range(7)]   # six True, then False
    gate.set_version(1)       # budget 10: four more may start
    gate.refund(1)            # a dropped group's unit comes back
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slipstream.rollouter.settings import RollouterSettings


class StalenessGate:
    """Counts admitted groups against the version-dependent budget; asyncio waiters for admission.

    Lifecycle: build once per run; ``await admit()`` (or ``try_admit()``) before starting each group;
    ``set_version(v)`` after every weight push; ``refund(k)`` for groups dropped as stale;
    ``shutdown()`` makes every waiter return False. Use from one event loop.
    """

    def __init__(
        self, *, batch_groups: int, sync_every: int, staleness_threshold: float, version: int = 0
    ) -> None:
        if batch_groups < 1 or sync_every < 1 or staleness_threshold < 0:
            raise ValueError(
                "the gate needs batch_groups >= 1, sync_every >= 1 and staleness_threshold >= 0, got "
                f"{batch_groups}, {sync_every}, {staleness_threshold}"
            )
        self.batch_groups = batch_groups
        self.sync_every = sync_every
        self.staleness_threshold = staleness_threshold
        self.version = version
        self.admitted = 0
        self.refunded = 0
        self.closed = False
        self._shut = False
        self._waiters: list[asyncio.Future[None]] = []

    @classmethod
    def from_settings(cls, settings: RollouterSettings) -> StalenessGate:
        """From the rollouter's settings (their ``async`` values hold the mode's preset already)."""
        return cls(
            batch_groups=settings.batch_groups,
            sync_every=settings.sync_every,
            staleness_threshold=settings.staleness_threshold,
        )

    def budget_at(self, version: int) -> int:
        # The epsilon keeps e.g. (0 + 1 * 1.1) * 10 = 11.000000000000002 from flooring below 11.
        return math.floor(
            (version + self.sync_every * (1 + self.staleness_threshold)) * self.batch_groups + 1e-9
        )

    @property
    def budget(self) -> int:
        return self.budget_at(self.version)

    @property
    def available(self) -> int:
        """Groups that may start now."""
        return 0 if self.closed or self._shut else max(0, self.budget - self.admitted)

    def try_admit(self) -> bool:
        if self.available <= 0:
            return False
        self.admitted += 1
        return True

    async def admit(self, timeout_s: float | None = None) -> bool:
        """Wait until a group may start and count it; False after :meth:`shutdown` or on timeout."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while not self._shut:
            if self.try_admit():
                return True
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                remaining = None if deadline is None else max(0.0, deadline - loop.time())
                await asyncio.wait_for(waiter, remaining)
            except TimeoutError:
                return False
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        return False

    def refund(self, groups: int = 1) -> None:
        """Return the units of ``groups`` admitted groups that will never be trained on (dropped, failed)."""
        if groups < 0 or groups > self.admitted:
            raise ValueError(f"cannot refund {groups} groups: only {self.admitted} are admitted")
        self.admitted -= groups
        self.refunded += groups
        self._notify()

    def set_version(self, version: int) -> None:
        """A weight push: the budget grows with the version (never shrinks) and admission reopens."""
        self.version = max(self.version, version)
        self.closed = False
        self._notify()

    def set_threshold(self, staleness_threshold: float) -> None:
        """A new ``staleness_threshold`` from now on (the autotune controller's): the budget follows it, up or
        down; groups already admitted stay admitted."""
        if staleness_threshold < 0:
            raise ValueError(f"staleness_threshold must be >= 0, got {staleness_threshold}")
        self.staleness_threshold = staleness_threshold
        self._notify()

    def close(self) -> None:
        """Admit nothing until the next :meth:`set_version`."""
        self.closed = True

    def shutdown(self) -> None:
        self._shut = True
        self._notify()

    def state_dict(self) -> dict[str, int]:
        return {"admitted": self.admitted, "refunded": self.refunded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.admitted = int(state["admitted"])
        self.refunded = int(state.get("refunded", 0))
        self._notify()

    def _notify(self) -> None:
        """Wake every waiter to re-check (they run on the event loop; this may be called from it too)."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
