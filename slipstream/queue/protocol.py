"""Wire messages of the TransferQueue: one type byte, one msgspec header, then raw payload frames.

Every message on every queue socket is a ZeroMQ multipart message::

    [type byte][msgpack header][buffer 0][buffer 1]...

(a ROUTER adds the peer identity in front). The type byte picks the header's Struct, which a typed decoder
reads, so a header that does not match its schema is a clear error, never a half-read dict; nothing is ever
pickled. Headers are ``array_like`` (positional arrays, no field names on the wire), ``omit_defaults`` and
``gc=False`` Structs whose first field is always ``req_id``: clients keep many requests in flight on one
long-lived socket and match replies by it.

Replies carry ``OK`` (the header type follows from the request) or ``ERROR`` (:class:`ErrorReply`).

Which socket takes what: the controller socket takes the metadata requests (HELLO, RESERVE, COMMIT, LEASE,
ACK, NACK, POP_DROPPED, STATS, SNAPSHOT, RESTORE, PING, QUARANTINE); each storage unit's socket takes the
data requests (PUT, FETCH, PING). Payload bytes never touch the controller socket. Same-host clients send the
controller's requests (and puts without payload frames) over the direct channel instead
(:mod:`slipstream.queue.direct`: the same type byte and header, length-prefixed on a Unix socket), and reach
the units over ``ipc://``.
"""

from __future__ import annotations

import enum
import zlib
from typing import Any

import msgspec

from slipstream.queue.types import GroupMeta


class MsgType(enum.IntEnum):
    HELLO = 0x01
    PUT = 0x02
    RESERVE = 0x03
    COMMIT = 0x04
    LEASE = 0x05
    FETCH = 0x06
    ACK = 0x07
    NACK = 0x08
    POP_DROPPED = 0x09
    STATS = 0x0A
    SNAPSHOT = 0x0B
    RESTORE = 0x0C
    PING = 0x0D
    QUARANTINE = 0x0E
    OK = 0x80
    ERROR = 0xFF


# Request types each socket accepts.
CONTROLLER_TYPES = frozenset(
    {
        MsgType.HELLO,
        MsgType.RESERVE,
        MsgType.COMMIT,
        MsgType.LEASE,
        MsgType.ACK,
        MsgType.NACK,
        MsgType.POP_DROPPED,
        MsgType.STATS,
        MsgType.SNAPSHOT,
        MsgType.RESTORE,
        MsgType.PING,
        MsgType.QUARANTINE,
    }
)
UNIT_TYPES = frozenset({MsgType.PUT, MsgType.FETCH, MsgType.PING})
# The direct channel of same-host clients: control requests, and puts whose tensors all ride inline.
DIRECT_TYPES = CONTROLLER_TYPES | {MsgType.PUT}


def unit_for(group_id: str, num_units: int) -> int:
    """The storage unit a group's socket put goes to, and its preferred arena (stable across processes)."""
    return zlib.crc32(group_id.encode()) % num_units


class _Wire(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    pass


class Envelope(msgspec.Struct, array_like=True):
    """The leading field of every header; read alone to route a reply (trailing fields are ignored)."""

    req_id: int


class TensorSpec(_Wire):
    """Where one named tensor of a group lives.

    ``frame >= 0``: in buffer ``frame`` of the group's storage, starting ``offset`` bytes in (a socket frame,
    an arena region or a restored blob); ``frame == -1``: inline, its bytes in ``data``.
    """

    name: str
    dtype: str
    shape: list[int]
    frame: int = -1
    offset: int = 0
    data: bytes = b""


# ------------------------------------------------------------------------------------------------ requests
class HelloRequest(_Wire):
    req_id: int


class PutRequest(_Wire):
    """A whole group over the socket (to a storage unit); tensor buffers follow as frames."""

    req_id: int
    partition: str
    meta: GroupMeta
    tensors: list[TensorSpec]
    # Seconds to wait on back-pressure before QueueFull.
    timeout_s: float


class ReserveRequest(_Wire):
    """Ask for an arena region of ``nbytes`` (a *credit* for a same-host client's next put); ``nbytes`` 0
    only gives back the credits in ``release`` (only the requester's own: see ``owner``)."""

    req_id: int
    nbytes: int
    release: list[int] = []
    # A random secret of the requesting client (16 bytes, never shown). Leases and credits are bound to the
    # owner that got them: another client cannot ack, nack, fetch, quarantine, commit or release them.
    owner: bytes = b""


class CommitRequest(_Wire):
    """The group is written into the region of credit ``token``: admit it (dedup, capacity) and make it
    ready; ``next_nbytes`` asks for the credit of the next put in the same round trip."""

    req_id: int
    token: int
    partition: str
    meta: GroupMeta
    # Offsets are within the credit's region (frame 0).
    tensors: list[TensorSpec]
    timeout_s: float
    next_nbytes: int = 0
    release: list[int] = []
    owner: bytes = b""


class LeaseRequest(_Wire):
    req_id: int
    partition: str
    n_groups: int
    min_groups: int
    timeout_s: float
    consumer_version: int | None = None
    owner: bytes = b""


class FetchRequest(_Wire):
    """Buffers of leased groups stored as frames (or of arena groups, for clients without the arena)."""

    req_id: int
    lease_id: str
    tokens: list[int]
    owner: bytes = b""


class AckRequest(_Wire):
    req_id: int
    lease_id: str
    dropped: list[str] = []
    owner: bytes = b""


class NackRequest(_Wire):
    req_id: int
    lease_id: str
    owner: bytes = b""


class QuarantineRequest(_Wire):
    """Groups of a lease its consumer could not unpack: taken out of the lease and never delivered again
    (they count as consumed, so a put of the same ids is refused too)."""

    req_id: int
    lease_id: str
    group_ids: list[str]
    reason: str = ""
    owner: bytes = b""


class PopDroppedRequest(_Wire):
    req_id: int
    max_groups: int


class StatsRequest(_Wire):
    req_id: int


class PathRequest(_Wire):
    """SNAPSHOT or RESTORE: ``path`` names a snapshot inside the server's ``snapshot_dir`` (``step_10/queue``;
    never an absolute path or one with ``..``, see :mod:`slipstream.queue.snapdir`)."""

    req_id: int
    path: str


class PingRequest(_Wire):
    req_id: int


# ------------------------------------------------------------------------------------------------- replies
class UnitInfo(_Wire):
    port: int
    # /proc/<pid>/fd/<n> of the unit's memfd arena, "" when the unit has none.
    shm_path: str = ""
    shm_size: int = 0
    # The unit socket's Unix domain endpoint for same-host clients ("" when not served).
    ipc: str = ""


class HelloReply(_Wire):
    req_id: int
    # Random per server; also written at the head of every arena, so a client that opens a path of the same
    # name in another container or host sees a mismatch and falls back to the socket.
    nonce: bytes
    units: list[UnitInfo]
    max_message_bytes: int
    inline_tensor_bytes: int
    shm_min_group_bytes: int
    # How long a put with no timeout of its own waits on back-pressure.
    put_timeout_s: float
    # The direct channel ("unix:@<abstract name>", see direct.py): a client that can reach it (it is on this
    # host) sends its control requests there, and uses the units' ipc endpoints. "" when not served.
    direct: str = ""


class PutReply(_Wire):
    req_id: int
    # False: the group id or a uid was already seen; nothing was stored.
    stored: bool


class Credit(_Wire):
    """An arena region reserved for one client's next put, valid for ``ttl_s`` seconds unless committed."""

    token: int
    unit: int
    offset: int
    nbytes: int
    ttl_s: float


class ReserveReply(_Wire):
    req_id: int
    # None: the arena has no room right now; put over the socket.
    credit: Credit | None = None


class CommitReply(_Wire):
    req_id: int
    # False: the group id or a uid was already seen; the credit stays the client's (returned again).
    stored: bool
    credit: Credit | None = None


class LeasedGroup(_Wire):
    meta: GroupMeta
    tensors: list[TensorSpec]
    unit: int
    token: int
    # Byte offset and length of the group's region in the unit's arena (offset -1: its buffers must be
    # fetched from the unit instead).
    arena_offset: int = -1
    region_bytes: int = 0
    num_buffers: int = 0


class LeaseReply(_Wire):
    req_id: int
    # Empty when the wait timed out.
    lease_id: str = ""
    ttl_s: float = 0.0
    groups: list[LeasedGroup] = []


class FetchReply(_Wire):
    req_id: int
    # Buffers per requested token, in order; the buffers follow as frames.
    counts: list[int]


class AckReply(_Wire):
    req_id: int
    acked: int
    # Groups of an expired lease that had been leased again before this late ack (they will be trained
    # by their new holder too).
    lost: int = 0


class DroppedReply(_Wire):
    req_id: int
    groups: list[GroupMeta]


class PartitionStats(msgspec.Struct, kw_only=True, gc=False):
    """Depth, totals and rates of one partition; rates are per second over the last ``rate_window_s``."""

    ready_groups: int = 0
    ready_bytes: int = 0
    leased_groups: int = 0
    leased_bytes: int = 0
    put_total: int = 0
    put_bytes_total: int = 0
    leased_total: int = 0
    acked_total: int = 0
    dropped_total: int = 0
    nacked_total: int = 0
    expired_total: int = 0
    duplicates_total: int = 0
    # Groups a consumer could not unpack (see QuarantineRequest); never delivered again.
    quarantined_total: int = 0
    put_rate: float = 0.0
    lease_rate: float = 0.0
    ack_rate: float = 0.0
    # staleness (consumer_version - group.min_version) -> groups leased at that staleness (leases that
    # named a consumer_version only).
    staleness: dict[int, int] = {}


class QueueStats(msgspec.Struct, kw_only=True, gc=False):
    partitions: dict[str, PartitionStats] = {}
    held_groups: int = 0
    held_bytes: int = 0
    capacity_groups: int = 0
    capacity_bytes: int = 0
    puts_waiting: int = 0
    # Payload bytes the waiting puts hold in server memory (socket frames; beside held_bytes).
    puts_waiting_bytes: int = 0
    leases_waiting: int = 0
    # Arena credits handed out and not yet used.
    credits: int = 0
    consumed_uids: int = 0
    dropped_waiting: int = 0
    duplicates_total: int = 0
    shm_bytes_total: int = 0
    shm_bytes_used: int = 0
    # Groups acked since the last snapshot, kept (with their payload bytes) for a rollback restore, and
    # how many of them are still being copied to the journal file.
    journal_groups: int = 0
    journal_bytes: int = 0
    journal_backlog_groups: int = 0
    rate_window_s: float = 0.0
    uptime_s: float = 0.0

    def staleness(self) -> dict[int, int]:
        """The staleness histogram summed over partitions."""
        out: dict[int, int] = {}
        for part in self.partitions.values():
            for k, v in part.staleness.items():
                out[k] = out.get(k, 0) + v
        return dict(sorted(out.items()))


class StatsReply(_Wire):
    req_id: int
    stats: QueueStats


class SummaryReply(_Wire):
    req_id: int
    summary: dict[str, Any]


class DoneReply(_Wire):
    req_id: int


class ErrorReply(_Wire):
    req_id: int
    # bad_request | too_large | queue_full | too_many_waiting | unknown_lease | expired | internal
    kind: str
    message: str


REQUEST_TYPES: dict[MsgType, type[msgspec.Struct]] = {
    MsgType.HELLO: HelloRequest,
    MsgType.PUT: PutRequest,
    MsgType.RESERVE: ReserveRequest,
    MsgType.COMMIT: CommitRequest,
    MsgType.LEASE: LeaseRequest,
    MsgType.FETCH: FetchRequest,
    MsgType.ACK: AckRequest,
    MsgType.NACK: NackRequest,
    MsgType.POP_DROPPED: PopDroppedRequest,
    MsgType.STATS: StatsRequest,
    MsgType.SNAPSHOT: PathRequest,
    MsgType.RESTORE: PathRequest,
    MsgType.PING: PingRequest,
    MsgType.QUARANTINE: QuarantineRequest,
}

REPLY_TYPES: dict[MsgType, type[msgspec.Struct]] = {
    MsgType.HELLO: HelloReply,
    MsgType.PUT: PutReply,
    MsgType.RESERVE: ReserveReply,
    MsgType.COMMIT: CommitReply,
    MsgType.LEASE: LeaseReply,
    MsgType.FETCH: FetchReply,
    MsgType.ACK: AckReply,
    MsgType.NACK: DoneReply,
    MsgType.POP_DROPPED: DroppedReply,
    MsgType.STATS: StatsReply,
    MsgType.SNAPSHOT: SummaryReply,
    MsgType.RESTORE: SummaryReply,
    MsgType.PING: DoneReply,
    MsgType.QUARANTINE: DoneReply,
}
