"""A serving process for the weight-sync HTTP tests: our receiver routes in front of a dict of tensors.

Besides the weight-update routes it answers ``GET /health`` and ``GET /digest`` (a hash of every tensor it
serves, and its version). ``die_on_update=N`` makes the process exit abruptly when the N-th
``/update_weights_from_distributed`` arrives, i.e. while the trainer is broadcasting that bucket: a server
killed in the middle of a transfer, at a point the test chooses. :func:`serve_checkpoint` serves a real
checkpoint's tensors instead of the model-like set.
"""

from __future__ import annotations

import os

import torch
from wsync_helpers import DictTarget, digest, mixed_tensors


def build_app(die_on_update: int | None = None, require_all_weights: bool = True, tensors=None):
    from fastapi import FastAPI, Request

    from slipstream.weightsync.config import WeightSyncConfig
    from slipstream.weightsync.http_receiver import WeightReceiver

    target = DictTarget(mixed_tensors(0) if tensors is None else tensors)
    receiver = WeightReceiver(target, WeightSyncConfig(require_all_weights=require_all_weights))
    app = FastAPI()
    app.include_router(receiver.router())
    updates = {"n": 0}

    @app.middleware("http")
    async def die(request: Request, call_next):
        if request.url.path == "/update_weights_from_distributed":
            updates["n"] += 1
            if die_on_update is not None and updates["n"] >= die_on_update:
                os._exit(1)
        return await call_next(request)

    @app.get("/health")
    def health() -> dict:
        return {"ok": True}

    @app.get("/digest")
    def weights_digest() -> dict:
        return {"version": target.weight_version, "digest": digest(target.tensors)}

    return app


def serve(port: int, die_on_update: int | None = None) -> None:
    import uvicorn

    torch.set_num_threads(1)
    uvicorn.run(build_app(die_on_update), host="127.0.0.1", port=port, log_level="warning")


def serve_lax(port: int, die_on_update: int | None = None) -> None:
    """A server whose receiver takes a version that misses tensors (as SGLang's does: it cannot tell)."""
    import uvicorn

    torch.set_num_threads(1)
    app = build_app(die_on_update, require_all_weights=False)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def serve_checkpoint(path: str, port: int, die_on_update: int | None = None) -> None:
    """A server of the checkpoint at ``path`` (its ``model.safetensors``, under the checkpoint's names), whose
    receiver requires every one of them in a version, as the embedded server's and vLLM's do."""
    import uvicorn
    from safetensors.torch import load_file

    torch.set_num_threads(1)
    tensors = sorted(load_file(f"{path}/model.safetensors").items())
    uvicorn.run(build_app(die_on_update, tensors=tensors), host="127.0.0.1", port=port, log_level="warning")
