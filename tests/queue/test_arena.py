"""The shared-memory arena: allocation, coalescing, pins, and the nonce check that guards mapping."""

from __future__ import annotations

import pytest

from slipstream.queue.arena import HEADER_BYTES, Arena, ArenaMapping, shm_supported

pytestmark = pytest.mark.skipif(not shm_supported(), reason="needs Linux memfd")


def test_alloc_free_coalesce_and_exhaustion():
    arena = Arena(HEADER_BYTES + 1024, b"n" * 16)
    try:
        a, b, c = arena.alloc(300), arena.alloc(300), arena.alloc(300)
        assert None not in (a, b, c) and a % 64 == 0 and b - a == 320
        assert arena.alloc(200) is None  # 64 bytes left
        arena.free(b)
        assert arena.alloc(320) == b  # reused exactly
        arena.free(a)
        arena.free(b)
        arena.free(c)
        assert arena.used == 0
        assert arena.alloc(1024) == HEADER_BYTES  # all coalesced back into one block
    finally:
        arena.close()


def test_pinned_region_is_freed_only_after_unpin():
    arena = Arena(HEADER_BYTES + 256, b"n" * 16)
    try:
        off = arena.alloc(256)
        arena.pin(off)
        arena.free(off)
        assert arena.alloc(64) is None  # still owned while pinned
        arena.unpin(off)
        assert arena.alloc(256) == off
    finally:
        arena.close()


def test_mapping_checks_the_nonce_and_shares_memory():
    arena = Arena(4096, b"right-nonce-0123")
    try:
        assert ArenaMapping.open(arena.path, arena.size, b"wrong-nonce-0123") is None
        assert ArenaMapping.open(arena.path, arena.size + 1, b"right-nonce-0123") is None
        assert ArenaMapping.open("/nonexistent/arena", arena.size, b"right-nonce-0123") is None
        mapping = ArenaMapping.open(arena.path, arena.size, b"right-nonce-0123")
        assert mapping is not None
        mapping.buffer(128, 4)[:] = b"abcd"
        assert bytes(arena.buffer(128, 4)) == b"abcd"
        mapping.close()
    finally:
        arena.close()
