"""What the receiving side of a weight push needs from the process that serves the weights.

The embedded inference server (rollouter/) implements :class:`WeightTarget`; the checkpoint engine's HTTP
receiver (``weightsync/http_receiver.py``) stages a whole version through it and applies it at once, so a
transfer cut short never leaves a half-updated model serving. weightsync imports no other role: it only
knows this protocol.

Lifecycle of one version on a target::

    specs = target.weight_specs()            # names, shapes and dtypes the target accepts
    ... receive every tensor of version v into a staging area, checking it against specs ...
    target.apply_weights(staged.items(), v)  # atomic: generation paused, all copied in, version = v
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import msgspec
import torch


@runtime_checkable
class WeightTarget(Protocol):
    @property
    def weight_version(self) -> int:
        """The version now serving (the one stamped on newly generated tokens)."""
        ...

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every parameter the target accepts, by (HF) name: its full shape and dtype."""
        ...

    def apply_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy the tensors in and set ``weight_version = version``, all with generation paused.

        Raises (and leaves the old weights serving) when a name is unknown or a shape does not match.
        If generation was already paused (``/pause_generation``) it stays paused; otherwise the update
        runs under an in-place pause and generation resumes afterwards.

        The tensors are views of the receiver's staging memory, which the next version reuses: copy
        them in and keep no reference to them after returning.
        """
        ...


@runtime_checkable
class PreparingTarget(WeightTarget, Protocol):
    """A target that can do most of a version's apply before the switch, while it still serves the old one."""

    def prepare_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Check and stage ``version`` so that a later ``apply_weights`` of it only switches (not serving it
        yet). Raises, as ``apply_weights`` would, on a name or shape it refuses; a version prepared and never
        applied is dropped by the next prepare."""
        ...


@runtime_checkable
class PausableTarget(WeightTarget, Protocol):
    """A target that can also pause generation itself (``/end_weight_update {abort_running: true}``)."""

    async def pause(self, mode: str) -> None:
        """Hold new requests; ``abort`` ends the running ones (they return their partial output)."""
        ...

    async def resume(self) -> None:
        """Let held requests start."""
        ...


# ------------------------------------------------------------------------------------------ wire types
#
# Everything below travels between processes: msgspec Structs read by typed decoders, never pickle. Tensor
# dtypes travel as torch's attribute names ("bfloat16", "float8_e4m3fn"); shapes as lists of ints.


DENSE = "dense"
# Send-less kinds (``weightsync/send_less.py`` writes them, and rebuilds full tensors from them before a
# version reaches ``WeightTarget.apply_weights``): a delta against the version the receiver holds (the
# changed elements' flat indices, or a packed bitmap of them, and their new values), and LoRA (the base
# weight of an adapted module, kept by the receiver, and the two low-rank factors merged onto it).
DELTA_INDEX, DELTA_MASK, DELTA_VALUES = "delta_index", "delta_mask", "delta_values"
LORA_BASE, LORA_A, LORA_B = "lora_base", "lora_A", "lora_B"
DELTA_KINDS = (DELTA_INDEX, DELTA_MASK, DELTA_VALUES)
LORA_KINDS = (LORA_BASE, LORA_A, LORA_B)
ENTRY_KINDS = (DENSE, *DELTA_KINDS, *LORA_KINDS)


class TensorEntry(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """Where one tensor (or one chunk of a tensor larger than a bucket) lies in a bucket's payload.

    The full tensor has ``prod(shape) * itemsize(dtype)`` bytes; this entry carries ``nbytes`` of them,
    starting at byte ``chunk_offset`` of the tensor, stored at byte ``offset`` of the bucket. A tensor that
    fits a bucket has ``chunk_offset == 0`` and ``nbytes`` equal to its full size.

    ``kind`` says what the bytes are; ``dtype``/``shape`` always describe the bytes this entry carries:

    * ``dense``: the full tensor's values (an entry without a kind, from an older sender, is dense);
    * ``delta_index`` (int32/int64 [k]) or ``delta_mask`` (uint8 [ceil(n/8)], packed little-endian bits),
      with ``delta_values`` ([k], the tensor's dtype): the elements of ``name`` that changed since the
      bucket's ``base`` version, and their new values (``delta.compute_delta``'s ``sparse``/``mask``);
    * ``lora_base``: the base weight of a LoRA-adapted module, which the receiver keeps (it is not served
      as such); ``lora_A`` [r, in] / ``lora_B`` [out, r]: the adapter of module ``<name>`` (named
      ``<module>.lora_A.weight``), served merged as ``W + lora_scale * B A``.

    A receiver refuses a kind it does not know at the bucket (``StagingArea``), so a sender that knows
    more kinds never has its payload read as dense values.

    ``digest``: of the whole tensor's bytes (every chunk carries it), by the bucket's ``digest``
    algorithm (``weightsync/digest.py``); None when the sender does not verify.
    """

    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int
    chunk_offset: int = 0
    kind: str = DENSE
    digest: int | None = None


class BucketMeta(msgspec.Struct, kw_only=True, gc=False, omit_defaults=True):
    """One bucket of one weight version: a flat byte payload holding ``entries``.

    ``index`` counts buckets from 0 within the version; ``last`` marks the bucket that completes it, so a
    receiver knows a version is whole without knowing its size in advance (the sender streams).
    ``segments`` lists the ``(offset, length)`` byte ranges of the payload that travel as separate
    transfers (large tensors go straight from the sender's memory, unpacked); empty means one transfer of
    all ``nbytes``. Bytes between segments are alignment padding and are never sent.
    """

    version: int
    index: int
    nbytes: int
    entries: list[TensorEntry]
    last: bool = False
    segments: list[tuple[int, int]] = []
    # Send-less (every bucket of a version says the same; ``weightsync/send_less.py``). ``base``: the
    # version this version's delta entries apply to (-1: none); the receiver must hold it, or refuse.
    # ``keep``: the receiver keeps this version's full tensors as the base of later deltas
    # (``weightsync.delta``). ``lora_scale``: alpha / r of the LoRA entries.
    base: int = -1
    keep: bool = False
    lora_scale: float = 0.0
    # The algorithm of the entries' digests (``weightsync/digest.py``); "" when they carry none.
    digest: str = ""


class VersionInfo(msgspec.Struct, kw_only=True, frozen=True):
    """The send-less fields a sender stamps on every bucket of one version (:class:`BucketMeta`)."""

    base: int = -1
    keep: bool = False
    lora_scale: float = 0.0

    @classmethod
    def of(cls, meta: BucketMeta) -> VersionInfo:
        return cls(base=meta.base, keep=meta.keep, lora_scale=meta.lora_scale)


class Rendezvous(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What one end of a transport publishes before it is connected (``Transport.prepare()``).

    It travels as msgpack or JSON bytes (``msgspec``), never pickled: a receiver in another program (a
    vLLM worker plug-in) returns ``msgspec.msgpack.encode(transport.prepare())`` and the trainer decodes it
    with ``msgspec.msgpack.decode(raw, type=Rendezvous)``.

    torch_dist: the sender names the store address and port it listens on; receivers publish nothing but
    their backend and how many ranks they take (``ranks``: an SGLang server joins with ``tp_size`` workers).
    nccl_uid: the sender's NCCL unique id. nixl: every side publishes its agent name and NIXL's agent
    metadata (an opaque blob produced by NIXL's own serializer, not a pickle); the sender also lists the
    address, length and device of each registered send buffer so receivers can READ from them.
    """

    backend: str
    ranks: int = 1
    nccl_unique_id: bytes = b""
    address: str = ""
    port: int = 0
    agent_name: str = ""
    agent_metadata: bytes = b""
    mem_type: str = ""
    buffers: list[tuple[int, int, int]] = []
    # ipc: where this side runs (host identity; ``cpu`` or ``cuda:<device UUID>``), and on the sender the
    # path of its control socket (in ``address``) and the secret a receiver proves itself with.
    host: str = ""
    device: str = ""
    secret: str = ""


class InitInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What :func:`~slipstream.weightsync.base.build_topology` hands each end for ``connect``: its (first)
    rank, the world size, the group's name, the sender's store address (torch_dist) and its peers (the
    sender: every receiver's rendezvous; a receiver: the sender's). Msgspec bytes like ``Rendezvous``."""

    backend: str
    rank: int
    world_size: int
    group_name: str
    address: str = ""
    port: int = 0
    peers: list[Rendezvous] = []


# --- the SGLang-compatible HTTP surface of a receiving server (weightsync/http_receiver.py) -----------


class InitWeightsUpdateGroupReq(msgspec.Struct, kw_only=True):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    # "nccl" (GPU) or "gloo" (CPU).
    backend: str = "nccl"
    # Extension: the sender's wait limit, which the receiver then uses for this group too.
    timeout_s: float | None = None


class DestroyWeightsUpdateGroupReq(msgspec.Struct, kw_only=True):
    group_name: str = "weight_update_group"


class BeginWeightUpdateReq(msgspec.Struct, kw_only=True):
    selector: str = "all"
    # Extension: the version about to arrive (SGLang learns it from the update calls).
    weight_version: str | int | None = None
    # Extension: the whole version arrives in band: from a connected ``ipc``/``nixl`` sender (stream mode), or
    # over a joined ``torch_dist`` group (``group_name``; the group joined last when omitted).
    stream: str | None = None
    group_name: str | None = None


class SwitchUpdateReq(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The ``update_info`` vLLM's ``slipstream`` engine takes (``rollouter/vllm_weights.py``): switch to the
    version received in band since ``/start_weight_update`` (``serverapi.vllm.SWITCH_UPDATE``)."""

    slipstream_switch: bool


class UpdateWeightsFromDistributedReq(msgspec.Struct, kw_only=True):
    """One broadcast's worth of tensors: SGLang's request, plus one optional extension field.

    With ``load_format="flattened_bucket"`` the broadcast is one flat buffer holding the tensors back to
    back in ``names`` order; otherwise each tensor is its own broadcast. ``slipstream_bucket`` (ours)
    gives the exact layout instead (aligned offsets, mixed dtypes, chunks of tensors larger than a
    bucket); when present it wins over ``names``/``dtypes``/``shapes``.
    """

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | int | None = None
    load_format: str | None = None
    selector: str = "all"
    torch_empty_cache: bool = False
    slipstream_bucket: BucketMeta | None = None


class EndWeightUpdateReq(msgspec.Struct, kw_only=True):
    # Extension: a receiver checks the staged version against it before applying.
    weight_version: str | int | None = None
    # Extension: abort the running requests at the switch (they return their partial output with an
    # ``abort`` finish) and hold new ones until it is done; the caller sends no pause and no continue.
    abort_running: bool = False


class WeightUpdateResp(msgspec.Struct, kw_only=True, omit_defaults=True):
    success: bool
    message: str = ""
    weight_version: int | None = None


class StreamConnectReq(msgspec.Struct, kw_only=True):
    """``/weightsync/<name>/connect`` (``ipc``, ``nixl``): the sender's rendezvous, once per group."""

    sender: Rendezvous
    group_name: str = "weight_update_group"


class ReceiverStatus(msgspec.Struct, kw_only=True):
    """``GET /weightsync/status``: what a receiving server holds and what went wrong last."""

    weight_version: int
    staging_version: int | None
    groups: list[str]
    applied_versions: int
    failed_versions: int
    last_error: str = ""
    # Seconds the last applied version took to apply (generation paused) and to receive (it was not).
    last_apply_s: float = 0.0
    last_receive_s: float = 0.0
    last_verify_s: float = 0.0  # of the last version applied, checking its bytes against the sender's digests
    # Send-less: the version deltas may apply to (None: a delta is refused), how many adapted base
    # weights are kept for LoRA versions, and the bytes both take (send_less.py).
    delta_base: int | None = None
    lora_base: int = 0
    kept_bytes: int = 0


class NixlNotice(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A NIXL notification between sender and receivers (sent as msgpack bytes in ``send_notif``).

    kind ``bucket`` (sender → receivers): bucket ``meta`` waits in the sender's buffer ``slot``; READ it.
    kind ``ack`` (receiver → sender): bucket ``index`` of ``version`` has landed (``ok``) or failed.
    kind ``abort`` (sender → receivers): drop ``version``.
    """

    kind: str
    version: int
    index: int = 0
    slot: int = 0
    meta: BucketMeta | None = None
    ok: bool = True
    error: str = ""


class IpcBuffer(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One transfer buffer an ``ipc`` sender shares: host memory travels as a file descriptor beside the
    message (only ``nbytes`` here); GPU memory as the fields of torch's ``UntypedStorage._share_cuda_()``."""

    nbytes: int
    device: int = -1
    handle: bytes = b""
    offset: int = 0
    ref_counter_handle: bytes = b""
    ref_counter_offset: int = 0
    event_handle: bytes | None = None
    event_sync_required: bool = False


class IpcMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A message on an ``ipc`` engine's control socket (length-prefixed msgpack).

    kind ``hello`` (receiver → sender: ``secret``, ``name``), ``buffers`` (sender → receiver: the shared
    buffers, ``device`` says which memory), ``ready`` (receiver mapped them, or ``ok=False`` and ``error``),
    ``bucket`` (bucket ``meta`` of push ``push`` waits in buffer ``slot``), ``ack`` (receiver → sender:
    bucket ``index`` of push ``push`` was copied out, or failed), ``abort`` (drop push ``push``), ``bye``
    (the sender closes the connection on purpose; an end of stream without it means the sender died).
    """

    kind: str
    push: int = 0
    version: int = 0
    index: int = 0
    slot: int = 0
    meta: BucketMeta | None = None
    ok: bool = True
    error: str = ""
    name: str = ""
    secret: str = ""
    device: str = ""
    buffers: list[IpcBuffer] = []
