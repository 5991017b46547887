"""A server bound beyond loopback requires a token: refused without one, and a client without the token gets
nothing through."""

from __future__ import annotations

import pytest
import zmq

from slipstream.queue import protocol as P
from slipstream.queue.auth import TOKEN_ENV, server_token, split_address
from slipstream.queue.client import QueueClient, QueueError
from slipstream.queue.codec import Codec
from slipstream.queue.config import QueueConfig
from slipstream.queue.testing import make_group

TOKEN = "s3cret-token-for-tests"


def test_a_bind_beyond_loopback_without_a_token_is_refused():
    from slipstream.queue.server import QueueServer, main

    with pytest.raises(ValueError, match="refusing to serve without authentication"):
        QueueServer(QueueConfig(host="0.0.0.0", auth_token=""))  # refused before anything binds
    assert main(["--host", "0.0.0.0", "auth_token="]) == 2


def test_auto_means_a_random_token_beyond_loopback_and_none_on_it():
    assert server_token(QueueConfig()) == "" and server_token(QueueConfig(host="localhost")) == ""
    first, second = (server_token(QueueConfig(host="0.0.0.0")) for _ in range(2))
    assert len(first) >= 32 and first != second
    assert server_token(QueueConfig(host="10.1.2.3")) != ""
    assert server_token(QueueConfig(auth_token=TOKEN)) == TOKEN  # a literal one applies on loopback too


def test_only_clients_with_the_token_get_through(server, monkeypatch):
    srv = server(auth_token=TOKEN)
    plain, token = split_address(srv.address)
    assert token == TOKEN
    with QueueClient(srv.address, timeout_s=30) as client:  # the token rides in the address
        assert client.put(make_group("a", payload=100))
        assert client.transport == "tcp"  # no direct channel: it has no handshake
        lease = client.lease(1, timeout_s=5)
        client.ack(lease)
    for stranger in (QueueClient(plain, timeout_s=1), QueueClient(plain, timeout_s=1, token="wrong")):
        with pytest.raises(QueueError, match="no reply"):
            stranger.stats()
        stranger.close()
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(plain)
    raw.send_multipart(Codec().encode(P.MsgType.STATS, P.StatsRequest(1)))
    assert not raw.poll(1000)  # never read by the server
    raw.close(linger=0)
    ctx.term()
    with QueueClient(plain, timeout_s=30, token=TOKEN) as client:
        assert client.stats().partitions["train"].acked_total == 1
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with QueueClient(plain, timeout_s=30) as client:
        assert client.stats().held_groups == 0


def test_a_server_process_takes_its_token_off_the_command_line(server_process):
    handle = server_process(auth_token=TOKEN)
    assert TOKEN not in " ".join(handle.proc.args)
    assert split_address(handle.address)[1] == TOKEN
    with QueueClient(handle.address, timeout_s=30) as client:
        client.ping()


def test_a_stray_token_against_a_server_without_one_is_named(server, monkeypatch):
    """ZeroMQ drops a handshake whose mechanisms differ without a word: the time-out names the mismatch
    (and where the client's token came from) instead of asking whether the server runs."""
    srv = server()
    monkeypatch.setenv(TOKEN_ENV, "stray-token")
    with QueueClient(srv.address, timeout_s=0.5) as client:
        with pytest.raises(QueueError, match=rf"answers clients without a token.*\${TOKEN_ENV}"):
            client.stats()
    monkeypatch.delenv(TOKEN_ENV)
    with QueueClient(srv.address, timeout_s=30) as client:
        client.stats()


@pytest.mark.parametrize("quoted", ['""', "''"])
def test_an_empty_quoted_token_on_the_command_line_is_no_token(quoted):
    from slipstream.config import load_config
    from slipstream.queue.server import main

    assert load_config(None, [f"queue.auth_token={quoted}"]).queue.auth_token == ""
    assert load_config(None, ['queue.auth_token="abc"']).queue.auth_token == "abc"
    assert main(["--host", "0.0.0.0", f"auth_token={quoted}"]) == 2  # empty, so refused beyond loopback
