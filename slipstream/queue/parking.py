"""Parked requests of a queue server: puts waiting for room and leases waiting for groups.

No handler of the controller waits. A request that cannot be answered yet is parked here with its own
deadline and answered the moment it can be (the controller decides when), or with a timeout when the deadline
passes; so readiness is pushed to waiting clients, never polled or slept on.

Both kinds share one timer heap. An answered request is only marked ``done`` (finding it in its line or in the
heap would cost a scan); it leaves its line when it reaches the front, and the heap when its deadline comes,
or earlier when answered requests pile up (:meth:`Parking._compact`, so that many short waits behind a long
one do not grow without bound). The bounds (``max_parked_puts``, ``max_parked_put_bytes``,
``max_waiting_leases``) count only requests still waiting.

Worked example (what the controller does with a put that meets a full queue)::

    waiter = Waiter(reply_to, req, deadline, nbytes, on_admit, on_duplicate, on_timeout)
    parking.park_put(waiter)             # or WireError("queue_full") beyond the bounds
    ... an ack frees room: parking.first_put() is waiter → parking.settle(waiter); waiter.on_admit()
    ... or its deadline passes: ("put", waiter) in parking.due(now) → settle, QueueFull reply
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Any

from slipstream.queue.codec import WireError
from slipstream.queue.config import QueueConfig
from slipstream.queue.state import Waiter

_Timer = tuple[
    float, int, str, Any
]  # (deadline, tie-break, "put" | "wait", the waiter | (partition, waiter))


def _waiter_of(timer: _Timer) -> Waiter:
    return timer[3][1] if timer[2] == "wait" else timer[3]


class Parking:
    """The waiting requests of one server, in arrival order per line, and their deadlines. Not thread-safe."""

    def __init__(self, cfg: QueueConfig) -> None:
        self._cfg = cfg
        self._puts: deque[Waiter] = deque()  # one line: puts are admitted first come, first served
        self._leases: dict[str, deque[Waiter]] = {}  # one line per partition
        self._timers: list[_Timer] = []
        self._timer_seq = itertools.count()
        self.parked_puts = 0  # puts still waiting, and the frame bytes they hold
        self.parked_bytes = 0
        self.waiting_leases = 0  # leases still waiting

    # ----------------------------------------------------------------------------------------- puts
    def park_put(self, waiter: Waiter) -> None:
        """Park a put at the end of the line; a queue_full error beyond ``max_parked_puts`` or
        ``max_parked_put_bytes``."""
        cfg = self._cfg
        if (
            self.parked_puts >= cfg.max_parked_puts
            or self.parked_bytes + waiter.frame_bytes > cfg.max_parked_put_bytes
        ):
            raise WireError(
                "queue_full",
                f"queue full and {self.parked_puts} put(s) holding {self.parked_bytes} bytes already wait for "
                f"room (queue.max_parked_puts={cfg.max_parked_puts}, "
                f"max_parked_put_bytes={cfg.max_parked_put_bytes}); retry later",
            )
        self._puts.append(waiter)
        self.parked_puts += 1
        self.parked_bytes += waiter.frame_bytes
        self._timer(waiter.deadline, "put", waiter)

    def first_put(self) -> Waiter | None:
        """The put at the front of the line that still waits (answered ones in front are dropped)."""
        while self._puts and self._puts[0].done:
            self._puts.popleft()
        return self._puts[0] if self._puts else None

    # --------------------------------------------------------------------------------------- leases
    def line(self, partition: str) -> deque[Waiter]:
        """The leases waiting for groups of ``partition``, in arrival order (answered ones included until
        they reach the front)."""
        line = self._leases.get(partition)
        if line is None:
            line = self._leases[partition] = deque()
        return line

    @property
    def leases_full(self) -> bool:
        return self.waiting_leases >= self._cfg.max_waiting_leases

    def park_lease(self, partition: str, waiter: Waiter) -> None:
        """Join the line of ``partition`` (the caller checked :attr:`leases_full`); timed by :meth:`time_lease`
        once it is known not to be answered at once."""
        self.line(partition).append(waiter)
        self.waiting_leases += 1

    def time_lease(self, partition: str, waiter: Waiter) -> None:
        self._timer(waiter.deadline, "wait", (partition, waiter))

    # -------------------------------------------------------------------------------------- answers
    def settle(self, waiter: Waiter) -> bool:
        """Mark a parked request answered or abandoned (False if it already was); frees its share of the
        bounds."""
        if waiter.done:
            return False
        waiter.done = True
        if waiter.is_put:
            self.parked_puts -= 1
            self.parked_bytes -= waiter.frame_bytes
        else:
            self.waiting_leases -= 1
        return True

    def due(self, now: float) -> Iterator[tuple[str, Any]]:
        """The timers whose deadline has come, removed: ``("put", waiter)`` or ``("wait", (partition,
        waiter))``; the waiter may have been answered since."""
        while self._timers and self._timers[0][0] <= now:
            _, _, kind, key = heapq.heappop(self._timers)
            yield kind, key

    def next_deadline(self) -> float | None:
        return self._timers[0][0] if self._timers else None

    def forget(self, sock: Any) -> list[Waiter]:
        """Settle every request of a connection that closed (they can never be answered); returns its puts,
        whose ``on_timeout`` the caller runs."""
        for line in self._leases.values():
            for waiter in line:
                if waiter.reply_to[0] is sock:
                    self.settle(waiter)
        return [w for w in self._puts if w.reply_to[0] is sock and self.settle(w)]

    # ------------------------------------------------------------------------------------- internals
    def _timer(self, deadline: float, kind: str, key: Any) -> None:
        heapq.heappush(self._timers, (deadline, next(self._timer_seq), kind, key))
        if len(self._timers) > 4 * (self.parked_puts + self.waiting_leases) + 1024:
            self._compact()

    def _compact(self) -> None:
        """Drop answered requests from the timers and the lines."""
        self._timers = [t for t in self._timers if not _waiter_of(t).done]
        heapq.heapify(self._timers)
        self._puts = deque(w for w in self._puts if not w.done)
        for partition, line in self._leases.items():
            self._leases[partition] = deque(w for w in line if not w.done)
