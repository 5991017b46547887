"""Arena credits: regions reserved ahead for a same-host producer's next put.

A shared-memory put needs a region to write into before the controller has seen the group, and a separate
"reserve" round trip per put would double the cost of every large put. So each commit asks for the region
of the producer's *next* put in the same round trip; only a producer's first put (or one that outgrows its
credit) pays a reserve round trip. A credit is anonymous space, not a group: admission (dedup, capacity)
happens at commit, when the group's header is known.

Lifecycle of a credit::

    grant (reserve, or a commit's reply) ──► live ──commit──► taken ──stored──► the group's region
                                              ▲                 │ duplicate / queue full / bad header
                                              └──given back─────┘
    live for reserve_timeout_s without a commit (its producer died): expired, region freed

Safety rule, kept by the client: a credit is written only within half its ``ttl_s`` of being received, so
the server can never have freed and re-used a region while its producer still writes into it.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from slipstream.queue import protocol as P
from slipstream.queue.codec import WireError, region_extent
from slipstream.queue.storage import StorageUnit
from slipstream.utils.logging import get_logger

log = get_logger(__name__)


@dataclass(slots=True)
class Held:
    token: int
    unit: int
    offset: int
    nbytes: int
    owner: bytes = b""  # the secret of the client it was granted to: only it may commit or release it


class Credits:
    """Live credits of one server, in deadline order (one fixed ttl, so insertion order)."""

    def __init__(
        self,
        units: Sequence[StorageUnit],
        tokens: Iterator[int],
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._units = [u for u in units if u.arena is not None]
        self._tokens = tokens
        self.ttl_s = ttl_s
        self._clock = clock
        self._live: OrderedDict[int, tuple[float, Held]] = OrderedDict()
        self._next = 0  # round-robin start, to spread producers over the units' arenas

    def __len__(self) -> int:
        return len(self._live)

    def grant(self, nbytes: int, owner: bytes) -> P.Credit | None:
        """A new credit of at least ``nbytes`` for ``owner``, or None when no arena has room now."""
        for i in range(len(self._units)):
            unit = self._units[(self._next + i) % len(self._units)]
            offset = unit.arena.alloc(nbytes)
            if offset is not None:
                self._next = (self._next + i + 1) % len(self._units)
                return self._register(Held(next(self._tokens), unit.index, offset, nbytes, owner))
        return None

    def _register(self, held: Held) -> P.Credit:
        self._live[held.token] = (self._clock() + self.ttl_s, held)
        return P.Credit(held.token, held.unit, held.offset, held.nbytes, self.ttl_s)

    def take(self, token: int, req_id: int, owner: bytes) -> Held:
        entry = self._live.get(token)
        if entry is None or not secrets.compare_digest(entry[1].owner, owner):
            raise WireError(
                "expired", f"arena credit {token} is unknown, used or lapsed (reserve_timeout_s)", req_id
            )
        del self._live[token]
        return entry[1]

    def give_back(self, held: Held) -> P.Credit:
        """Return a taken credit to its producer (with a fresh deadline)."""
        return self._register(held)

    def trim(self, held: Held, specs: Sequence[P.TensorSpec]) -> None:
        """Free the part of a taken credit's region the group does not use."""
        self._arena(held.unit).shrink(held.offset, region_extent(specs))

    def release(self, tokens: Iterable[int], owner: bytes) -> None:
        """Free ``owner``'s credits among ``tokens`` (others' are left alone)."""
        for token in tokens:
            entry = self._live.get(token)
            if entry is not None and secrets.compare_digest(entry[1].owner, owner):
                del self._live[token]
                self._arena(entry[1].unit).free(entry[1].offset)

    def expire(self, now: float) -> float | None:
        """Free credits past their deadline; return the next deadline (None when there is none)."""
        while self._live:
            deadline, held = next(iter(self._live.values()))
            if deadline > now:
                return deadline
            del self._live[held.token]
            log.warning("arena credit %d lapsed unused (its producer stopped?)", held.token)
            self._arena(held.unit).free(held.offset)
        return None

    def _arena(self, unit: int):
        return next(u.arena for u in self._units if u.index == unit)
