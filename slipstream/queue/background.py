"""Work the server loop hands off and checks back on, so that no handler ever waits.

Two kinds: file IO for snapshot/restore, which runs on one worker thread; and zero-copy sends of arena
regions, whose regions stay pinned until ZeroMQ's tracker says the bytes are out. Neither completion wakes
the loop's poller, so while any is outstanding the loop looks again every couple of milliseconds
(:attr:`busy`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class Background:
    """Outstanding jobs and tracked sends of one server; used only on the loop thread."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="queue-io")
        self._jobs: list[tuple[Future, Callable[[Future], None]]] = []
        self._sends: list[tuple[Any, Callable[[], None]]] = []

    @property
    def busy(self) -> bool:
        return bool(self._jobs or self._sends)

    @property
    def has_jobs(self) -> bool:
        return bool(self._jobs)

    def submit(self, on_done: Callable[[Future], None], fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the worker thread; ``on_done(future)`` later runs on the loop thread."""
        self._jobs.append((self._executor.submit(fn, *args), on_done))

    def track(self, tracker: Any, on_sent: Callable[[], None]) -> None:
        """Call ``on_sent`` once ZeroMQ no longer reads the buffer behind ``tracker``."""
        self._sends.append((tracker, on_sent))

    def poll(self) -> None:
        """Run the callbacks of whatever has finished."""
        if self._sends:
            sent = [cb for tracker, cb in self._sends if tracker.done]
            self._sends = [(t, cb) for t, cb in self._sends if not t.done]
            for callback in sent:
                callback()
        if self._jobs:
            done = [(f, cb) for f, cb in self._jobs if f.done()]
            self._jobs = [(f, cb) for f, cb in self._jobs if not f.done()]
            for future, callback in done:
                callback(future)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
