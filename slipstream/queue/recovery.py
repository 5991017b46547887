"""Snapshot and restore: what a trainer checkpoint keeps of the queue, and how a restore brings it back.

A snapshot file (:mod:`slipstream.queue.snapshot`) holds every group not yet consumed (ready or leased, with
its payload), the consumed group ids and uids, and the dropped list. Writing one **commits**: the journal
forgets the groups acked before it (the file lists them as consumed) and the server remembers the
snapshot's random id as a point it can roll back to.

A restore does one of two things, chosen by that id:

* **rollback**, for a snapshot this server wrote or restored (the trainer crashed, the server lived on). The
  queue returns to the state the snapshot describes and keeps everything that arrived since:

  - the consumed set becomes the snapshot's (plus, for a snapshot this server restored, whatever it had
    consumed before that restore);
  - every journalled group (acked since the last commit) is ready again, in its original put order, in front
    of groups put later; it is served from its arena region if its journal copy was not written yet, else
    from the journal file;
  - groups the snapshot lists that the server no longer holds (consumed before the last commit, which only
    happens when an older snapshot is restored) are added again from the file, in front;
  - groups ready or leased now stay as they are; a lease stays with its holder until ack or expiry;
  - nothing is duplicated: a group held now is never added again, and a group or uid the snapshot lists as
    consumed is never re-admitted (its journal copy is dropped);
  - the dropped list loses the journalled groups that are ready again, and is otherwise left alone (the
    rollouter that popped the snapshot's dropped groups lives on).

  Restoring a snapshot older than the last commit cannot bring back groups put after it and consumed before
  that commit (their payload is in neither file nor journal); that is logged.
* **merge**, for any other snapshot (the server restarted, or a file from another run): its groups go in
  front of anything put since, order kept; groups already seen are skipped; its consumed set and dropped
  list are added. The snapshot then counts as restored here, so restoring it again later rolls back.

Worked example (a trainer checkpoints at step 10, acks steps 11 and 12, crashes, and resumes from step 10
on the same server)::

    client.snapshot("step_10/queue")    # commits: the journal is emptied
    ... ack(step 11 groups), ack(step 12 groups) ...   # journalled
    client.restore("step_10/queue")     # {"mode": "rollback", "from_journal": 16, ...}
    client.lease(8)                     # step 11's groups again, first

Snapshots are named files in the server's ``queue.snapshot_dir`` (never paths, see
:mod:`slipstream.queue.snapdir`); without that directory both requests are refused.

The controller owns one :class:`Recovery` and hands it the requests; the recovery changes the queue only
through the controller's :class:`~slipstream.queue.state.Ledger`, runs file IO on the controller's
:class:`~slipstream.queue.background.Background` worker, and answers through the ``done`` callback it is
given (the controller then serves lease requests that the restored groups can satisfy).
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from slipstream.queue import protocol as P
from slipstream.queue.background import Background
from slipstream.queue.codec import WireError
from slipstream.queue.journal import Journal
from slipstream.queue.snapdir import SnapshotDir, check_name
from slipstream.queue.snapshot import MAGIC, SnapshotHeader, SnapshotItem, read_snapshot, write_snapshot
from slipstream.queue.state import LEASED, Ledger
from slipstream.utils.logging import get_logger

log = get_logger(__name__)

_COMMITS_KEPT = 16  # snapshot ids this server can roll back to

Summary = dict[str, Any]
# Called on the loop thread when a snapshot or restore finishes, with what makes its summary (or raises the
# job's error): the controller answers the request with it.
Done = Callable[[Callable[[], Summary]], None]


class Recovery:
    """Snapshot and restore of one server's queue (module docstring). Not thread-safe: the loop thread calls
    it; only the file IO runs on the background worker."""

    def __init__(
        self, ledger: Ledger, journal: Journal | None, background: Background, snapshot_dir: str
    ) -> None:
        self.ledger = ledger
        self.journal = journal
        self._background = background
        self._snapshot_dir = snapshot_dir
        # Snapshots this server wrote or restored, newest last, each with what it had consumed beyond the
        # snapshot's own set.
        self._commits: OrderedDict[str, tuple[frozenset[str], frozenset[str]]] = OrderedDict()

    def _snapshots(self, req: P.PathRequest) -> SnapshotDir:
        """Where ``req``'s snapshot lives; WireError when snapshots are off, busy or the name is bad."""
        if not self._snapshot_dir:
            raise WireError(
                "bad_request", "this queue server keeps no snapshots: set queue.snapshot_dir", req.req_id
            )
        if self._background.has_jobs:
            raise WireError("bad_request", "a snapshot or restore is already running", req.req_id)
        check_name(req.path)
        return SnapshotDir(self._snapshot_dir, MAGIC)

    # ------------------------------------------------------------------------------------------ snapshot
    def snapshot(self, req: P.PathRequest, done: Done) -> None:
        """Write every held group (arena regions pinned until written), the consumed ids and the dropped
        list as ``req.path``; once on disk, commit: the journal forgets what the file lists as consumed."""
        snapshots = self._snapshots(req)
        items, pins = [], []
        for group in self.ledger.in_put_order():
            unit = self.ledger.units[group.unit]
            if group.arena_offset >= 0:
                buffers = [unit.arena.buffer(group.arena_offset, group.region_bytes)]
                unit.arena.pin(group.arena_offset)
                pins.append((unit, group.arena_offset))
            else:
                buffers = unit.blobs(group.token)
            items.append(
                SnapshotItem(group.partition, group.state == LEASED, group.meta, group.specs, buffers)
            )
        snapshot_id = secrets.token_hex(8)
        mark = self.journal.seal() if self.journal is not None else 0

        def commit(summary: Summary) -> Summary:
            if self.journal is not None:
                self.journal.commit(mark)  # only once the file is safely on disk
            self._remember(snapshot_id, frozenset(), frozenset())
            return summary

        def written(future: Future) -> None:
            for unit, offset in pins:
                unit.arena.unpin(offset)
            done(lambda: commit(future.result()))

        ledger = self.ledger
        consumed = (sorted(ledger.consumed_groups), sorted(ledger.consumed_uids), list(ledger.dropped))
        self._background.submit(written, write_snapshot, snapshots, req.path, items, *consumed, snapshot_id)

    def _remember(self, snapshot_id: str, groups: frozenset[str], uids: frozenset[str]) -> None:
        """A point this server can roll back to, with what it had consumed beyond the snapshot's own set."""
        if not snapshot_id:
            return
        self._commits[snapshot_id] = (groups, uids)
        self._commits.move_to_end(snapshot_id)
        while len(self._commits) > _COMMITS_KEPT:
            self._commits.popitem(last=False)

    # ------------------------------------------------------------------------------------------- restore
    def restore(self, req: P.PathRequest, done: Done) -> None:
        """Read ``req.path`` on the worker, then roll back to it or merge it in (module docstring)."""
        snapshots = self._snapshots(req)
        self._background.submit(lambda f: done(lambda: self._install(f.result())), read_snapshot, snapshots,
                                req.path)  # fmt: skip

    def _install(self, loaded: tuple[SnapshotHeader, list[bytearray]]) -> Summary:
        header, blobs = loaded
        known = self._commits.get(header.snapshot_id) if header.snapshot_id else None
        if known is None or self.journal is None:
            summary = self._merge(header, blobs)
        else:
            summary = self._rollback(header, blobs, known)
        summary.update(consumed_uids=len(header.consumed_uids), dropped=len(header.dropped))
        return summary

    def _merge(self, header: SnapshotHeader, blobs: list[bytearray]) -> Summary:
        """A snapshot from elsewhere: its groups go in front of anything put since, seen ones skipped."""
        ledger = self.ledger
        extra = (
            frozenset(ledger.consumed_groups.difference(header.consumed_groups)),
            frozenset(ledger.consumed_uids.difference(header.consumed_uids)),
        )
        ledger.merge_consumed(header.consumed_groups, header.consumed_uids, header.dropped)
        restored, skipped = self._add_from_snapshot(header, blobs)
        self._remember(header.snapshot_id, *extra)
        return {"mode": "merge", "groups": restored, "from_snapshot": restored, "from_journal": 0,
                "skipped_seen": skipped}  # fmt: skip

    def _rollback(
        self, header: SnapshotHeader, blobs: list[bytearray], extra: tuple[frozenset[str], frozenset[str]]
    ) -> Summary:
        """Back to a snapshot this server committed: journalled groups ready again, nothing twice."""
        ledger = self.ledger
        if next(reversed(self._commits)) != header.snapshot_id:
            log.warning(
                "restoring snapshot %s, older than this server's last one: groups put after it and consumed "
                "before the last snapshot cannot come back",
                header.snapshot_id,
            )
        ledger.set_consumed(set(header.consumed_groups) | extra[0], set(header.consumed_uids) | extra[1])
        by_part: dict[str, list[str]] = {}
        skipped = 0
        for entry in self.journal.take_all():
            if ledger.is_seen(entry.meta):  # consumed in the snapshot: stays consumed
                skipped += 1
                if entry.arena_offset >= 0:
                    ledger.units[entry.unit].arena.free(entry.arena_offset)
                continue
            ledger.hold_restored(entry.partition, entry.meta, entry.specs, entry.nbytes, entry.unit, entry.seq,
                                 entry.source or [], entry.arena_offset, entry.region_bytes)  # fmt: skip
            by_part.setdefault(entry.partition, []).append(entry.meta.group_id)
        back = {gid for ids in by_part.values() for gid in ids}
        ledger.undrop(back)
        for name, ids in by_part.items():
            ledger.return_to_ready(ledger.part(name), ids)
        restored, seen = self._add_from_snapshot(header, blobs)
        self._remember(header.snapshot_id, *extra)  # the latest point again
        return {"mode": "rollback", "groups": len(back) + restored, "from_journal": len(back),
                "from_snapshot": restored, "skipped_seen": skipped + seen}  # fmt: skip

    def _add_from_snapshot(self, header: SnapshotHeader, blobs: list[bytearray]) -> tuple[int, int]:
        """Snapshot groups not seen here, in front of every held group in file order; (added, skipped)."""
        ledger = self.ledger
        fresh = [
            (snap, blob)
            for snap, blob in zip(header.groups, blobs, strict=True)
            if not ledger.is_seen(snap.meta)
        ]
        first = min((g.seq for g in ledger.groups.values()), default=0)
        by_part: dict[str, list[str]] = {}
        for i, (snap, blob) in enumerate(fresh):
            unit = P.unit_for(snap.meta.group_id, len(ledger.units))
            ledger.hold_restored(snap.partition, snap.meta, snap.tensors, snap.nbytes, unit,
                                 first - len(fresh) + i, [blob])  # fmt: skip
            by_part.setdefault(snap.partition, []).append(snap.meta.group_id)
        for name, ids in by_part.items():
            ledger.return_to_ready(ledger.part(name), ids)
        return len(fresh), len(header.groups) - len(fresh)
