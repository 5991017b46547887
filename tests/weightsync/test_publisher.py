"""The WeightPublisher against real serving processes over HTTP on loopback.

Servers are child processes running our receiver routes in front of a dict of tensors (wsync_target_
server.py), which reports a digest of what it serves; one test uses the real embedded server. Failures are
injected by processes exiting abruptly in the middle of a version.
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
import torch
from wsync_helpers import TargetServers, corrupt_once, digest, mixed_tensors, served, spawn, status
from wsync_target_server import serve, serve_lax

from slipstream.serverkinds import server_kind
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.publisher import WeightPublisher, publish_whole

TIMEOUT_S = 5.0  # how long a transfer waits for a peer: what detects a death where no connection ends
HANG_S = (
    120.0  # waits for a state that follows a death: a bound only a hang reaches, however loaded the machine
)


def config(backend: str = "torch_dist", **kw) -> WeightSyncConfig:
    return WeightSyncConfig(backend=backend, bucket_mb=1, timeout_s=TIMEOUT_S, device="cpu", **kw)


@pytest.fixture
def servers():
    s = TargetServers(serve)
    yield s
    s.stop()


@pytest.mark.parametrize("backend", ["torch_dist", "nixl", "naive"])
def test_versions_reach_every_server_bit_exact_and_a_late_server_gets_the_current_one(servers, backend):
    first, late = servers.start(), servers.start()
    pub = WeightPublisher(config(backend), [first], server_kind("embedded"))
    try:
        for version in (1, 2):
            report = pub.publish(version, iter(mixed_tensors(version)))
            assert report.ok == [first] and not report.failed
            assert served(first) == {"version": version, "digest": digest(mixed_tensors(version))}
        catch_up = pub.add_server(late)
        assert catch_up is not None and catch_up.ok == [late]
        assert served(late) == {"version": 2, "digest": digest(mixed_tensors(2))}
        report = pub.publish(3, iter(mixed_tensors(3)))
        assert sorted(report.ok) == sorted([first, late])
        assert served(first) == served(late) == {"version": 3, "digest": digest(mixed_tensors(3))}
        assert status(first)["failed_versions"] == 0
    finally:
        pub.close()


def test_a_server_killed_mid_sync_is_dropped_and_the_others_get_the_version(servers):
    healthy, doomed = servers.start(), servers.start(2)  # dies at its second update call
    pub = WeightPublisher(config(), [healthy, doomed], server_kind("embedded"))
    try:
        start = time.monotonic()
        report = pub.publish(1, iter(mixed_tensors(1)))
        assert time.monotonic() - start < HANG_S  # nobody hangs
        assert doomed in report.failed and report.ok == [healthy] and report.retried
        assert pub.down.keys() == {doomed}
        assert served(healthy) == {"version": 1, "digest": digest(mixed_tensors(1))}
        report = pub.publish(2, iter(mixed_tensors(2)))  # the next push goes to the live server only
        assert report.ok == [healthy] and served(healthy)["version"] == 2
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


def test_a_trainer_killed_mid_sync_leaves_the_old_version_serving_and_a_new_trainer_takes_over(servers):
    url = servers.start()
    trainer = spawn(_dying_trainer, [url])
    trainer.join(timeout=60)
    assert trainer.exitcode == 1
    deadline = time.monotonic() + HANG_S
    while status(url)["failed_versions"] == 0 and time.monotonic() < deadline:
        time.sleep(0.2)  # the server notices within its timeout
    state = status(url)
    assert state["failed_versions"] == 1 and state["weight_version"] == 1 and state["last_error"]
    assert served(url) == {"version": 1, "digest": digest(mixed_tensors(1))}
    pub = WeightPublisher(config(), [url], server_kind("embedded"))
    try:
        assert pub.publish(3, iter(mixed_tensors(3))).ok == [url]
        assert served(url) == {"version": 3, "digest": digest(mixed_tensors(3))}
    finally:
        pub.close()


def test_requests_that_cannot_be_honoured_get_an_error_naming_the_problem(servers):
    url = servers.start()
    post = lambda path, body: httpx.post(f"{url}{path}", json=body, timeout=10)  # noqa: E731
    update = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]], "load_format": "flattened_bucket"}
    r = post("/update_weights_from_distributed", update)
    assert r.status_code == 400 and "no group `weight_update_group`" in r.json()["message"]
    r = post("/end_weight_update", {})
    assert r.status_code == 400 and "begin_weight_update" in r.json()["message"]
    r = post("/begin_weight_update", {"weight_version": "seven"})
    assert r.status_code == 400 and "must be an integer" in r.json()["message"]
    r = post("/begin_weight_update", {"stream": "nixl"})
    assert r.status_code == 400 and "/weightsync/nixl/prepare" in r.json()["message"]
    r = post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                            "world_size": 2, "backend": "mpi"})  # fmt: skip
    assert r.status_code == 400 and "backend `mpi`" in r.json()["message"]
    r = httpx.post(f"{url}/begin_weight_update", content=b"{not json", timeout=10)
    assert r.status_code == 400 and "bad request body" in r.json()["message"]
    assert served(url)["version"] == 0  # nothing changed what serves


def test_other_trainer_ranks_only_iterate():
    seen = []
    assert publish_whole(None, 4, (seen.append(n) or (n, t) for n, t in mixed_tensors(4))) is None
    assert seen == [n for n, _ in mixed_tensors(4)]


def test_the_embedded_server_keeps_answering_while_a_version_arrives_and_then_serves_it(tiny_model_path):
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
    answers: list[tuple[float, dict]] = []
    stop = threading.Event()

    def keep_asking() -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                answer = http.post(f"{server.url}/generate", json=body).json()
                answers.append((time.monotonic(), answer))

    def slowly():  # a trainer that takes a while to gather its tensors: the transfer spans seconds
        for name, p in model.named_parameters():
            time.sleep(0.1)
            yield name, p.detach()

    try:
        server.wait_healthy(180)
        asker = threading.Thread(target=keep_asking)
        asker.start()
        pub = WeightPublisher(config(), [server.url], server_kind("embedded"))
        try:
            while not answers:
                time.sleep(0.05)
            began = time.monotonic()
            report = pub.publish(1, slowly())
            ended = time.monotonic()
            assert report.ok == [server.url], report
            count = len(answers)
            while len(answers) < count + 2:
                time.sleep(0.05)
        finally:
            stop.set()
            asker.join(timeout=60)
            pub.close()
        during = [a for t, a in answers if began + 0.3 < t < ended - 0.3]
        assert during, "no request was answered while the version was being received"
        assert all(a["meta_info"]["weight_version"] == "0" for a in during)  # the old version, unmixed
        last = answers[-1][1]
        assert last["meta_info"]["weight_version"] == "1"
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :]
        assert last["output_ids"] == expected.tolist()[: len(last["output_ids"])]  # the new weights, exactly
    finally:
        server.stop()


def test_an_abort_at_the_switch_is_one_call_that_aborts_what_runs_and_leaves_the_server_serving(
    tiny_model_path,
):
    """pause_mode abort on the embedded server: ``/end_weight_update {abort_running}`` ends the running
    request (frozen by an operator's in-place pause, so that it cannot finish first) with its partial
    output on the old version, switches, resumes, and the next request runs on the new version."""
    from transformers import AutoModelForCausalLM

    from slipstream.rollouter.config import EmbeddedServerConfig, RolloutConfig
    from slipstream.rollouter.launch import launch_server

    engine_cfg = EmbeddedServerConfig(num_threads=1, max_model_len=2048, kv_cache_tokens=8192, seed=0)
    server = launch_server(server_kind("embedded"), tiny_model_path, cfg=RolloutConfig(embedded=engine_cfg))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    long = {"input_ids": [5, 77], "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
    answer: dict = {}

    def ask() -> None:
        answer.update(httpx.post(f"{server.url}/generate", json=long, timeout=300).json())

    try:
        server.wait_healthy(180)
        pub = WeightPublisher(config(pause_mode="abort"), [server.url], server_kind("embedded"))
        asker = threading.Thread(target=ask)
        try:
            asker.start()
            deadline = time.monotonic() + 120
            while httpx.get(f"{server.url}/model_info", timeout=10).json()["num_running_requests"] == 0:
                assert time.monotonic() < deadline, "the long request never started"
                time.sleep(0.05)
            # frozen where it is, so that it is still running at the switch however fast the machine is
            httpx.post(
                f"{server.url}/pause_generation", json={"mode": "in_place"}, timeout=60
            ).raise_for_status()
            report = pub.publish(1, ((n, p.detach()) for n, p in model.named_parameters()))
            assert report.ok == [server.url], report
            asker.join(timeout=300)
            info = httpx.get(f"{server.url}/model_info", timeout=10).json()
            after = httpx.post(
                f"{server.url}/generate",
                json={"input_ids": [5], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
                timeout=60,
            ).json()
        finally:
            pub.close()
    finally:
        server.stop()
    meta = answer["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and len(answer["output_ids"]) < 1500
    assert [span["version"] for span in meta["weight_versions"]] == ["0"]  # never a token of version 1
    assert info["paused"] is None and info["weight_version"] == "1"
    assert after["meta_info"]["weight_version"] == "1" and len(after["output_ids"]) == 3


def test_a_version_the_server_cannot_take_is_refused_by_name_and_the_next_one_goes_through(servers):
    url = servers.start()
    pub = WeightPublisher(config(keep_last=False), [url], server_kind("embedded"))
    try:
        bad = [(n, torch.zeros(3, 3) if n == "lm_head.weight" else t) for n, t in mixed_tensors(1)]
        report = pub.publish(1, iter(bad))
        assert (
            report.ok == [] and "`lm_head.weight`: sent shape [3, 3], serving [33, 17]" in report.failed[url]
        )
        assert served(url)["version"] == 0 and status(url)["failed_versions"] == 1
        assert pub.publish(2, iter(mixed_tensors(2))).ok == [url]
        assert served(url) == {"version": 2, "digest": digest(mixed_tensors(2))}
    finally:
        pub.close()


def test_a_whole_version_missing_a_tensor_is_refused_by_the_publisher_for_a_server_that_cannot_tell():
    """A receiver that takes what comes (SGLang's loads each bucket as it arrives) would serve the dropped tensor
    from the older version under the new number. The publisher knows the last whole version's names and
    refuses the version, naming the tensor, before the server switches; the next whole version goes through."""
    lax = TargetServers(serve_lax)
    try:
        url = lax.start()
        pub = WeightPublisher(config(), [url], server_kind("embedded"))
        try:
            assert pub.publish(1, iter(mixed_tensors(1))).ok == [url]
            dropped = [(n, t) for n, t in mixed_tensors(2) if n != "layers.0.attn.k.weight"]
            with pytest.raises(
                ValueError, match=r"version 2 misses 1 parameters .*layers\.0\.attn\.k\.weight"
            ):
                pub.publish(2, iter(dropped))
            assert served(url) == {"version": 1, "digest": digest(mixed_tensors(1))}
            assert pub.publish(3, iter(mixed_tensors(3))).ok == [url]
            assert served(url) == {"version": 3, "digest": digest(mixed_tensors(3))}
        finally:
            pub.close()
    finally:
        lax.stop()


@pytest.mark.parametrize("keep_last", [False, True])
def test_bytes_corrupted_in_flight_fail_verification_and_the_version_is_refused(
    servers, monkeypatch, keep_last
):
    url = servers.start()
    pub = WeightPublisher(config(keep_last=keep_last), [url], server_kind("embedded"))
    try:
        first = pub.publish(1, iter(mixed_tensors(1)))
        assert first.ok == [url]
        # what the checks cost is timed on both sides (sync/verify_s; the receiver's status)
        assert 0 < first.verify_s < first.send_s and status(url)["last_verify_s"] > 0
        corrupt = corrupt_once(monkeypatch, version=2)
        report = pub.publish(2, iter(mixed_tensors(2)))
        assert corrupt.name is not None and report.verify_failed == 1
        if keep_last:  # the publisher's retry from its kept copy lands the version
            assert report.retried and report.ok == [url]
            assert served(url) == {"version": 2, "digest": digest(mixed_tensors(2))}
        else:  # refused whole: the server serves the old version
            assert report.ok == [] and f"`{corrupt.name}` failed verification" in report.failed[url]
            assert served(url) == {"version": 1, "digest": digest(mixed_tensors(1))}
            assert pub.publish(3, iter(mixed_tensors(3))).ok == [url]
    finally:
        pub.close()


def test_without_verification_the_same_corruption_is_served(servers, monkeypatch):
    """The check's teeth: the same flipped byte, with weightsync.verify off, is applied and served."""
    url = servers.start()
    pub = WeightPublisher(config(verify=False), [url], server_kind("embedded"))
    try:
        corrupt_once(monkeypatch, version=1)
        report = pub.publish(1, iter(mixed_tensors(1)))
        assert report.ok == [url] and report.verify_s == 0 and status(url)["last_verify_s"] == 0
        assert served(url)["version"] == 1 and served(url)["digest"] != digest(mixed_tensors(1))
    finally:
        pub.close()
