"""Turning requests and tensors into ZeroMQ frames and back, without copies and without trusting input.

The recipe is vLLM's (``vllm/v1/serial_utils.py``), made stricter:

* **Headers** are msgspec Structs (:mod:`slipstream.queue.protocol`) behind a one-byte message type, read by
  one typed decoder per type. Pickle is never used, so a hostile peer can at worst send a wrong header,
  which fails to decode into a clear :class:`WireError`.
* **Tensors** travel as out-of-band buffers: the header carries ``(name, dtype, shape, frame, offset)`` and
  the bytes go as their own frames, sent with ``copy=False`` straight from the tensor's memory. Tensors of
  at most ``inline_tensor_bytes`` ride inline in the header (a frame costs more than copying 512 bytes).
  The receiver rebuilds each tensor as a view of the received frame (``torch.frombuffer``), so a received
  tensor keeps its frame alive and costs no copy.
* **Arena layout**: for shared-memory puts the tensors of a group are laid out in one region, each at a
  64-byte aligned offset, described by the same :class:`TensorSpec` (``frame`` 0, ``offset`` in region).
* **Validation before use**: :func:`validate_group` checks every spec against the buffers that arrived and
  the group's own header (column dtypes, lengths) before the server stores anything, so a malformed put is
  refused whole and the stored data always satisfies ``TrajectoryGroup.validate``.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import torch
import zmq

from slipstream.queue import protocol as P
from slipstream.queue.types import (
    COLUMN_DTYPES,
    IMAGE_COLUMN,
    PROMPT_ALIGNED,
    PROMPT_COLUMNS,
    RESPONSE_COLUMNS,
    ROUTE_COLUMNS,
    GroupMeta,
)

ALIGN = 64
# Frames below this are copied into ZeroMQ messages: for small frames a copy is cheaper than the bookkeeping
# of a zero-copy send (pyzmq's own default threshold is the same 64 KiB).
ZERO_COPY_MIN_BYTES = 1 << 16

DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


_TYPE_BYTES: dict[bytes, P.MsgType] = {bytes((t,)): t for t in P.MsgType if t in P.REQUEST_TYPES}


class WireError(Exception):
    """A message that cannot be served; the server answers it with an ERROR reply of this ``kind``."""

    def __init__(self, kind: str, message: str, req_id: int = 0) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.req_id = req_id


def _leading_uint(raw: bytes) -> int:
    """The unsigned integer a msgpack array starts with (a header's req_id), or 0."""
    if not raw:
        return 0
    pos = 1 if 0x90 <= raw[0] <= 0x9F else 3 if raw[0] == 0xDC else 5 if raw[0] == 0xDD else 0
    if not pos or len(raw) <= pos:
        return 0
    kind = raw[pos]
    if kind <= 0x7F:
        return kind
    width = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}.get(kind, 0)
    body = raw[pos + 1 : pos + 1 + width]
    return int.from_bytes(body, "big") if width and len(body) == width else 0


class Codec:
    """Encoders and typed decoders for one socket owner (msgspec encoders reuse a buffer: one per thread)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._envelope = msgspec.msgpack.Decoder(P.Envelope)
        self._requests = {t: msgspec.msgpack.Decoder(cls) for t, cls in P.REQUEST_TYPES.items()}
        self._replies = {t: msgspec.msgpack.Decoder(cls) for t, cls in P.REPLY_TYPES.items()}
        self._error = msgspec.msgpack.Decoder(P.ErrorReply)

    def encode(self, msg_type: int, header: msgspec.Struct, buffers: Sequence[Any] = ()) -> list[Any]:
        return [bytes((msg_type,)), self._encoder.encode(header), *buffers]

    def req_id(self, header: Any) -> int:
        """Best-effort request id of a raw header frame (0 when it is not even an envelope)."""
        try:
            return int(self._envelope.decode(header).req_id)
        except RecursionError:  # skipping the hostile nesting after it: read the id from the raw bytes
            return _leading_uint(bytes(memoryview(header)[:16]))
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError, OverflowError):
            return 0

    def decode_request(
        self, frames: Sequence[Any], allowed: frozenset[P.MsgType], max_bytes: int
    ) -> tuple[P.MsgType, Any, list[Any]]:
        """``[type, header, *buffers]`` -> (type, typed header, buffers); raise WireError when malformed.

        The request id for an error reply is only dug out on the error paths (this runs on every message).
        """
        if len(frames) < 2:
            raise WireError(
                "bad_request", f"truncated message: {len(frames)} frame(s), need a type and a header"
            )
        total = 0
        for frame in frames:
            total += len(frame)
        if total > max_bytes:
            raise WireError(
                "too_large",
                f"message of {total} bytes exceeds max_message_bytes={max_bytes}",
                self.req_id(frames[1]),
            )
        msg_type = _TYPE_BYTES.get(bytes(frames[0]))
        if msg_type is None or msg_type not in allowed:
            kind = bytes(frames[0])[:8]
            what = (
                f"unknown message type {kind!r}"
                if msg_type is None
                else f"{msg_type.name} is not served here"
            )
            raise WireError("bad_request", what, self.req_id(frames[1]))
        try:
            header = self._requests[msg_type].decode(frames[1])
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            raise WireError(
                "bad_request", f"malformed {msg_type.name} header: {err}", self.req_id(frames[1])
            ) from None
        except RecursionError:  # msgspec's depth limit: hostile nesting, not a server fault
            raise WireError(
                "bad_request", f"malformed {msg_type.name} header: nested too deeply", self.req_id(frames[1])
            ) from None
        return msg_type, header, list(frames[2:])

    def decode_reply(self, frames: Sequence[Any], request: P.MsgType) -> Any:
        """A reply to ``request``; an ERROR reply is returned as :class:`protocol.ErrorReply`."""
        kind = bytes(frames[0])
        if kind == bytes((P.MsgType.ERROR,)):
            return self._error.decode(frames[1])
        return self._replies[request].decode(frames[1])


def _frame_nbytes(frame: Any) -> int:
    nbytes = getattr(frame, "nbytes", None)
    return nbytes if nbytes is not None else len(frame)


def zero_copy(frames: Sequence[Any]) -> bool:
    """Whether a message carries a buffer large enough to be worth sending with ``copy=False``."""
    return any(_frame_nbytes(f) >= ZERO_COPY_MIN_BYTES for f in frames)


def send_frames(sock: Any, frames: Sequence[Any], flags: int = 0) -> None:
    """Send a multipart message: zero-copy (``copy=False``) when it carries a large buffer, else copied."""
    if zero_copy(frames):
        sock.send_multipart(frames, flags, copy=False)
    else:
        sock.send_multipart(frames, flags)


def ipc_supported() -> bool:
    """Whether ZeroMQ's ipc:// transport with Linux abstract socket names is available here."""
    return sys.platform.startswith("linux") and zmq.has("ipc")


def tracked_frame(buffer: Any) -> zmq.Frame:
    """A zero-copy frame whose ``tracker`` says when ZeroMQ no longer reads ``buffer`` (any size)."""
    return zmq.Frame(buffer, copy=False, track=True)


# --------------------------------------------------------------------------------------------- tensors
def spec_nbytes(spec: P.TensorSpec) -> int:
    return math.prod(spec.shape) * DTYPES[spec.dtype].itemsize


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a 1-D uint8 tensor over the same memory (copies only if non-contiguous/GPU)."""
    t = tensor.detach()
    if not t.is_cpu:
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


def _host_array(tensor: torch.Tensor) -> Any:
    """A buffer-protocol view (numpy) of the tensor's bytes; zero-copy for contiguous CPU tensors.

    The fast path skips four tensor ops per tensor, which is most of the cost of a small put.
    """
    if (
        tensor.is_cpu
        and not tensor.requires_grad
        and tensor.dtype is not torch.bfloat16
        and tensor.is_contiguous()
    ):
        return tensor.numpy()
    return _flat_bytes(tensor).numpy()


def _dtype_name(tensor: torch.Tensor, name: str) -> str:
    dtype = DTYPE_NAMES.get(tensor.dtype)
    if dtype is None:
        raise TypeError(f"tensor `{name}` has dtype {tensor.dtype}; the queue carries {', '.join(DTYPES)}")
    return dtype


def pack_frames(
    tensors: Mapping[str, torch.Tensor], inline_bytes: int
) -> tuple[list[P.TensorSpec], list[Any]]:
    """Specs plus zero-copy buffers (one per tensor over ``inline_bytes``) for sending over a socket."""
    specs: list[P.TensorSpec] = []
    buffers: list[Any] = []
    for name, tensor in tensors.items():
        dtype = _dtype_name(tensor, name)
        raw = _host_array(tensor)
        shape = list(tensor.shape)
        if raw.nbytes <= inline_bytes:
            specs.append(P.TensorSpec(name, dtype, shape, data=raw.tobytes()))
        else:
            specs.append(P.TensorSpec(name, dtype, shape, frame=len(buffers)))
            buffers.append(raw)  # the array holds the tensor alive while ZeroMQ sends it
    return specs, buffers


def layout_region(tensors: Mapping[str, torch.Tensor], inline_bytes: int) -> tuple[list[P.TensorSpec], int]:
    """Specs that place the tensors in one region (64-byte aligned offsets) and the region's size."""
    specs: list[P.TensorSpec] = []
    size = 0
    for name, tensor in tensors.items():
        dtype = _dtype_name(tensor, name)
        nbytes = tensor.numel() * tensor.element_size()
        shape = list(tensor.shape)
        if nbytes <= inline_bytes:
            specs.append(P.TensorSpec(name, dtype, shape, data=_host_array(tensor).tobytes()))
            continue
        specs.append(P.TensorSpec(name, dtype, shape, frame=0, offset=size))
        size += -(-nbytes // ALIGN) * ALIGN
    return specs, size


def blob_layout(specs: Sequence[P.TensorSpec]) -> tuple[list[P.TensorSpec], int]:
    """Specs that place a group's non-inline tensors one after another in one blob (frame 0, 64-byte
    aligned offsets, like an arena region) and the blob's size; for writing groups to files."""
    out, size = [], 0
    for spec in specs:
        if spec.frame < 0:
            out.append(spec)
            continue
        out.append(P.TensorSpec(spec.name, spec.dtype, spec.shape, frame=0, offset=size))
        size += -(-spec_nbytes(spec) // ALIGN) * ALIGN
    return out, size


def bytes_view(buffer: Any) -> memoryview:
    """A flat byte view of a frame, array, mapping or bytes-like object (no copy)."""
    view = buffer.buffer if hasattr(buffer, "buffer") else memoryview(buffer)
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def layout_shapes(shapes: Mapping[str, tuple[Sequence[int], torch.dtype]]) -> tuple[list[P.TensorSpec], int]:
    """Specs that place tensors of the given shapes and dtypes in one region (none inline) and its size."""
    specs: list[P.TensorSpec] = []
    size = 0
    for name, (shape, dtype) in shapes.items():
        if dtype not in DTYPE_NAMES:
            raise TypeError(f"tensor `{name}` has dtype {dtype}; the queue carries {', '.join(DTYPES)}")
        specs.append(P.TensorSpec(name, DTYPE_NAMES[dtype], [int(d) for d in shape], frame=0, offset=size))
        size += -(-spec_nbytes(specs[-1]) // ALIGN) * ALIGN
    return specs, size


def region_extent(specs: Sequence[P.TensorSpec]) -> int:
    """Bytes of a region that its tensors span (offsets are aligned, so this can exceed their sum)."""
    end = 0
    for spec in specs:
        if spec.frame >= 0:
            end = max(end, spec.offset + spec_nbytes(spec))
    return end


def write_region(region: memoryview, tensors: Mapping[str, torch.Tensor], specs: list[P.TensorSpec]) -> None:
    """Copy each non-inline tensor into ``region`` (a writable view of an arena region) at its offset.

    Large contiguous CPU tensors (``BULK_COPY_MIN_BYTES`` or more) are copied with libc ``memmove`` in a
    few chunks on a few threads (the call releases the GIL). For copies far beyond the caches, glibc's
    ``memmove`` uses non-temporal stores, measured here at 1.5x ``Tensor.copy_`` for 256 MiB, and one
    core's copy does not use all of the memory bandwidth; for large payloads this copy is the whole cost of
    a put. (Ray's ``put`` copies the same way.) Smaller copies stay in cache, where ``copy_`` is as fast.
    """
    for spec in specs:
        if spec.frame < 0:
            continue
        src = tensors[spec.name].detach().reshape(-1)
        dst = torch.frombuffer(region, dtype=src.dtype, count=src.numel(), offset=spec.offset)
        nbytes = src.numel() * src.element_size()
        if nbytes >= BULK_COPY_MIN_BYTES and src.is_cpu and src.is_contiguous():
            _bulk_copy(dst.data_ptr(), src.data_ptr(), nbytes)
        else:
            dst.copy_(src)


BULK_COPY_MIN_BYTES = 16 << 20
_COPY_THREADS = max(1, min(4, os.cpu_count() or 1))
_copy_pool: ThreadPoolExecutor | None = None


def _bulk_copy(dst: int, src: int, nbytes: int) -> None:
    """``memmove`` of ``nbytes`` between two addresses the caller keeps alive, in page-aligned chunks."""
    global _copy_pool
    if _copy_pool is None:
        _copy_pool = ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="queue-copy")
    step = -(-nbytes // _COPY_THREADS)
    step = -(-step // 4096) * 4096
    jobs = [
        _copy_pool.submit(ctypes.memmove, dst + i, src + i, min(step, nbytes - i))
        for i in range(0, nbytes, step)
    ]
    for job in jobs:
        job.result()


def as_buffer(buffer: Any) -> memoryview:
    """A received frame or any bytes-like object as a writable memoryview over the same memory."""
    view = buffer.buffer if hasattr(buffer, "buffer") else memoryview(buffer)
    if view.readonly:
        view = memoryview(bytearray(view))  # torch views must be writable; only restored blobs hit this
    return view


def unpack(specs: Sequence[P.TensorSpec], buffers: Sequence[memoryview]) -> dict[str, torch.Tensor]:
    """Tensors from specs and buffers (see :func:`as_buffer`); frame tensors are views, not copies."""
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        dtype = DTYPES[spec.dtype]
        count = math.prod(spec.shape)
        if count == 0:
            out[spec.name] = torch.empty(spec.shape, dtype=dtype)
            continue
        if spec.frame < 0:
            t = torch.frombuffer(bytearray(spec.data), dtype=dtype)
        else:
            t = torch.frombuffer(buffers[spec.frame], dtype=dtype, count=count, offset=spec.offset)
        out[spec.name] = t if len(spec.shape) == 1 else t.reshape(spec.shape)
    return out


# ------------------------------------------------------------------------------------------ validation
def validate_group(
    meta: GroupMeta, specs: Sequence[P.TensorSpec], buffer_sizes: Sequence[int], exact: bool = False
) -> int:
    """Check a group's header and tensor specs against the buffers that came with it.

    Returns the payload size in bytes. Raises :class:`WireError` (``bad_request``) naming the first problem,
    so nothing half-valid is ever stored: after this, ``unpack`` cannot fail and the unpacked group
    satisfies ``TrajectoryGroup.validate``. Shapes are bounded (``MAX_DIMS`` dimensions, an extent of at most
    ``MAX_TENSOR_BYTES`` counting empty dimensions as 1, as torch's strides do), so a tensor with no elements
    cannot carry an overflowing shape. ``exact`` (socket puts): every buffer holds exactly one tensor, from
    its first byte to its last, so the bytes held are the bytes accounted. (Plain loops, no generators: this
    runs on every put.)
    """
    gid = meta.group_id
    if not meta.samples:
        raise WireError("bad_request", f"group {gid!r} has no samples")
    n_prompt = n_response = 0
    uids = set()
    for s in meta.samples:
        if s.prompt_len < 0 or s.response_len < 0:
            raise WireError("bad_request", f"group {gid!r}: negative prompt_len/response_len")
        n_prompt += s.prompt_len
        n_response += s.response_len
        uids.add(s.uid)
    if len(uids) != len(meta.samples):
        raise WireError("bad_request", f"group {gid!r}: duplicate uids within the group")
    n_image = _image_bytes(meta)
    names: set[str] = set()
    route_kinds = []  # (name, dtype, [layers, k]) of each route column
    total = 0
    for spec in specs:
        if spec.name in names:
            raise WireError("bad_request", f"group {gid!r}: tensor `{spec.name}` appears twice")
        names.add(spec.name)
        rows = (
            n_prompt if spec.name in PROMPT_ALIGNED else n_image if spec.name == IMAGE_COLUMN else n_response
        )
        total += _check_spec(gid, spec, buffer_sizes, rows)
        if spec.name == IMAGE_COLUMN and (len(spec.shape) != 1 or spec.dtype != "uint8"):
            raise WireError("bad_request", f"group {gid!r}: `{IMAGE_COLUMN}` must be one uint8 dimension")
        if spec.name in ROUTE_COLUMNS and (len(spec.shape) != 3 or spec.dtype not in ("uint8", "int16")):
            raise WireError(
                "bad_request", f"group {gid!r}: `{spec.name}` must be [tokens, layers, k] uint8 or int16"
            )
        if spec.name in ROUTE_COLUMNS:
            route_kinds.append((spec.name, spec.dtype, list(spec.shape[1:])))
    if len(names.intersection(ROUTE_COLUMNS)) == 1:
        raise WireError("bad_request", f"group {gid!r}: `prompt_routes` and `response_routes` come together")
    if len(route_kinds) == 2 and route_kinds[0][1:] != route_kinds[1][1:]:
        (a, a_dtype, a_shape), (b, b_dtype, b_shape) = route_kinds
        raise WireError(
            "bad_request",
            f"group {gid!r}: `{a}` is {a_dtype} [tokens, {a_shape[0]}, {a_shape[1]}] but `{b}` is {b_dtype} "
            f"[tokens, {b_shape[0]}, {b_shape[1]}]: a group's routes are of one model (layers, k) in one dtype",
        )
    if n_image and IMAGE_COLUMN not in names:
        raise WireError(
            "bad_request", f"group {gid!r}: the header lists images but `{IMAGE_COLUMN}` is missing"
        )
    if not _REQUIRED.issubset(names):
        missing = sorted(_REQUIRED - names)
        raise WireError("bad_request", f"group {gid!r}: missing column(s) {', '.join(missing)}")
    if exact:
        _check_exact(gid, specs, buffer_sizes)
    return total


def _image_bytes(meta: GroupMeta) -> int:
    """Bytes of the group's images by its header; refuses a negative size."""
    total = 0
    for n in meta.image_nbytes:
        if n <= 0:
            raise WireError("bad_request", f"group {meta.group_id!r}: an image of {n} bytes")
        total += n
    return total


def _check_exact(group_id: str, specs: Sequence[P.TensorSpec], buffer_sizes: Sequence[int]) -> None:
    """Each buffer is exactly one tensor's bytes (nothing unaccounted rides along)."""
    users = [0] * len(buffer_sizes)
    for spec in specs:
        if spec.frame < 0:
            continue
        users[spec.frame] += 1
        if spec.offset != 0 or spec_nbytes(spec) != buffer_sizes[spec.frame] or users[spec.frame] > 1:
            raise WireError(
                "bad_request",
                f"group {group_id!r}, tensor `{spec.name}`: frame {spec.frame} of {buffer_sizes[spec.frame]} "
                f"bytes must hold exactly this tensor's {spec_nbytes(spec)} bytes, at offset 0",
            )
    if 0 in users:
        raise WireError("bad_request", f"group {group_id!r}: frame {users.index(0)} belongs to no tensor")


_REQUIRED = frozenset((*PROMPT_COLUMNS, *RESPONSE_COLUMNS))
MAX_DIMS = 8
MAX_TENSOR_BYTES = 1 << 48


def _check_spec(group_id: str, spec: P.TensorSpec, buffer_sizes: Sequence[int], rows: int) -> int:
    dtype = DTYPES.get(spec.dtype)
    shape = spec.shape
    if dtype is None:
        raise WireError(
            "bad_request", f"group {group_id!r}, tensor `{spec.name}`: unknown dtype {spec.dtype!r}"
        )
    if not shape or len(shape) > MAX_DIMS or min(shape) < 0:
        raise WireError("bad_request", f"group {group_id!r}, tensor `{spec.name}`: bad shape {shape[:9]}")
    extent = dtype.itemsize
    for dim in shape:
        extent *= max(dim, 1)
    if extent > MAX_TENSOR_BYTES:
        raise WireError(
            "bad_request",
            f"group {group_id!r}, tensor `{spec.name}`: shape {shape} spans {extent} bytes (limit "
            f"{MAX_TENSOR_BYTES}, counting empty dimensions as 1)",
        )
    want_dtype = COLUMN_DTYPES.get(spec.name)
    if want_dtype is not None and dtype != want_dtype:
        raise WireError(
            "bad_request",
            f"group {group_id!r}, tensor `{spec.name}`: dtype {spec.dtype}, expected {DTYPE_NAMES[want_dtype]}",
        )
    if shape[0] != rows:
        raise WireError(
            "bad_request",
            f"group {group_id!r}, tensor `{spec.name}`: first dimension {shape[0]}, the header says {rows}",
        )
    nbytes = math.prod(shape) * dtype.itemsize
    if spec.frame < 0:
        if len(spec.data) != nbytes:
            raise WireError(
                "bad_request",
                f"group {group_id!r}, tensor `{spec.name}`: {len(spec.data)} inline bytes, shape needs {nbytes}",
            )
        return nbytes
    if spec.frame >= len(buffer_sizes):
        raise WireError(
            "bad_request",
            f"group {group_id!r}, tensor `{spec.name}`: frame {spec.frame} missing ({len(buffer_sizes)} sent)",
        )
    end = spec.offset + nbytes
    if spec.offset < 0 or spec.offset % dtype.itemsize or end > buffer_sizes[spec.frame]:
        raise WireError(
            "bad_request",
            f"group {group_id!r}, tensor `{spec.name}`: bytes [{spec.offset}, {end}) do not fit frame "
            f"{spec.frame} of {buffer_sizes[spec.frame]} bytes (or are misaligned)",
        )
    return nbytes
