"""Config of the TransferQueue server and its clients."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from slipstream.config_base import ConfigStruct

MiB = 1 << 20
GiB = 1 << 30


class QueueConfig(ConfigStruct):
    """The TransferQueue server (a controller and its storage units) and what its clients may do."""

    host: Annotated[
        str,
        Meta(
            description="Address the controller binds. Loopback by default: set 0.0.0.0 (or a NIC address) "
            "only when rollout and trainer nodes are different machines; such a server requires a token "
            "(auth_token).",
        ),
    ] = "127.0.0.1"
    auth_token: Annotated[
        str,
        Meta(
            description='Token every client must present (ZeroMQ PLAIN, see queue/auth.py): "auto" = none '
            "on loopback, a random one for any other bind; a literal secret = always (or set "
            '$SLIPSTREAM_QUEUE_TOKEN); "" = none, which only a loopback bind allows. Clients get it inside '
            "the server's address (tcp://TOKEN@host:port).",
        ),
    ] = "auto"
    port: Annotated[
        int,
        Meta(
            ge=0,
            le=65535,
            description="Controller port; 0 picks a free one (the pipeline passes the bound address to "
            "every client).",
        ),
    ] = 0
    num_storage_units: Annotated[
        int,
        Meta(
            ge=1,
            description="Storage units holding the payloads; groups are spread over them by group id. Each "
            "unit has its own socket (and ZeroMQ IO thread) and its own shared-memory arena.",
        ),
    ] = 2
    capacity_groups: Annotated[
        int,
        Meta(
            ge=1,
            description="Back-pressure: a put waits while the queue holds this many groups (ready + leased).",
        ),
    ] = 4096
    capacity_bytes: Annotated[
        int,
        Meta(ge=1, description="Back-pressure: a put waits while the queue holds this many payload bytes."),
    ] = 8 * GiB
    lease_timeout_s: Annotated[
        float,
        Meta(
            gt=0,
            description="A lease not acked within this many seconds returns its groups to the ready set.",
        ),
    ] = 900.0
    put_timeout_s: Annotated[
        float, Meta(gt=0, description="How long a put waits on back-pressure before it fails with QueueFull.")
    ] = 3600.0
    max_message_bytes: Annotated[
        int,
        Meta(
            ge=1024,
            description="Messages larger than this are refused with an error reply (protects the server's "
            "memory). A single frame over twice this size is cut off by ZeroMQ itself (the sender is "
            "disconnected, the server goes on).",
        ),
    ] = 4 * GiB
    shared_memory: Annotated[
        bool,
        Meta(
            description="Same-host clients move payloads through shared memory instead of the socket when "
            "it is faster.",
        ),
    ] = True
    ipc: Annotated[
        bool,
        Meta(
            description="Same-host clients talk to the server over Unix domain sockets (Linux abstract "
            "names, advertised in HELLO) instead of TCP loopback: control requests over a plain socket (the "
            "direct channel, no ZeroMQ IO threads in the way), payload frames over ipc://. Clients on other "
            "hosts use TCP.",
        ),
    ] = True
    shm_bytes_per_unit: Annotated[
        int,
        Meta(
            ge=0,
            description="Size of each storage unit's shared-memory arena (server-owned, pre-faulted at "
            "start, reused): this much memory per unit is taken when the server starts. Groups that do not "
            "fit right now travel as socket frames instead, so it bounds memory, not correctness; raise it "
            "for large payloads (multimodal data).",
        ),
    ] = 256 * MiB
    shm_min_group_bytes: Annotated[
        int,
        Meta(
            ge=0,
            description="Groups smaller than this go through the socket even for same-host clients. 0: all "
            "of them use the arena; measured here that is never slower (a put is one round trip either way "
            "once the client holds an arena credit) and it saves the consumer the fetch round trip a "
            "socket-stored group needs.",
        ),
    ] = 0
    inline_tensor_bytes: Annotated[
        int,
        Meta(
            ge=0,
            description="Tensors up to this many bytes ride inside the msgpack header instead of their own "
            "frame.",
        ),
    ] = 512
    reserve_timeout_s: Annotated[
        float,
        Meta(
            gt=0,
            description="An arena reservation whose writer never commits (it died mid-put) is released "
            "after this long.",
        ),
    ] = 60.0
    journal: Annotated[
        bool,
        Meta(
            description="Keep every acked group (header and payload) in a journal until the next snapshot, "
            "so a trainer that crashes and restores its last snapshot on this still-running server gets "
            "back what it acked since. Costs one copy of every consumed byte on a server thread, so it is "
            "off by default: without it a restore merges as on a fresh server. `slipstream train` turns it "
            "on with cluster.restart_trainer, the one case where a live server is rolled back.",
        ),
    ] = False
    journal_dir: Annotated[
        str,
        Meta(
            description='Directory of the journal\'s (anonymous, never named) files; "" means the system '
            "temp dir ($TMPDIR). Pick a local disk with room for what the trainer consumes between two "
            "snapshots, or /dev/shm to keep it in RAM.",
        ),
    ] = ""
    snapshot_dir: Annotated[
        str,
        Meta(
            description="Directory the server writes snapshots to and restores them from. A SNAPSHOT or "
            'RESTORE request names a file inside it ("step_00000010/queue": parts joined by "/", no "..", '
            'no absolute path, no symbolic link followed), never a path of its own. "" refuses both '
            "requests. `slipstream train` sets it to the run's checkpoint directory, where each checkpoint "
            "holds its snapshot.",
        ),
    ] = ""
    max_parked_puts: Annotated[
        int,
        Meta(
            ge=1,
            description="Most puts parked on back-pressure at once (each holds its payload frames; a "
            "shared-memory put's region is already reserved); one more fails at once with QueueFull. A "
            "bound against clients that misbehave, as the other max_* keys: each refusal is an error reply "
            "naming the bound.",
        ),
    ] = 1024
    max_parked_put_bytes: Annotated[
        int,
        Meta(
            ge=0,
            description="Most frame bytes the parked puts hold together; a put beyond it fails at once with "
            "QueueFull.",
        ),
    ] = 1 * GiB
    max_waiting_leases: Annotated[
        int, Meta(ge=1, description="Leases waiting for groups at once; one more is refused at once.")
    ] = 4096
    direct_max_unread_bytes: Annotated[
        int,
        Meta(
            ge=1024,
            description="Replies a same-host client has not read yet, per direct-channel connection: beyond "
            "this the server stops reading that connection's requests until the client catches up (a client "
            "that never reads blocks in its own send, and the server's memory stays bounded).",
        ),
    ] = 16 * MiB
    zmq_hwm: Annotated[
        int,
        Meta(
            ge=1,
            description="ZeroMQ high-water mark of every server socket: messages queued per peer and "
            "direction. A peer that sends faster than the server reads is slowed by TCP; a reply to a peer "
            "that does not read its replies is dropped once its queue is full (a lease reply: the groups "
            "stay ready).",
        ),
    ] = 1000
    io_threads: Annotated[
        int,
        Meta(
            ge=1,
            description="ZeroMQ IO threads of the server; more help only when many remote clients move data "
            "at once.",
        ),
    ] = 2
