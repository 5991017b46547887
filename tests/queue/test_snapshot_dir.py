"""Snapshots are names inside the server's snapshot_dir: no path from the wire reaches anything else, a failed
write leaves no temporary file, and a FIFO planted in the directory never blocks the server."""

from __future__ import annotations

import os

import pytest

from slipstream.queue.client import QueueClient, QueueError
from slipstream.queue.testing import make_group


@pytest.fixture
def dirs(tmp_path):
    """(snapshot_dir, a directory beside it that must never be touched)."""
    inside, outside = tmp_path / "snapshots", tmp_path / "outside"
    inside.mkdir()
    outside.mkdir()
    return inside, outside


@pytest.fixture
def client(server, dirs):
    c = QueueClient(server(snapshot_dir=str(dirs[0])).address, timeout_s=30)
    c.put(make_group("a", payload=100))
    yield c
    c.close()


def _listing(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("name", ["../outside/x", "a/../../outside/x", "ok/./x", "a//b", "", "a/", "sub dir"])
def test_names_that_are_paths_are_refused(client, dirs, name):
    with pytest.raises(QueueError, match="not a path"):
        client.snapshot(name)
    with pytest.raises(QueueError, match="not a path"):
        client.restore(name)
    assert _listing(dirs[0]) == [] and _listing(dirs[1]) == []


def test_an_absolute_path_is_refused(client, dirs):
    target = dirs[1] / "x"
    with pytest.raises(QueueError, match="not a path"):
        client.snapshot(str(target))
    assert not target.exists() and _listing(dirs[0]) == []


def test_symbolic_links_inside_the_directory_are_not_followed(client, dirs):
    inside, outside = dirs
    (inside / "dir-link").symlink_to(outside)
    (inside / "file-link").symlink_to(outside / "victim")
    (outside / "victim").write_bytes(b"precious")
    for name in ("dir-link/x", "file-link"):
        with pytest.raises(QueueError, match="symbolic link|refusing to replace"):
            client.snapshot(name)
        with pytest.raises(QueueError, match="symbolic link|not a regular file"):
            client.restore(name)
    assert _listing(outside) == ["victim"] and (outside / "victim").read_bytes() == b"precious"


def test_only_an_earlier_snapshot_is_replaced(client, dirs):
    inside = dirs[0]
    (inside / "notes.txt").write_bytes(b"keep me")
    with pytest.raises(QueueError, match="not a queue snapshot; refusing to replace it"):
        client.snapshot("notes.txt")
    assert (inside / "notes.txt").read_bytes() == b"keep me"
    assert client.snapshot("step_1/queue")["groups"] == 1  # a directory made on the way
    assert client.snapshot("step_1/queue")["groups"] == 1  # a snapshot may be written again
    assert _listing(inside) == ["notes.txt", "step_1", "step_1/queue"]
    assert client.restore("step_1/queue")["mode"] == "merge"


def test_a_failed_snapshot_leaves_no_temporary_file(client, dirs, monkeypatch):
    from slipstream.queue import snapshot

    def broken(*_args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snapshot, "_write_blob", broken)  # fails mid-write, after the header
    with pytest.raises(QueueError, match="No space left"):
        client.snapshot("ckpt")
    assert _listing(dirs[0]) == []
    monkeypatch.undo()
    assert client.snapshot("ckpt")["groups"] == 1


def test_a_fifo_is_refused_at_once_and_blocks_nothing(client, dirs):
    os.mkfifo(dirs[0] / "fifo")
    with pytest.raises(QueueError, match="not a regular file"):
        client.restore("fifo")  # with no writer, opening it for reading would never return
    with pytest.raises(QueueError, match="refusing to replace"):
        client.snapshot("fifo")
    assert client.snapshot("after")["groups"] == 1  # the IO thread is free


def test_a_server_without_a_snapshot_dir_refuses_both(server):
    c = QueueClient(server(snapshot_dir="").address, timeout_s=30)
    for call in (c.snapshot, c.restore):
        with pytest.raises(QueueError, match="set queue.snapshot_dir"):
            call("ckpt")
    c.close()
