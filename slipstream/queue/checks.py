"""Numbers in requests that the controller refuses before acting on them, each error naming its field.

A header that decodes is well-typed, not sensible: any peer that reaches the socket can ask for a lease of
2^62 groups, wait NaN or -inf seconds, or reserve 2^62 bytes, and each of these used to be answered ``ok``
(a NaN wait compared false against every deadline; a huge count or size simply found nothing). Each is now a
``bad_request`` whose message names the message, the field, the allowed range and the value, so the client
raises a :class:`~slipstream.queue.errors.QueueError` that says what to fix. The bounds, and why:

* ``n_groups`` and ``min_groups`` of a lease: 1 to ``capacity_groups``, the most groups the queue ever holds
  (ready and leased together), so a larger lease could never be filled, and ``min_groups <= n_groups``;
* the seconds a lease, put or commit waits (``timeout_s``): finite and at least 0 (a client's wait that has
  run out is sent as 0, never below);
* the bytes a reservation (``nbytes``) or a commit's next credit (``next_nbytes``) asks for: 0 to
  ``capacity_bytes``, since a group larger than that is refused at admission anyway.
"""

from __future__ import annotations

import math

from slipstream.queue import protocol as P
from slipstream.queue.codec import WireError
from slipstream.queue.config import QueueConfig


def _refuse(what: str, req_id: int) -> WireError:
    return WireError("bad_request", what, req_id)


def check_wait(kind: str, req: P.LeaseRequest | P.PutRequest | P.CommitRequest) -> None:
    if not (math.isfinite(req.timeout_s) and req.timeout_s >= 0):
        raise _refuse(
            f"{kind} timeout_s must be a finite number of seconds >= 0, got {req.timeout_s!r}", req.req_id
        )


def check_lease(req: P.LeaseRequest, cfg: QueueConfig) -> None:
    most = cfg.capacity_groups
    for name, value in (("n_groups", req.n_groups), ("min_groups", req.min_groups)):
        if not 1 <= value <= most:
            raise _refuse(
                f"LEASE {name} must be from 1 to {most} (queue.capacity_groups, the most groups the queue "
                f"holds), got {value}",
                req.req_id,
            )
    if req.min_groups > req.n_groups:
        raise _refuse(
            f"LEASE min_groups ({req.min_groups}) must not exceed n_groups ({req.n_groups})", req.req_id
        )
    check_wait("LEASE", req)


def check_nbytes(kind: str, name: str, nbytes: int, req_id: int, cfg: QueueConfig) -> None:
    if nbytes < 0:
        raise _refuse(f"{kind} {name} must be at least 0, got {nbytes}", req_id)
    if nbytes > cfg.capacity_bytes:
        raise _refuse(
            f"{kind} {name}={nbytes} is more than capacity_bytes={cfg.capacity_bytes}: a group that large could "
            "never be admitted; raise queue.capacity_bytes",
            req_id,
        )
