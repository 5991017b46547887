"""The publisher over ``ipc`` to serving processes on this host, and how ``auto`` picks the transport.

Servers are child processes running our receiver routes in front of a dict of tensors (ipc_target_server.py,
which also reports what its ipc engine holds); one test uses the real embedded server. Processes die
abruptly in the middle of a version. Waits are for states (a status field, a process exit), never for time.
"""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest
import torch
from ipc_target_server import serve
from wsync_helpers import TargetServers, digest, mixed_tensors, served, spawn

from slipstream.serverapi import EMBEDDED
from slipstream.serverkinds import server_kind
from slipstream.weightsync import ipc_memory
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.errors import TransferError
from slipstream.weightsync.publisher import WeightPublisher
from slipstream.weightsync.servers import choose_transport

TIMEOUT_S = 120.0  # a bound, never reached: deaths are seen as the end of a connection
needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/<pid>/maps")


def config(backend: str = "ipc", **kw) -> WeightSyncConfig:
    return WeightSyncConfig(backend=backend, bucket_mb=1, timeout_s=TIMEOUT_S, device="cpu", **kw)


@pytest.fixture
def servers():
    s = TargetServers(serve)
    yield s
    s.stop()


def get(url: str, path: str) -> dict:
    return httpx.get(f"{url}{path}", timeout=30).json()


def test_auto_picks_ipc_on_this_host_and_versions_arrive_bit_exact_including_a_late_server(servers):
    first, late = servers.start(), servers.start()
    pub = WeightPublisher(config("auto"), [first], server_kind("embedded"))
    try:
        for version in (1, 2):  # mixed dtypes (fp8 too) and a tensor larger than a bucket
            report = pub.publish(version, iter(mixed_tensors(version)))
            assert report.ok == [first] and not report.failed, report
            assert pub._link.transport.name == "ipc"
            assert served(first) == {"version": version, "digest": digest(mixed_tensors(version))}
        assert get(first, "/ipc_state")["mapped"] == 2
        catch_up = pub.add_server(late)
        assert catch_up is not None and catch_up.ok == [late]
        assert served(late) == {"version": 2, "digest": digest(mixed_tensors(2))}
        report = pub.publish(3, iter(mixed_tensors(3)))
        assert sorted(report.ok) == sorted([first, late]) and pub._link.transport.name == "ipc"
        assert served(first) == served(late) == {"version": 3, "digest": digest(mixed_tensors(3))}
        assert get(first, "/weightsync/status")["failed_versions"] == 0
    finally:
        pub.close()


def test_a_push_that_fails_off_the_wire_raises_to_the_trainer_and_the_next_one_goes_through(servers):
    """A bug or an out-of-memory while packing is the trainer's error, not a lost push: raised as it is,
    the server keeps its version, and nothing is retried from the kept copy as if a server had died."""
    url = servers.start()
    pub = WeightPublisher(config(), [url], server_kind("embedded"))

    def breaks():
        for i, item in enumerate(mixed_tensors(2)):
            if i == 3:
                raise RuntimeError("packing failed")
            yield item

    try:
        assert pub.publish(1, iter(mixed_tensors(1))).ok == [url]
        with pytest.raises(RuntimeError, match="packing failed"):
            pub.publish(2, breaks())
        assert served(url) == {"version": 1, "digest": digest(mixed_tensors(1))}
        assert pub.publish(3, iter(mixed_tensors(3))).ok == [url]
        assert served(url) == {"version": 3, "digest": digest(mixed_tensors(3))}
    finally:
        pub.close()


def _dying_trainer(urls: list[str]) -> None:
    """Publishes version 1, then dies three tensors into version 2."""
    torch.set_num_threads(1)
    pub = WeightPublisher(config(), urls, server_kind("embedded"))
    pub.publish(1, iter(mixed_tensors(1)))

    def dies():
        for i, item in enumerate(mixed_tensors(2)):
            if i == 3:
                os._exit(1)
            yield item

    pub.publish(2, dies())


@needs_proc
def test_a_trainer_killed_mid_sync_leaves_the_old_version_serving_with_staging_and_segments_freed(servers):
    url = servers.start()
    trainer = spawn(_dying_trainer, [url])
    trainer.join(timeout=120)
    assert trainer.exitcode == 1
    while get(url, "/weightsync/status")["failed_versions"] == 0:  # the server sees the connection end
        time.sleep(0.05)
    state = get(url, "/weightsync/status")
    assert state["failed_versions"] == 1 and state["weight_version"] == 1 and state["last_error"]
    assert served(url) == {"version": 1, "digest": digest(mixed_tensors(1))}
    assert get(url, "/ipc_state") == {"staging_bytes": 0, "mapped": 0, "shm_mappings": 0}
    pub = WeightPublisher(config(), [url], server_kind("embedded"))
    try:
        assert pub.publish(3, iter(mixed_tensors(3))).ok == [url]
        assert served(url) == {"version": 3, "digest": digest(mixed_tensors(3))}
    finally:
        pub.close()


def test_a_server_killed_mid_sync_fails_the_push_and_the_others_get_the_version(servers):
    healthy, doomed = servers.start(), servers.start(1)  # dies after its first bucket
    pub = WeightPublisher(config(), [healthy, doomed], server_kind("embedded"))
    try:
        report = pub.publish(1, iter(mixed_tensors(1)))
        assert doomed in report.failed and report.ok == [healthy] and report.retried, report
        assert "went away" in report.failed[doomed]  # seen as the end of its connection, not a timeout
        assert pub.down.keys() == {doomed}
        assert served(healthy) == {"version": 1, "digest": digest(mixed_tensors(1))}
        report = pub.publish(2, iter(mixed_tensors(2)))
        assert report.ok == [healthy] and served(healthy)["version"] == 2
    finally:
        pub.close()


def test_an_older_or_refused_version_changes_nothing_and_frees_its_staging(servers):
    url = servers.start()
    first = WeightPublisher(config(), [url], server_kind("embedded"))
    try:
        assert first.publish(3, iter(mixed_tensors(3))).ok == [url]
    finally:
        first.close()
    stale = WeightPublisher(config(keep_last=False), [url], server_kind("embedded"))
    try:
        report = stale.publish(2, iter(mixed_tensors(2)))
        assert report.ok == [] and "older than the serving version 3" in report.failed[url], report
        bad = [(n, torch.zeros(3, 3) if n == "lm_head.weight" else t) for n, t in mixed_tensors(4)]
        report = stale.publish(4, iter(bad))  # staged whole, then refused by the target
        assert report.ok == [] and "misshaped parameter 'lm_head.weight'" in report.failed[url], report
        assert served(url) == {"version": 3, "digest": digest(mixed_tensors(3))}
        assert get(url, "/ipc_state")["staging_bytes"] == 0
        assert get(url, "/weightsync/status")["failed_versions"] >= 1
        assert stale.publish(5, iter(mixed_tensors(5))).ok == [url]
        assert served(url) == {"version": 5, "digest": digest(mixed_tensors(5))}
    finally:
        stale.close()


def test_a_serving_embedded_server_gets_a_version_over_ipc_and_generates_with_it(tiny_model_path):
    from transformers import AutoModelForCausalLM

    from slipstream.rollouter.config import EmbeddedServerConfig, RolloutConfig
    from slipstream.rollouter.launch import launch_server

    engine_cfg = EmbeddedServerConfig(num_threads=1, max_model_len=512, kv_cache_tokens=4096, seed=0)
    server = launch_server(server_kind("embedded"), tiny_model_path, cfg=RolloutConfig(embedded=engine_cfg))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.5)  # a version that generates different tokens
    prompt = [5, 77, 101, 33]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    try:
        server.wait_healthy(180)
        pub = WeightPublisher(config("auto"), [server.url], server_kind("embedded"))
        try:
            report = pub.publish(1, ((n, p.detach()) for n, p in model.named_parameters()))
            assert report.ok == [server.url] and pub._link.transport.name == "ipc", report
        finally:
            pub.close()
        answer = httpx.post(f"{server.url}/generate", json=body, timeout=120).json()
        assert answer["meta_info"]["weight_version"] == "1"
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :]
        assert answer["output_ids"] == expected.tolist()[: len(answer["output_ids"])]
    finally:
        server.stop()


# ------------------------------------------------------------------------------------ choosing the link


class _Stub:
    """An adapter that answers /weightsync/ipc/prepare with a given identity (or fails, like an old server)."""

    def __init__(self, kind: str, host: str, device: str, fails: bool = False) -> None:
        self.kind, self.url = kind, f"http://{kind}"
        self.api = EMBEDDED  # the stream routes it is asked on
        self.answer = {"backend": "ipc", "host": host, "device": device}
        self.fails, self.calls = fails, 0

    async def data_plane(self) -> str:
        return "torch_dist"

    async def call(self, method: str, path: str, **_kw) -> dict:
        self.calls += 1
        if self.fails:
            raise TransferError(f"{self.url}{path}: HTTP 404: Not Found")
        return self.answer


@pytest.mark.parametrize(
    ("backend", "kind", "receivers", "want"),
    [
        ("auto", "embedded", [("here", "cuda:GPU-a"), ("here", "cuda:GPU-a")], "ipc"),
        (
            "auto",
            "embedded",
            [("here", "cuda:GPU-a"), ("here", "cuda:GPU-b")],
            "torch_dist",
        ),  # one on another GPU
        ("auto", "embedded", [("there", "cuda:GPU-a")], "torch_dist"),  # another host, same UUID string
        ("auto", "embedded", [("here", None)], "torch_dist"),  # a server without the ipc routes
        ("auto", "sglang", [("here", "cuda:GPU-a")], "torch_dist"),  # never asked
        ("torch_dist", "embedded", [("here", "cuda:GPU-a")], "torch_dist"),
        ("ipc", "embedded", [("there", "cpu")], "ipc"),
        ("nixl", "embedded", [("here", "cuda:GPU-a")], "nixl"),
    ],
)
def test_the_transport_follows_the_backend_and_auto_picks_ipc_only_on_this_host_and_this_gpu(
    monkeypatch, backend, kind, receivers, want
):
    monkeypatch.setattr(ipc_memory, "device_identity", lambda device: "cuda:GPU-a")  # the trainer's GPU
    here = ipc_memory.host_identity()
    stubs = [
        _Stub(kind, here if host == "here" else "other/boot", device or "", fails=device is None)
        for host, device in receivers
    ]
    got = asyncio.run(choose_transport(config(backend), server_kind(kind), stubs, torch.device("cpu")))
    assert got == want
    if kind != "embedded" or backend != "auto":
        assert all(s.calls == 0 for s in stubs)


def test_auto_with_a_host_memory_sender_picks_ipc_for_any_device_of_this_host():
    here = ipc_memory.host_identity()
    stubs = [_Stub("embedded", here, "cuda:GPU-z"), _Stub("embedded", here, "cpu")]
    got = asyncio.run(choose_transport(config("auto"), server_kind("embedded"), stubs, torch.device("cpu")))
    assert got == "ipc"
