"""Bucket packing and staging: every layout round-trips bit-exactly, and each follows its server's rules."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from wsync_helpers import BIG_NUMEL, digest, mixed_tensors

from slipstream.weightsync.buckets import (
    BucketError,
    BucketPacker,
    BufferPool,
    Layout,
    StagingArea,
    check_meta,
    flattened_meta,
    parse_dtype,
    per_tensor_buckets,
    segments_of,
)
from slipstream.weightsync.types import BucketMeta, TensorEntry

MiB = 1 << 20


def roundtrip(named, layout: Layout, version: int = 1) -> tuple[dict[str, torch.Tensor], list[BucketMeta]]:
    """Pack, 'transfer' each payload segment into the receiver's destination, commit; return what staged."""
    pool, staging = BufferPool("cpu"), StagingArea("cpu")
    staging.begin(version)
    metas = []
    for bucket in BucketPacker(named, version, layout, pool, timeout_s=5):
        dest = staging.destination(bucket.meta)
        for off, part in bucket.payloads():
            dest[off : off + part.numel()].copy_(part)
        staging.commit(bucket.meta)
        metas.append(bucket.meta)
        pool.release(bucket.slot)
    assert staging.complete
    return staging.staged, metas


def test_slipstream_layout_roundtrips_mixed_dtypes_fp8_and_a_tensor_larger_than_a_bucket():
    named = mixed_tensors(3)
    staged, metas = roundtrip(named, Layout.slipstream(MiB, direct_min_bytes=MiB))
    assert digest(staged) == digest(named)
    assert [m.index for m in metas] == list(range(len(metas)))
    assert [m.last for m in metas] == [False] * (len(metas) - 1) + [True]
    chunks = [e for m in metas for e in m.entries if e.name == "embed.weight"]
    assert len(chunks) == math.ceil(BIG_NUMEL * 4 / MiB)  # split into bucket-sized chunks
    assert sum(c.nbytes for c in chunks) == BIG_NUMEL * 4
    assert all(e.offset % 64 == 0 for m in metas for e in m.entries)  # aligned: received as typed views
    direct = [m for m in metas if any(e.name == "layers.1.mlp.gate.weight" for e in m.entries)][0]
    assert direct.segments, "a tensor over direct_min_bytes travels as its own segment"


def test_every_bucket_fits_the_capacity_and_the_sender_holds_at_most_two_buffers():
    named = mixed_tensors(1)
    pool = BufferPool("cpu", slots=2)
    held = []
    packer = BucketPacker(named, 1, Layout.slipstream(MiB), pool, timeout_s=5)
    for bucket in packer:
        assert bucket.meta.nbytes <= MiB
        held.append(bucket)
        if len(held) == 2:
            pool.release(held.pop(0).slot)
    assert len(pool.buffers) == 2
    # a packer that is not given buffers back waits, and gives up after its timeout
    one = BufferPool("cpu", slots=1)
    stuck = BucketPacker(mixed_tensors(1), 1, Layout.slipstream(MiB), one, timeout_s=0.05)
    next(stuck)
    with pytest.raises(TimeoutError, match="no transfer buffer"):
        next(stuck)


def test_sglang_layout_keeps_one_dtype_per_bucket_and_packs_back_to_back():
    named = mixed_tensors(2)
    staged, metas = roundtrip(named, Layout.sglang(4 * MiB))
    assert digest(staged) == digest(named)
    for meta in metas:
        assert len({e.dtype for e in meta.entries}) == 1
        assert not meta.segments
        # exactly SGLang's flattened_bucket layout for these names/dtypes/shapes
        names, dtypes, shapes = zip(*[(e.name, e.dtype, e.shape) for e in meta.entries], strict=True)
        flat = flattened_meta(list(names), list(dtypes), list(shapes), meta.version, meta.index)
        assert [(e.offset, e.nbytes) for e in flat.entries] == [(e.offset, e.nbytes) for e in meta.entries]


def test_sglang_layout_sends_a_tensor_larger_than_the_bucket_whole_and_alone():
    named = [("a", torch.ones(10)), ("big", torch.arange(1000.0)), ("b", torch.ones(10))]
    staged, metas = roundtrip(named, Layout.sglang(1024))
    assert [[e.name for e in m.entries] for m in metas] == [["a"], ["big"], ["b"]]
    assert torch.equal(staged["big"], torch.arange(1000.0))


def vllm_consumer_groups(named, capacity: int) -> list[list[str]]:
    """How vLLM 0.33's packed_nccl_broadcast_consumer re-derives buckets from the names it is sent."""
    groups, current, size = [], [], 0
    for name, t in named:
        current.append(name)
        size += t.numel() * t.element_size()
        if size > capacity:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


def test_vllm_layout_matches_the_boundaries_vllm_derives():
    named = mixed_tensors(4)
    capacity = 600_000
    staged, metas = roundtrip(named, Layout.vllm(capacity))
    assert digest(staged) == digest(named)
    assert [[e.name for e in m.entries] for m in metas] == vllm_consumer_groups(named, capacity)


def test_an_empty_version_is_one_empty_final_bucket():
    staged, metas = roundtrip([], Layout.slipstream(MiB))
    assert staged == {} and len(metas) == 1 and metas[0].last and metas[0].nbytes == 0


def test_per_tensor_buckets_hold_one_tensor_each():
    named = mixed_tensors(5)
    buckets = list(per_tensor_buckets(named, 5, torch.device("cpu")))
    assert [b.meta.entries[0].name for b in buckets] == [n for n, _ in named]
    assert [b.meta.last for b in buckets][-1] and not any(b.meta.last for b in buckets[:-1])


def test_staging_is_reused_from_one_version_to_the_next():
    staging = StagingArea("cpu")
    pool = BufferPool("cpu")
    addresses = []
    for version in (1, 2):
        staging.begin(version)
        for bucket in BucketPacker(mixed_tensors(version), version, Layout.slipstream(MiB), pool):
            dest = staging.destination(bucket.meta)
            addresses.append(dest.data_ptr())
            for off, part in bucket.payloads():
                dest[off : off + part.numel()].copy_(part)
            staging.commit(bucket.meta)
            pool.release(bucket.slot)
        assert digest(staging.staged) == digest(mixed_tensors(version))
    half = len(addresses) // 2
    assert addresses[:half] == addresses[half:]  # same receive memory: never page-faulted again


def test_bad_metadata_is_refused_with_the_name_of_what_is_wrong():
    entry = TensorEntry("w", "float32", [4], 8, 16)
    with pytest.raises(BucketError, match="`w` bytes"):
        check_meta(BucketMeta(version=1, index=0, nbytes=16, entries=[entry]))
    with pytest.raises(BucketError, match="unknown dtype `float33`"):
        parse_dtype("float33")
    with pytest.raises(BucketError, match="differ in length"):
        flattened_meta(["a", "b"], ["float32"], [[1]], 1, 0)
    with pytest.raises(BucketError, match="segment"):
        check_meta(BucketMeta(version=1, index=0, nbytes=8, entries=[], segments=[(0, 8), (4, 4)]))
    staging = StagingArea("cpu")
    staging.begin(2)
    with pytest.raises(BucketError, match="version 1 arrived while staging version 2"):
        staging.destination(BucketMeta(version=1, index=0, nbytes=0, entries=[]))


def test_an_entry_that_is_not_a_dense_tensor_is_refused_at_its_bucket_before_a_byte_lands():
    """A sender that knows more payload kinds (a delta, an adapter-only set) never has its bytes read as
    dense values by a receiver that does not; entries without a kind (older senders) are dense."""
    staging = StagingArea("cpu")
    staging.begin(3)
    delta = TensorEntry("w", "float32", [4], 0, 16, 0, "delta")
    with pytest.raises(BucketError, match="`w` is a `delta` entry; this receiver reads only dense"):
        staging.destination(BucketMeta(version=3, index=0, nbytes=16, entries=[delta], last=True))
    assert staging.staged == {} and not staging.complete
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(["w", "float32", [4], 0, 16, 0]), type=TensorEntry)
    assert old.kind == "dense"


def test_segments_default_to_the_whole_payload():
    assert segments_of(BucketMeta(version=1, index=0, nbytes=10, entries=[])) == [(0, 10)]
    assert segments_of(BucketMeta(version=1, index=0, nbytes=0, entries=[])) == []


DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.int64,
    torch.uint8,
    torch.bool,
]


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(0, 3000), st.sampled_from(range(len(DTYPES)))), max_size=12),
    capacity=st.sampled_from([64, 256, 4096]),
    kind=st.sampled_from(["slipstream", "sglang", "vllm"]),
    direct=st.sampled_from([0, 512]),
)
def test_any_tensor_stream_roundtrips_bit_exactly(sizes, capacity, kind, direct):
    g = torch.Generator().manual_seed(len(sizes))
    named = [
        (f"t{i}", torch.randint(0, 255, (n,), generator=g, dtype=torch.uint8).view(-1).to(torch.uint8))
        for i, (n, _) in enumerate(sizes)
    ]
    named = [(name, _as_dtype(t, DTYPES[d])) for (name, t), (_, d) in zip(named, sizes, strict=True)]
    layout = {
        "slipstream": Layout.slipstream(capacity, direct_min_bytes=direct),
        "sglang": Layout.sglang(capacity),
        "vllm": Layout.vllm(capacity),
    }[kind]
    staged, _ = roundtrip(named, layout)
    assert digest(staged) == digest(named)


def _as_dtype(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret random bytes as ``dtype`` (trimming to whole elements), so every bit pattern occurs."""
    if dtype == torch.bool:
        return raw % 2 == 1
    n = raw.numel() // dtype.itemsize * dtype.itemsize
    return raw[:n].view(dtype)


def test_a_failing_tensor_iterator_gives_the_buffer_back():
    def broken():
        yield "a", torch.ones(10)
        raise RuntimeError("gather failed")

    pool = BufferPool("cpu", slots=1)
    with pytest.raises(RuntimeError, match="gather failed"):
        list(BucketPacker(broken(), 1, Layout.slipstream(MiB), pool, timeout_s=1))
    pool.acquire(1, timeout=0.1)  # the only slot is free again
