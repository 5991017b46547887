"""Buckets: how a stream of named tensors becomes a few large flat transfers, and back again.

One collective per tensor is slow (a model has hundreds of small tensors, and every collective pays a fixed
latency), so the sender packs tensors as raw bytes into buckets of a fixed size and sends one flat buffer
per bucket. Bytes, because a bucket then mixes dtypes freely (fp8 included, which gloo cannot broadcast as
such) and the receiver rebuilds each tensor as a typed view of the bytes.

Sender side, :class:`BucketPacker` streams: it pulls one tensor at a time from the trainer's iterator,
copies it into a buffer of a :class:`BufferPool` (two buffers: one on the wire, one being packed) and drops
it, so the sender never holds more than two buckets beyond the model. Receiver side, :class:`StagingArea`
tells the transport where each payload must land (receive memory kept from one version to the next, so it
is never page-faulted again) and turns landed payloads into tensors without copying them.

Three layouts (:class:`Layout`), one packer:
  * ``slipstream`` (ours): 64-byte aligned entries, mixed dtypes, tensors larger than a bucket split into
    bucket-sized chunks (each chunk its own bucket, received straight into the full tensor);
  * ``sglang``: SGLang's ``flattened_bucket``: entries back to back, one dtype per bucket (its receiver
    concatenates typed empties, so a mixed bucket would be type-promoted), a tensor larger than the
    bucket alone in an oversized bucket;
  * ``vllm``: vLLM's packed broadcast: entries back to back, a bucket closes as soon as its size
    *exceeds* the capacity, exactly as ``packed_nccl_broadcast_consumer`` re-derives it from the names.

Why by hand: SGLang's ``FlattenedTensorBucket`` and vLLM's ``packed_tensor`` live inside those servers (not
importable by a CPU trainer), neither splits large tensors nor streams into reusable buffers; this module
reproduces their byte layouts so the adapters talk to real servers exactly.

Worked example::

    pool = BufferPool("cpu")
    for bucket in BucketPacker(model.named_parameters(), version=3, layout=Layout.slipstream(64 << 20),
                               pool=pool):
        transport.send(bucket.meta, bucket.data)   # then, once the payload has left:
        pool.release(bucket.slot)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from slipstream.utils import tensors as tensor_utils
from slipstream.utils.tensors import dtype_name
from slipstream.weightsync.digest import algorithm_for, digest
from slipstream.weightsync.types import DENSE, ENTRY_KINDS, BucketMeta, TensorEntry, VersionInfo


class BucketError(ValueError):
    """A bucket (or its metadata) that cannot be packed or unpacked as described."""


# What a refusal for a digest mismatch says, so a sender can count them (``sync/verify_failed``).
VERIFY_FAILED = "failed verification"


class DigestMismatch(BucketError):
    """A staged tensor's bytes differ from those the sender digested (``weightsync/digest.py``): the version
    is refused, and the server keeps serving the one it has."""


# ------------------------------------------------------------------------------------------------ dtypes


def parse_dtype(name: str) -> torch.dtype:
    """:func:`slipstream.utils.tensors.parse_dtype` for bucket metadata: a bad name is a :class:`BucketError`."""
    try:
        return tensor_utils.parse_dtype(name)
    except ValueError as err:
        raise BucketError(str(err)) from None


def tensor_nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    """:func:`slipstream.utils.tensors.shape_nbytes`; a negative dimension is a :class:`BucketError`."""
    try:
        return tensor_utils.shape_nbytes(shape, dtype)
    except ValueError as err:
        raise BucketError(str(err)) from None


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (a contiguous copy first if it is not contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8)


def _round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


# ------------------------------------------------------------------------------------------------ layout


@dataclass(frozen=True)
class Layout:
    """How tensors are placed in buckets (see the module docstring for the three named layouts)."""

    capacity: int
    align: int = 64
    split_large: bool = True
    single_dtype: bool = False
    overflow: bool = False
    # Tensors of at least this many bytes, already on the transport's device, are sent from their own
    # memory as separate segments instead of being copied into the bucket (0: always copy).
    direct_min_bytes: int = 0

    def __post_init__(self) -> None:
        if self.capacity < self.align or self.capacity % self.align:
            raise BucketError(f"bucket capacity {self.capacity} must be a positive multiple of {self.align}")

    @classmethod
    def slipstream(cls, capacity: int, direct_min_bytes: int = 0) -> Layout:
        return cls(capacity=_round_up(capacity, 64), direct_min_bytes=direct_min_bytes)

    @classmethod
    def sglang(cls, capacity: int) -> Layout:
        return cls(capacity=capacity, align=1, split_large=False, single_dtype=True)

    @classmethod
    def vllm(cls, capacity: int) -> Layout:
        return cls(capacity=capacity, align=1, split_large=False, overflow=True)


# ----------------------------------------------------------------------------------------------- buffers


class BufferPool:
    """A few reusable transfer buffers on one device; :meth:`acquire` blocks until one is free.

    Buffers grow when a bucket needs more room and are otherwise kept for the engine's lifetime, so after
    the first version no page is faulted in again. ``on_alloc`` sees every new buffer (NIXL registers it).
    """

    def __init__(
        self,
        device: str | torch.device = "cpu",
        slots: int = 2,
        on_alloc: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self.device = torch.device(device)
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._free = list(range(slots))
        self._cond = threading.Condition()
        self._on_alloc = on_alloc

    def preallocate(self, nbytes: int) -> None:
        for slot in range(len(self._buffers)):
            self._grow(slot, nbytes, keep=0)

    def buffer(self, slot: int) -> torch.Tensor:
        buf = self._buffers[slot]
        assert buf is not None
        return buf

    def acquire(self, nbytes: int, timeout: float | None = None) -> int:
        """A free slot whose buffer holds at least ``nbytes``; TimeoutError when none frees in time."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), timeout=timeout):
                raise TimeoutError(f"no transfer buffer was released within {timeout} s")
            slot = self._free.pop(0)
        self._grow(slot, nbytes, keep=0)
        return slot

    def ensure(self, slot: int, nbytes: int, keep: int) -> torch.Tensor:
        """Grow ``slot`` to ``nbytes`` if needed, keeping its first ``keep`` bytes."""
        return self._grow(slot, nbytes, keep)

    def release(self, slot: int) -> None:
        if slot < 0:  # a bucket that never came from the pool
            return
        with self._cond:
            if slot not in self._free:
                self._free.append(slot)
            self._cond.notify()

    def _grow(self, slot: int, nbytes: int, keep: int) -> torch.Tensor:
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:
            new = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
            if buf is not None and keep:
                new[:keep].copy_(buf[:keep])
            self._buffers[slot] = buf = new
            if self._on_alloc is not None:
                self._on_alloc(new)
        return buf

    @property
    def buffers(self) -> list[torch.Tensor]:
        return [b for b in self._buffers if b is not None]


# ----------------------------------------------------------------------------------------------- packing


@dataclass
class PackedBucket:
    """A bucket ready to send: ``data`` is ``meta.nbytes`` bytes of pool slot ``slot``.

    When ``meta.segments`` is set, the payload travels as those segments instead, and ``parts`` holds the
    bytes of each (pool-buffer slices for packed runs, the tensors' own memory for direct ones).
    """

    meta: BucketMeta
    data: torch.Tensor
    slot: int
    parts: list[torch.Tensor] = field(default_factory=list)

    def payloads(self) -> list[tuple[int, torch.Tensor]]:
        """``(offset, bytes)`` of every transfer this bucket needs, in order."""
        if not self.meta.segments:
            return [(0, self.data)] if self.meta.nbytes else []
        return [(off, part) for (off, _), part in zip(self.meta.segments, self.parts, strict=True)]


@dataclass
class _Pending:
    name: str
    data: torch.Tensor  # flat uint8 bytes of the whole tensor
    dtype: torch.dtype
    shape: list[int]
    kind: str = DENSE
    digest: int | None = None


@dataclass
class _Open:
    slot: int
    entries: list[TensorEntry] = field(default_factory=list)
    cursor: int = 0
    dtype: torch.dtype | None = None
    # (offset, length, bytes or None for a run packed into the pool buffer)
    segments: list[tuple[int, int, torch.Tensor | None]] = field(default_factory=list)


def split_item(item: tuple) -> tuple[str, torch.Tensor, str]:
    """``(name, tensor)`` or ``(name, tensor, kind)`` -> ``(name, tensor, kind)``, checked."""
    if len(item) == 2:
        (name, tensor), kind = item, DENSE
    else:
        name, tensor, kind = item
    if not isinstance(tensor, torch.Tensor):
        raise BucketError(f"`{name}`: expected a tensor, got {type(tensor).__name__}")
    if kind not in ENTRY_KINDS:
        raise BucketError(f"`{name}`: unknown entry kind `{kind}`")
    return name, tensor, kind


class BucketPacker:
    """Iterator of :class:`PackedBucket` for one version, pulled lazily from ``named_tensors``.

    Invariants: at most ``pool`` slots are held (the caller releases each bucket's slot once its payload
    has left); every tensor appears in exactly one bucket, or, when larger than the capacity in the
    ``slipstream`` layout, in consecutive single-entry chunk buckets; the last bucket has ``last=True``
    (a version with no tensors is one empty bucket, so receivers still see it complete).

    Items are ``(name, tensor)`` (a dense entry) or ``(name, tensor, kind)`` (any of ``ENTRY_KINDS``);
    ``info`` is stamped on every bucket (the send-less fields of :class:`BucketMeta`).
    """

    def __init__(
        self,
        named_tensors: Iterable[tuple],
        version: int,
        layout: Layout,
        pool: BufferPool,
        timeout_s: float = 300.0,
        info: VersionInfo | None = None,
        verify: bool = False,
    ) -> None:
        self._source: Iterator[tuple] = iter(named_tensors)
        self.info = info or VersionInfo()
        # Every entry carries its tensor's digest (weightsync/digest.py), by the pool's device's algorithm.
        self.digest = algorithm_for(pool.device) if verify else ""
        self.version = version
        self.layout = layout
        self.pool = pool
        self.timeout_s = timeout_s
        self._carry: _Pending | None = None
        self._chunk: tuple[_Pending, int] | None = None
        self._index = 0
        self._done = False
        self._held: int | None = None  # the slot of the bucket being filled, until it is handed out
        self.tensors = 0
        self.bytes = 0
        self.digest_s = 0.0  # spent digesting (``verify``): what verification costs the sender

    def __iter__(self) -> BucketPacker:
        return self

    def __next__(self) -> PackedBucket:
        if self._done:
            raise StopIteration
        try:
            return self._next()
        except BaseException:
            if self._held is not None:  # the bucket being filled will never be handed out
                self.pool.release(self._held)
            self._done = True
            raise
        finally:
            self._held = None

    def _next(self) -> PackedBucket:
        if self._chunk is not None:
            return self._next_chunk()
        bucket: _Open | None = None
        while True:
            item = self._take()
            if item is None:
                self._done = True
                return self._close(bucket or self._open(0), last=True)
            if bucket is not None and not self._fits(bucket, item):
                self._carry = item
                return self._close(bucket, last=False)
            if item.data.numel() > self.layout.capacity and not self.layout.overflow:
                if self.layout.split_large:
                    self._chunk = (item, 0)
                    return self._next_chunk()
                return self._close(self._place(self._open(item.data.numel()), item), last=self._peek_end())
            bucket = self._place(bucket or self._open(self.layout.capacity), item)
            if self.layout.overflow and bucket.cursor > self.layout.capacity:
                return self._close(bucket, last=self._peek_end())

    # -- helpers

    def _take(self) -> _Pending | None:
        if self._carry is not None:
            item, self._carry = self._carry, None
            return item
        try:
            item = next(self._source)
        except StopIteration:
            return None
        name, tensor, kind = split_item(item)
        self.tensors += 1
        data = as_bytes(tensor)
        stamp = None
        if self.digest:
            began = time.perf_counter()
            stamp = digest(data, self.digest)
            self.digest_s += time.perf_counter() - began
        return _Pending(name, data, tensor.dtype, list(tensor.shape), kind, stamp)

    def _peek_end(self) -> bool:
        """True when the source is exhausted (one item is pulled ahead and carried)."""
        if self._carry is None:
            self._carry = self._take()
        if self._carry is None:
            self._done = True
            return True
        return False

    def _fits(self, bucket: _Open, item: _Pending) -> bool:
        if self.layout.single_dtype and bucket.dtype not in (None, item.dtype):
            return False
        if self.layout.overflow:
            return True
        start = _round_up(bucket.cursor, self.layout.align)
        return start + item.data.numel() <= self.layout.capacity

    def _open(self, nbytes: int) -> _Open:
        self._held = self.pool.acquire(nbytes, timeout=self.timeout_s)
        return _Open(slot=self._held)

    def _direct(self, data: torch.Tensor) -> bool:
        limit = self.layout.direct_min_bytes
        return bool(limit) and data.numel() >= limit and data.device == self.pool.device

    def _place(self, bucket: _Open, item: _Pending) -> _Open:
        start = _round_up(bucket.cursor, self.layout.align)
        end = start + item.data.numel()
        self._put(bucket, start, item.data)
        entry = TensorEntry(
            item.name, dtype_name(item.dtype), item.shape, start, end - start, 0, item.kind, item.digest
        )
        bucket.entries.append(entry)
        bucket.cursor = end
        bucket.dtype = item.dtype
        return bucket

    def _put(self, bucket: _Open, start: int, data: torch.Tensor) -> None:
        """Copy ``data`` into the bucket at ``start``, or reference it as a direct segment."""
        end = start + data.numel()
        if self._direct(data):
            bucket.segments.append((start, end - start, data))
            return
        buf = self.pool.ensure(bucket.slot, end, keep=bucket.cursor)
        buf[start:end].copy_(data)
        last = bucket.segments[-1] if bucket.segments else None
        if last is not None and last[2] is None:  # extend the packed run (padding included)
            bucket.segments[-1] = (last[0], end - last[0], None)
        else:
            bucket.segments.append((start, end - start, None))

    def _next_chunk(self) -> PackedBucket:
        assert self._chunk is not None
        item, offset = self._chunk
        size = min(self.layout.capacity, item.data.numel() - offset)
        bucket = self._open(size)
        self._put(bucket, 0, item.data[offset : offset + size])
        entry = TensorEntry(
            item.name, dtype_name(item.dtype), item.shape, 0, size, offset, item.kind, item.digest
        )
        bucket.entries.append(entry)
        bucket.cursor = size
        offset += size
        if offset < item.data.numel():
            self._chunk = (item, offset)
            return self._close(bucket, last=False)
        self._chunk = None
        return self._close(bucket, last=self._peek_end())

    def _close(self, bucket: _Open, last: bool) -> PackedBucket:
        buf = self.pool.buffer(bucket.slot)
        single = len(bucket.segments) == 1 and bucket.segments[0][2] is None and bucket.segments[0][0] == 0
        segments = [] if single or not bucket.segments else [(o, n) for o, n, _ in bucket.segments]
        parts = (
            [] if not segments else [d if d is not None else buf[o : o + n] for o, n, d in bucket.segments]
        )
        meta = BucketMeta(
            version=self.version,
            index=self._index,
            nbytes=bucket.cursor,
            entries=bucket.entries,
            last=last,
            segments=segments,
            base=self.info.base,
            keep=self.info.keep,
            lora_scale=self.info.lora_scale,
            digest=self.digest,
        )
        self._index += 1
        self.bytes += bucket.cursor
        return PackedBucket(meta=meta, data=buf[: bucket.cursor], slot=bucket.slot, parts=parts)


# ----------------------------------------------------------------------------------------------- staging


def check_meta(meta: BucketMeta) -> None:
    """Raise :class:`BucketError` naming the first entry that does not fit the bucket it claims."""
    cursor = 0
    for off, n in meta.segments:
        if off < cursor or n < 0 or off + n > meta.nbytes:
            raise BucketError(f"bucket {meta.index}: segment ({off}, {n}) overlaps or leaves the payload")
        cursor = off + n
    for entry in meta.entries:
        if entry.kind not in ENTRY_KINDS:
            raise BucketError(
                f"bucket {meta.index} of version {meta.version}: `{entry.name}` is a `{entry.kind}` entry; "
                f"this receiver reads only {', '.join(ENTRY_KINDS)} entries"
            )
        full = tensor_nbytes(entry.shape, parse_dtype(entry.dtype))
        if entry.offset < 0 or entry.nbytes < 0 or entry.offset + entry.nbytes > meta.nbytes:
            raise BucketError(
                f"bucket {meta.index} of version {meta.version}: `{entry.name}` bytes "
                f"[{entry.offset}, {entry.offset + entry.nbytes}) lie outside the {meta.nbytes}-byte payload"
            )
        if entry.chunk_offset < 0 or entry.chunk_offset + entry.nbytes > full:
            raise BucketError(
                f"bucket {meta.index}: `{entry.name}` chunk [{entry.chunk_offset}, "
                f"{entry.chunk_offset + entry.nbytes}) exceeds the tensor's {full} bytes"
            )


def flattened_meta(
    names: list[str], dtypes: list[str], shapes: list[list[int]], version: int, index: int
) -> BucketMeta:
    """The layout SGLang's ``flattened_bucket`` implies: tensors back to back in ``names`` order."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise BucketError(
            f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})"
        )
    entries, cursor = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        nbytes = tensor_nbytes(shape, parse_dtype(dtype))
        entries.append(TensorEntry(name, dtype_name(parse_dtype(dtype)), list(shape), cursor, nbytes))
        cursor += nbytes
    return BucketMeta(version=version, index=index, nbytes=cursor, entries=entries)


class StagingArea:
    """Receive memory of one receiver, reused version after version, and the tensors staged so far.

    Lifecycle per version: :meth:`begin`; for each bucket :meth:`destination` (where the transport must
    put the payload) then :meth:`commit` (the tensors it completed); :attr:`staged` once ``last`` has been
    committed and :attr:`complete` is true; :meth:`begin` again for the next version.

    Staged tensors are views of this area's buffers: they stay valid until the next :meth:`begin`, so a
    target must copy them in (``apply_weights``) before the next version is received.

    Dense entries are staged in :attr:`staged` by name (and returned by :meth:`commit`); entries of any
    other kind in :attr:`parts` by ``(kind, name)``, with the version's send-less fields in :attr:`info`
    (``weightsync/send_less.py`` rebuilds full tensors from them).
    """

    def __init__(
        self, device: str | torch.device = "cpu", on_alloc: Callable[[torch.Tensor], None] | None = None
    ) -> None:
        self.device = torch.device(device)
        self._on_alloc = on_alloc
        self._buckets: dict[int, torch.Tensor] = {}
        self._full: dict[str, torch.Tensor] = {}
        self._direct: set[int] = set()
        self._partial: dict[str, int] = {}
        self.staged: dict[str, torch.Tensor] = {}
        self.parts: dict[tuple[str, str], torch.Tensor] = {}
        self.info: VersionInfo | None = None
        self.version: int | None = None
        self.nbytes = 0
        self.saw_last = False
        self.verify_s = 0.0  # this version's digest checks (``weightsync.verify``): what they cost the receiver

    def begin(self, version: int) -> None:
        self.version = version
        self.staged = {}
        self.parts = {}
        self.info = None
        self._partial = {}
        self._direct = set()
        self.nbytes = 0
        self.saw_last = False
        self.verify_s = 0.0

    @property
    def complete(self) -> bool:
        return self.saw_last and not self._partial

    @property
    def partial_names(self) -> list[str]:
        """Tensors of which some chunks, but not all, have arrived."""
        return sorted(self._partial)

    def destination(self, meta: BucketMeta) -> torch.Tensor:
        """A uint8 tensor of ``meta.nbytes`` where this bucket's payload must land."""
        check_meta(meta)
        if meta.version != self.version:
            raise BucketError(
                f"bucket of version {meta.version} arrived while staging version {self.version}"
            )
        info = VersionInfo.of(meta)
        if self.info is not None and info != self.info:
            raise BucketError(
                f"bucket {meta.index} of version {meta.version}: {info}, earlier buckets {self.info}"
            )
        self.info = info
        if len(meta.entries) == 1 and self._is_chunk(meta.entries[0]):
            entry = meta.entries[0]
            self._direct.add(meta.index)
            full = self._full_tensor(entry)
            return full.reshape(-1).view(torch.uint8)[entry.chunk_offset : entry.chunk_offset + entry.nbytes]
        buf = self._buckets.get(meta.index)
        if buf is None or buf.numel() < meta.nbytes:
            buf = self._alloc(meta.nbytes)
            self._buckets[meta.index] = buf
        return buf[: meta.nbytes]

    def commit(self, meta: BucketMeta) -> list[tuple[str, torch.Tensor]]:
        """Record a landed payload; return the tensors it completed, in bucket order."""
        done: list[tuple[str, torch.Tensor]] = []
        direct = meta.index in self._direct
        buf = None if direct else self._buckets[meta.index][: meta.nbytes]
        for entry in meta.entries:
            dtype = parse_dtype(entry.dtype)
            if not self._is_chunk(entry):
                assert buf is not None
                raw = buf[entry.offset : entry.offset + entry.nbytes]
                self._verify(entry, raw, meta.digest)
                self._stage(entry, _typed_view(raw, dtype, entry.shape), done)
                continue
            full = self._full_tensor(entry)
            if not direct:
                assert buf is not None
                dst = full.reshape(-1).view(torch.uint8)
                dst[entry.chunk_offset : entry.chunk_offset + entry.nbytes].copy_(
                    buf[entry.offset : entry.offset + entry.nbytes]
                )
            key = _key(entry)
            got = self._partial.get(key, 0) + entry.nbytes
            if got >= tensor_nbytes(entry.shape, dtype):
                self._partial.pop(key, None)
                self._verify(entry, full.reshape(-1).view(torch.uint8), meta.digest)
                self._stage(entry, full, done)
            else:
                self._partial[key] = got
        self.nbytes += meta.nbytes
        self.saw_last = self.saw_last or meta.last
        return done

    # -- helpers

    def _verify(self, entry: TensorEntry, raw: torch.Tensor, algo: str) -> None:
        if entry.digest is None or not algo:
            return
        began = time.perf_counter()
        try:
            _verify(entry, raw, algo)
        finally:
            self.verify_s += time.perf_counter() - began

    def _stage(self, entry: TensorEntry, tensor: torch.Tensor, done: list) -> None:
        if entry.kind == DENSE:
            self.staged[entry.name] = tensor
            done.append((entry.name, tensor))
        else:
            self.parts[(entry.kind, entry.name)] = tensor

    @staticmethod
    def _is_chunk(entry: TensorEntry) -> bool:
        return entry.chunk_offset > 0 or entry.nbytes < tensor_nbytes(entry.shape, parse_dtype(entry.dtype))

    def _full_tensor(self, entry: TensorEntry) -> torch.Tensor:
        dtype = parse_dtype(entry.dtype)
        full = self._full.get(_key(entry))
        if full is None or full.dtype != dtype or list(full.shape) != list(entry.shape):
            full = torch.empty(entry.shape, dtype=dtype, device=self.device)
            if self._on_alloc is not None:
                self._on_alloc(full)
            self._full[_key(entry)] = full
        return full

    def _alloc(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        if self._on_alloc is not None:
            self._on_alloc(buf)
        return buf


def _verify(entry: TensorEntry, raw: torch.Tensor, algo: str) -> None:
    """:class:`DigestMismatch` when the sender stamped a digest and ``raw`` (the tensor's staged bytes) differs."""
    if entry.digest is None or not algo:
        return
    got = digest(raw, algo)
    if got != entry.digest:
        raise DigestMismatch(
            f"`{entry.name}` {VERIFY_FAILED}: its {raw.numel()} staged bytes have {algo} digest {got}, the "
            f"sender's had {entry.digest} (corrupted in transit or in the receive buffer)"
        )


def _key(entry: TensorEntry) -> str:
    """Where a chunked entry is assembled: by name for dense tensors, by kind and name otherwise."""
    return entry.name if entry.kind == DENSE else f"{entry.kind}:{entry.name}"


def _typed_view(raw: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """``raw`` (uint8) seen as ``dtype``/``shape``; a copy only when the bytes are misaligned for it."""
    try:
        return raw.view(dtype).view(shape)
    except RuntimeError:
        out = torch.empty(shape, dtype=dtype, device=raw.device)
        out.reshape(-1).view(torch.uint8).copy_(raw)
        return out


def segments_of(meta: BucketMeta) -> list[tuple[int, int]]:
    """The byte ranges of a bucket's payload that travel as separate transfers."""
    return list(meta.segments) if meta.segments else ([(0, meta.nbytes)] if meta.nbytes else [])


def per_tensor_buckets(
    named_tensors: Iterable[tuple],
    version: int,
    device: torch.device,
    info: VersionInfo | None = None,
    verify: bool = False,
) -> Iterator[PackedBucket]:
    """One bucket per tensor, without packing (the ``naive`` baseline); ``slot`` is -1 (no pool)."""
    info = info or VersionInfo()
    algo = algorithm_for(device) if verify else ""
    stamp = {"base": info.base, "keep": info.keep, "lora_scale": info.lora_scale, "digest": algo}
    source = iter(named_tensors)
    item = next(source, None)
    if item is None:
        empty = BucketMeta(version=version, index=0, nbytes=0, entries=[], last=True, **stamp)
        yield PackedBucket(empty, _EMPTY, -1)
        return
    index = 0
    while item is not None:
        following = next(source, None)
        name, tensor, kind = split_item(item)
        data = as_bytes(tensor).to(device)
        mark = digest(data, algo) if algo else None
        entry = TensorEntry(
            name, dtype_name(tensor.dtype), list(tensor.shape), 0, data.numel(), 0, kind, mark
        )
        meta = BucketMeta(
            version=version,
            index=index,
            nbytes=data.numel(),
            entries=[entry],
            last=following is None,
            **stamp,
        )
        yield PackedBucket(meta, data, -1)
        index, item = index + 1, following


_EMPTY = torch.empty(0, dtype=torch.uint8)
