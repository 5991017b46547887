"""The two sides other roles see of the queue (queue/base.py): the clients implement them, and a stand-in
that lacks a method cannot be built."""

from __future__ import annotations

import asyncio

import pytest

from slipstream.queue.base import QueueConsumer, QueueProducer
from slipstream.queue.client import AsyncQueueClient, QueueClient


def test_the_clients_implement_the_sides_their_roles_use():
    sync, asynchronous = QueueClient("tcp://127.0.0.1:1"), AsyncQueueClient("tcp://127.0.0.1:1")
    try:
        assert isinstance(sync, QueueConsumer) and isinstance(asynchronous, QueueProducer)
    finally:  # neither ever connected, so closing sends nothing
        sync.close()
        asyncio.run(asynchronous.close())


def test_a_stand_in_missing_a_method_fails_when_built():
    class NoRestore(QueueConsumer):
        def lease(self, n_groups, **kwargs):
            return None

        def ack(self, lease, *, dropped=()):
            pass

        def nack(self, lease):
            pass

        def snapshot(self, name):
            return {}

    class NoPopDropped(QueueProducer):
        async def put(self, group, *, partition="train", timeout_s=None):
            return True

    for half in (NoRestore, NoPopDropped):
        with pytest.raises(TypeError, match="abstract"):
            half()
