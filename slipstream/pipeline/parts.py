"""The run's parts as the controller holds them: :class:`Parts` (every actor's typed handle and the two
versions) and a :class:`ServerPool` per kind of server (the rollout servers, the judge servers of
``reward.service.launch``), each the one writer of its servers' handles, URLs and states.

Who writes what: the launcher adds each server to its pool and records the URL it first answers at; the
restart flow (``health.HostPool``) marks a dead server down, replaces its host actor when that died, and
records the URL it serves at again; the launcher writes the other handles, the step driver the versions.
The rest of the controller only reads (``pool.urls``, ``pool.live_urls()``, ``pool.hosts()``).

Worked example::

    pool = ServerPool()
    pool.add(handle)                         # server 0, started by the run; not answering yet
    pool.serving(0, "http://10.0.0.5:30000")
    pool.mark_down(0)                        # it died: out of the balancer while it restarts
    pool.live_urls()                         # []
    pool.serving(0, "http://10.0.0.5:30007") # back, on a new port
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slipstream.pipeline.handles import QueueHandle, RolloutHandle, ServerHandle, TrainerGroup

if TYPE_CHECKING:
    from slipstream.queue.client import QueueClient


class NotStarted:
    """Stands for a part's handle until the launcher starts the part: falsy (``if parts.trainer:``), and any
    use names the part, so a call made too early says what is missing instead of failing on None."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __bool__(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"{self.what} has not been started (.{name} used before Launcher.start_parts)")


def _not_started(what: str) -> Any:
    return field(default_factory=lambda: NotStarted(what))


@dataclass(frozen=True)
class ServerSlot:
    """One server of a pool, as it stands: ``handle`` is its host actor's (None for a server given by URL,
    which the run neither started nor restarts), ``url`` where it serves now ("" until it first answers; a
    restart changes it), ``down`` whether it died and is being restarted (out of the balancer, the publisher
    or the reward service meanwhile). Frozen: only its :class:`ServerPool` makes a new one."""

    handle: ServerHandle | None
    url: str = ""
    down: bool = False


class ServerPool:
    """The servers of one kind, by index (module docstring): every write goes through its methods."""

    def __init__(self) -> None:
        self._slots: list[ServerSlot] = []

    # ------------------------------------------------------------------ writes
    def add(self, handle: ServerHandle | None, url: str = "") -> int:
        """One more server (its host's handle, or None and its URL for a server given by URL); its index."""
        self._slots.append(ServerSlot(handle, url))
        return len(self._slots) - 1

    def serving(self, index: int, url: str) -> None:
        """Server ``index`` answers at ``url`` (after its first start or a restart)."""
        self._slots[index] = dataclasses.replace(self._slots[index], url=url, down=False)

    def mark_down(self, index: int) -> None:
        """Server ``index`` died and is being restarted."""
        self._slots[index] = dataclasses.replace(self._slots[index], down=True)

    def replace_host(self, index: int, handle: ServerHandle) -> None:
        """Server ``index`` restarts on a new host actor (the old one died)."""
        self._slots[index] = dataclasses.replace(self._slots[index], handle=handle)

    # ------------------------------------------------------------------ reads
    def __len__(self) -> int:
        return len(self._slots)

    def __getitem__(self, index: int) -> ServerSlot:
        return self._slots[index]

    def __iter__(self) -> Iterator[ServerSlot]:
        return iter(list(self._slots))

    @property
    def urls(self) -> list[str]:
        """Every server's current URL, in index order (a server restarting keeps its last one)."""
        return [s.url for s in self._slots]

    def live_urls(self) -> list[str]:
        """The URLs of the servers not down."""
        return [s.url for s in self._slots if not s.down]

    @property
    def down(self) -> set[int]:
        """Indices of the servers being restarted."""
        return {i for i, s in enumerate(self._slots) if s.down}

    def hosts(self, *, down: bool | None = None) -> list[ServerHandle]:
        """The host handles of the servers the run started: all, or those (not) ``down``."""
        return [s.handle for s in self._slots if s.handle is not None and (down is None or s.down == down)]


@dataclass
class Parts:
    """The run's actors, as typed handles, and where they are: ``servers`` the rollout servers,
    ``judges`` the judge servers of ``reward.service.launch`` (never pushed to); ``version`` is the trainer's
    weight version and ``published`` the newest version the servers serve (a restarted trainer may be behind
    it). A handle is a :class:`NotStarted` until the launcher starts its part."""

    queue: QueueHandle = _not_started("the queue server")
    queue_client: QueueClient = _not_started("the controller's queue client")
    queue_address: str = ""
    servers: ServerPool = field(default_factory=ServerPool)
    judges: ServerPool = field(default_factory=ServerPool)
    trainer: TrainerGroup = _not_started("the trainer ranks")
    rollouter: RolloutHandle = _not_started("the rollouter")
    rollouter_started: bool = False
    version: int = 0
    published: int = 0


__all__ = ["NotStarted", "Parts", "ServerPool", "ServerSlot"]
