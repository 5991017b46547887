"""Config of the TransferQueue server and its clients."""

from __future__ import annotations

from typing import Annotated

import msgspec

from slipstream.config_base import ConfigStruct

MiB = 1 << 20
GiB = 1 << 30


class QueueConfig(ConfigStruct):
    # Address the controller binds. Loopback by default: set 0.0.0.0 (or a NIC address) only when rollout
    # and trainer nodes are different machines.
    host: str = "127.0.0.1"
    # Controller port; 0 picks a free one (the pipeline passes the bound address to every client).
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    # Storage units holding the payloads; groups are spread over them by group id.
    num_storage_units: Annotated[int, msgspec.Meta(ge=1)] = 2
    # Back-pressure: a put waits while the queue holds this many groups (ready + leased) ...
    capacity_groups: Annotated[int, msgspec.Meta(ge=1)] = 4096
    # ... or this many payload bytes.
    capacity_bytes: Annotated[int, msgspec.Meta(ge=1)] = 8 * GiB
    # A lease not acked within this many seconds returns its groups to the ready set.
    lease_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 900.0
    # How long a put waits on back-pressure before it fails with QueueFull.
    put_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 3600.0
    # Messages larger than this are refused with an error reply (protects the server's memory).
    max_message_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 4 * GiB
    # Same-host clients move payloads through shared memory instead of the socket when it is faster.
    shared_memory: bool = True
