"""Config of the checkpoint engine that pushes new weights from the trainer to the inference servers."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from slipstream.config_base import ConfigStruct


class WeightSyncConfig(ConfigStruct):
    """The checkpoint engine that pushes each new weight version from the trainer to the servers."""

    backend: Annotated[
        Literal["auto", "torch_dist", "ipc", "nixl", "naive"],
        Meta(
            description="Transport: `torch_dist` (gloo on CPU, NCCL on GPU), `nixl` (UCX; DRAM or GPU "
            "memory), `ipc` (one host: shared memory, or CUDA IPC on one GPU; embedded servers), `naive` "
            "(one broadcast per tensor; the baseline), or `auto`: `ipc` when every embedded server reports "
            "the trainer's host and, for a GPU trainer, the same physical GPU (NCCL cannot join two "
            "processes on one GPU), else `torch_dist`.",
        ),
    ] = "torch_dist"
    bucket_mb: Annotated[
        int,
        Meta(
            ge=1,
            description="Bucket size in MiB; tensors larger than a bucket are split into chunks. The sender "
            "holds two buckets (one being packed while the other is on the wire); receivers keep one "
            "staging copy of the model.",
        ),
    ] = 256
    timeout_s: Annotated[
        float,
        Meta(
            gt=0,
            description="Every wait (rendezvous, each bucket, each HTTP call) gives up after this many "
            "seconds; a cut-short transfer is discarded and the old weights keep serving.",
        ),
    ] = 300.0
    master_address: Annotated[
        str,
        Meta(
            description="Address the trainer's rendezvous store binds (loopback unless the servers are on "
            "other hosts).",
        ),
    ] = "127.0.0.1"
    master_port: Annotated[int, Meta(ge=0, le=65535, description="Rendezvous port; 0 picks a free one.")] = 0
    device: Annotated[
        Literal["auto", "cpu", "cuda"],
        Meta(
            description="Where transfer buffers live: `cpu` (gloo, NIXL DRAM), `cuda` (NCCL, NIXL VRAM), or "
            "`auto` (cuda when a GPU is visible). torch_dist picks gloo for cpu and NCCL for cuda.",
        ),
    ] = "auto"
    pause_mode: Annotated[
        Literal["in_place", "abort", "retract"],
        Meta(
            description="How a server treats in-flight requests while it switches to a new version: "
            "`in_place` keeps them on the old KV cache (on vLLM, which clears its prefix cache at every pause, "
            "they stay but recompute it under the new weights), `abort` returns partial output, `retract` (SGLang) "
            "requeues them. The pipeline sets it from `async.partial_rollout`. SGLang and vLLM's own `nccl` "
            "engine are paused for the whole load; vLLM with the `slipstream` engine stages the version while "
            "it generates and pauses only for the switch; embedded servers pause only for the final copy.",
        ),
    ] = "in_place"
    keep_last: Annotated[
        bool,
        Meta(
            description="Keep a CPU copy of the last published version on the trainer, so that a server "
            "that joins late or restarts gets the current weights at once, and a push cut short by one dead "
            "server is retried for the others. Costs one model's worth of trainer CPU memory.",
        ),
    ] = True
    delta: Annotated[
        bool,
        Meta(
            description="Delta pushes: a version carries only the elements whose pushed-dtype value changed "
            "since the version every server holds (indices or a bitmap, and the new values, per tensor; "
            "a tensor whose delta would not be smaller goes whole), and a whole version when a server is "
            "not on the previous one. Servers serve exactly what a whole push gives. Costs one model's "
            "worth of memory in the pushed dtype on each server (the version deltas apply to) and on the "
            "trainer (the version deltas are computed against; the keep_last copy). Not used with "
            "trainer.lora, whose pushes carry the adapters alone.",
        ),
    ] = False
    verify: Annotated[
        bool,
        Meta(
            description="The trainer stamps every tensor it pushes with a digest of its bytes in the pushed "
            "dtype (XXH3-64 from host memory, a position-weighted word sum on a GPU), and receivers refuse a "
            "version whose staged bytes differ (the server keeps the old one; `sync/verify_failed`). About "
            "50 ms per 270 MB on each side, on one core. SGLang's own receiver does not check.",
        ),
    ] = True
    require_all_weights: Annotated[
        bool,
        Meta(
            description="Receivers refuse a version that does not cover every parameter they serve (a "
            "sender bug would otherwise leave a model that mixes two versions).",
        ),
    ] = True
    push_dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        Meta(
            description="Dtype of the pushed weights: the servers' own (`auto`: the embedded server's "
            "`rollout.embedded.dtype`, a vLLM/SGLang `--dtype` in `rollout.server_args`, else the "
            "checkpoint's `torch_dtype`), so a bf16 server gets 2 bytes a parameter even when the trainer "
            "keeps fp32 master weights.",
        ),
    ] = "auto"
    group_name: Annotated[
        str,
        Meta(description="Name of the trainer↔servers process group (several may coexist on one server)."),
    ] = "slipstream_weights"
