"""A serving process for the ``ipc`` HTTP tests: our receiver routes in front of a dict of tensors.

Besides the weight-update routes it answers ``GET /health``, ``GET /digest`` (a hash of every tensor it
serves, and its version) and ``GET /ipc_state`` (what its receiving ipc end holds: staging bytes, mapped
sender buffers, and the shared-memory segments the process maps). ``die_after_buckets=N`` makes the process
exit abruptly while copying bucket N+1 of a version: a server killed in the middle of a transfer.
"""

from __future__ import annotations

import os
import re

import torch
from wsync_helpers import DictTarget, digest, mixed_tensors


def shm_mappings() -> int:
    with open("/proc/self/maps") as f:
        return len({line.split()[-2] for line in f if re.search(r"/dev/shm/\S+ \(deleted\)$", line.strip())})


def build_app(die_after_buckets: int | None = None):
    from fastapi import FastAPI

    from slipstream.weightsync.http_receiver import WeightReceiver
    from slipstream.weightsync.ipc_engine import IpcTransport

    if die_after_buckets is not None:
        copy_in, copied = IpcTransport._copy_in, {"n": 0}

        def dying_copy_in(self, staging, msg):
            copied["n"] += 1
            if copied["n"] > die_after_buckets:
                os._exit(1)
            return copy_in(self, staging, msg)

        IpcTransport._copy_in = dying_copy_in

    target = DictTarget(mixed_tensors(0))
    receiver = WeightReceiver(target)
    app = FastAPI()
    app.include_router(receiver.router())

    @app.get("/health")
    def health() -> dict:
        return {"ok": True}

    @app.get("/digest")
    def weights_digest() -> dict:
        return {"version": target.weight_version, "digest": digest(target.tensors)}

    @app.get("/ipc_state")
    def ipc_state() -> dict:
        engine = receiver.streams.get("ipc")
        return {
            "staging_bytes": engine.staging_bytes if engine else 0,
            "mapped": engine.mapped if engine else 0,
            "shm_mappings": shm_mappings(),
        }

    return app


def serve(port: int, die_after_buckets: int | None = None) -> None:
    import uvicorn

    torch.set_num_threads(1)
    uvicorn.run(build_app(die_after_buckets), host="127.0.0.1", port=port, log_level="warning")
