"""Wire codec: tensors survive the trip bit for bit, and every malformed input is a clear WireError."""

from __future__ import annotations

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.queue import codec as C
from slipstream.queue import protocol as P
from slipstream.queue.testing import make_group
from slipstream.queue.types import COLUMN_DTYPES


def _roundtrip_frames(tensors, inline=512):
    specs, buffers = C.pack_frames(tensors, inline)
    # what the receiver gets: the bytes of each frame, nothing else
    received = [C.as_buffer(bytearray(memoryview(b).cast("B"))) for b in buffers]
    return C.unpack(specs, received)


@pytest.mark.parametrize("dtype", list(C.DTYPES.values()))
def test_every_dtype_roundtrips_through_frames_and_inline(dtype):
    big = (torch.arange(3000) % 7).to(dtype).reshape(1000, 3)
    small = (torch.arange(5) % 2).to(dtype)
    out = _roundtrip_frames({"big": big, "small": small, "empty": torch.empty(0, 4, dtype=dtype)})
    assert torch.equal(out["big"], big) and out["big"].dtype == dtype
    assert torch.equal(out["small"], small)
    assert out["empty"].shape == (0, 4)


def test_non_contiguous_tensors_are_sent_by_value():
    base = torch.arange(4000, dtype=torch.int32).reshape(40, 100)
    view = base.t()[::2]
    out = _roundtrip_frames({"v": view})
    assert torch.equal(out["v"], view)


def test_region_layout_is_aligned_and_roundtrips():
    group = make_group("g", n=3, payload=100)
    specs, size = C.layout_region(group.tensors, inline_bytes=16)
    assert all(s.offset % C.ALIGN == 0 for s in specs if s.frame == 0)
    region = memoryview(bytearray(size))
    C.write_region(region, group.tensors, specs)
    out = C.unpack(specs, [region])
    for name, t in group.tensors.items():
        assert torch.equal(out[name], t), name
    assert C.validate_group(group.meta, specs, [size]) == group.nbytes


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(0, 50),
    cols=st.integers(1, 40),
    inline=st.integers(0, 2048),
    dtype=st.sampled_from(sorted(C.DTYPES)),
)
def test_pack_unpack_property(rows, cols, inline, dtype):
    t = (torch.arange(rows * cols) % 13).to(C.DTYPES[dtype]).reshape(rows, cols)
    out = _roundtrip_frames({"t": t}, inline)
    assert torch.equal(out["t"], t)


def _specs_of(group):
    return C.pack_frames(group.tensors, 0)


def test_validate_group_names_the_problem():
    group = make_group("g", n=2, payload=8)
    specs, buffers = _specs_of(group)
    sizes = [memoryview(b).nbytes for b in buffers]
    assert C.validate_group(group.meta, specs, sizes) == group.nbytes

    cases = {
        "missing column": [s for s in specs if s.name != "versions"],
        "frame 9 missing": [msgspec.structs.replace(s, frame=9) if s.name == "payload" else s for s in specs],
        "dtype float32, expected int32": [
            msgspec.structs.replace(s, dtype="float32") if s.name == "versions" else s for s in specs
        ],
        "first dimension 99": [
            msgspec.structs.replace(s, shape=[99]) if s.name == "logprobs" else s for s in specs
        ],
        "unknown dtype": [
            msgspec.structs.replace(s, dtype="complex64") if s.name == "payload" else s for s in specs
        ],
        "do not fit": [msgspec.structs.replace(s, offset=4) if s.name == "payload" else s for s in specs],
        "appears twice": [*specs, specs[0]],
    }
    for expected, bad in cases.items():
        with pytest.raises(C.WireError, match=expected) as err:
            C.validate_group(group.meta, bad, sizes)
        assert err.value.kind == "bad_request"
    empty = msgspec.structs.replace(group.meta, samples=[])
    with pytest.raises(C.WireError, match="no samples"):
        C.validate_group(empty, specs, sizes)


def _zero_rows_meta():
    from slipstream.queue.types import GroupMeta, SampleMeta

    return GroupMeta("z", [SampleMeta("z-0", 0, 0, 0, 0)])


def _empty_columns(rows_shape=(0,)):
    return [
        P.TensorSpec(name, C.DTYPE_NAMES[dtype], list(rows_shape)) for name, dtype in COLUMN_DTYPES.items()
    ]


def test_a_tensor_without_elements_cannot_carry_an_overflowing_shape():
    meta = _zero_rows_meta()
    assert C.validate_group(meta, _empty_columns(), []) == 0
    huge = P.TensorSpec("extra", "float32", [0, 2**62, 2**62])  # no bytes, but strides overflow int64
    with pytest.raises(C.WireError, match=r"spans \d+ bytes"):
        C.validate_group(meta, [*_empty_columns(), huge], [])
    deep = P.TensorSpec("extra", "uint8", [0] + [1] * 8)
    with pytest.raises(C.WireError, match="bad shape"):
        C.validate_group(meta, [*_empty_columns(), deep], [])


def test_socket_put_frames_hold_exactly_their_tensors():
    group = make_group("g", n=2, payload=8)
    specs, buffers = _specs_of(group)
    sizes = [memoryview(b).nbytes for b in buffers]
    assert C.validate_group(group.meta, specs, sizes, exact=True) == group.nbytes
    padded = [n + 1_000_000 for n in sizes]  # bytes held but never accounted
    with pytest.raises(C.WireError, match="must hold exactly"):
        C.validate_group(group.meta, specs, padded, exact=True)
    with pytest.raises(C.WireError, match="belongs to no tensor"):
        C.validate_group(group.meta, specs, [*sizes, 10], exact=True)
    C.validate_group(group.meta, specs, padded)  # an arena region or a snapshot blob may be larger


def test_decode_request_rejects_malformed_messages():
    codec = C.Codec()
    good = codec.encode(P.MsgType.PING, P.PingRequest(7))
    assert codec.decode_request(good, P.CONTROLLER_TYPES, 1 << 20)[1].req_id == 7
    with pytest.raises(C.WireError, match="truncated"):
        codec.decode_request(good[:1], P.CONTROLLER_TYPES, 1 << 20)
    with pytest.raises(C.WireError, match="unknown message type"):
        codec.decode_request([b"\x42", good[1]], P.CONTROLLER_TYPES, 1 << 20)
    with pytest.raises(C.WireError, match="not served here") as err:
        codec.decode_request(codec.encode(P.MsgType.PUT, P.PingRequest(3)), P.CONTROLLER_TYPES, 1 << 20)
    assert err.value.req_id == 3
    with pytest.raises(C.WireError, match="malformed LEASE header"):
        codec.decode_request([bytes([P.MsgType.LEASE]), good[1]], P.CONTROLLER_TYPES, 1 << 20)
    with pytest.raises(C.WireError, match="exceeds max_message_bytes") as err:
        codec.decode_request([*good, b"x" * 2000], P.CONTROLLER_TYPES, 1024)
    assert err.value.kind == "too_large"


def test_unsupported_dtype_is_refused_by_name():
    with pytest.raises(TypeError, match="tensor `c` has dtype torch.complex64"):
        C.pack_frames({"c": torch.zeros(3, dtype=torch.complex64)}, 0)


@pytest.mark.parametrize("dtype", list(C.DTYPES.values()))
def test_every_dtype_roundtrips_through_a_region(dtype):
    tensors = {
        "a": (torch.arange(999) % 5).to(dtype),  # odd sizes: the next offset needs alignment padding
        "b": (torch.arange(3000) % 3).to(dtype).reshape(1000, 3).t(),  # non-contiguous
    }
    specs, size = C.layout_region(tensors, inline_bytes=0)
    assert C.region_extent(specs) <= size
    region = memoryview(bytearray(size))
    C.write_region(region, tensors, specs)
    out = C.unpack(specs, [region[: C.region_extent(specs)]])
    for name, t in tensors.items():
        assert torch.equal(out[name], t), name


def test_bulk_copies_in_chunks_land_every_byte(monkeypatch):
    monkeypatch.setattr(C, "BULK_COPY_MIN_BYTES", 10_000)
    monkeypatch.setattr(C, "_COPY_THREADS", 3)  # chunk edges away from any natural boundary
    tensors = {
        "odd": (torch.arange(100_003) % 251).to(torch.uint8),
        "wide": torch.arange(30_001, dtype=torch.float64),
        "strided": torch.arange(60_000, dtype=torch.int32).reshape(200, 300).t(),  # takes the copy_ path
    }
    specs, size = C.layout_region(tensors, inline_bytes=0)
    region = memoryview(bytearray(size))
    C.write_region(region, tensors, specs)
    out = C.unpack(specs, [region])
    for name, t in tensors.items():
        assert torch.equal(out[name], t), name
