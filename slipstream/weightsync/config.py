"""Config of the checkpoint engine that pushes new weights from the trainer to the inference servers."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from slipstream.config_base import ConfigStruct


class WeightSyncConfig(ConfigStruct):
    # Transport: `torch_dist` (gloo on CPU, NCCL on GPU), `nixl` (UCX; DRAM or GPU memory), or `naive`
    # (one broadcast per tensor; the baseline).
    backend: Literal["torch_dist", "nixl", "naive"] = "torch_dist"
    # Bucket size in MiB; tensors larger than a bucket are split into chunks.
    bucket_mb: Annotated[int, msgspec.Meta(ge=1)] = 256
    # Every wait (rendezvous, each bucket, each HTTP call) gives up after this many seconds; a cut-short
    # transfer is discarded and the old weights keep serving.
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    # Address the trainer's rendezvous store binds (loopback unless the servers are on other hosts).
    master_address: str = "127.0.0.1"
    # Rendezvous port; 0 picks a free one.
    master_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
