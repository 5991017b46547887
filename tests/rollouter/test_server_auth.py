"""Who may control the embedded server: holders of its token (rollouter/embedded/auth.py).

The app is driven through httpx's ASGI transport on the test's event loop, with its engine in this process;
the last test runs a real `slipstream serve` process and pushes weights to it through the publisher.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest

from slipstream.rollouter.embedded.app import build_app
from slipstream.rollouter.embedded.engine import EmbeddedEngine
from slipstream.serverkinds import server_kind
from slipstream.utils.http_auth import TOKEN_ENV, bearer_headers, new_token
from tests.rollouter.conftest import TEST_ENGINE, run

TOKEN = new_token()
GROUP = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
         "group_name": "g", "backend": "gloo", "timeout_s": 1}  # fmt: skip
BUCKET = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "g"}
# Every route that changes the server's state, with a body it would otherwise accept or judge.
CONTROL = [
    ("POST", "/pause_generation", {"mode": "in_place"}),
    ("POST", "/continue_generation", {}),
    ("POST", "/abort_request", {"rid": "someone-elses"}),
    ("POST", "/abort_request", {"abort_all": True}),
    ("POST", "/flush_cache", None),
    ("POST", "/init_weights_update_group", GROUP),
    ("POST", "/destroy_weights_update_group", {"group_name": "g"}),
    ("POST", "/begin_weight_update", {"weight_version": 999999}),
    ("POST", "/update_weights_from_distributed", BUCKET),
    ("POST", "/end_weight_update", {"weight_version": 999999}),
    ("POST", "/weightsync/nixl/prepare", None),
    ("GET", "/openapi.json", None),
]
GENERATE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}


@asynccontextmanager
async def serving(model_path, **app_kwargs) -> AsyncIterator[tuple[EmbeddedEngine, httpx.AsyncClient]]:
    engine = EmbeddedEngine(model_path, TEST_ENGINE)
    await engine.start()
    transport = httpx.ASGITransport(app=build_app(engine, **app_kwargs))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://embedded", timeout=60) as http:
            yield engine, http
    finally:
        engine.stop()


def test_control_needs_the_token_and_the_server_keeps_serving(tiny_model_path):
    async def main():
        async with serving(tiny_model_path, token=TOKEN) as (engine, http):
            refused = {}
            for method, path, body in CONTROL:
                bare = await http.request(method, path, json=body)
                wrong = await http.request(method, path, json=body, headers=bearer_headers(new_token()))
                refused[(path, str(body))] = (bare.status_code, wrong.status_code)
            # Nothing changed: not paused, no group joined, no session, the same version; generation works.
            info = (await http.get("/model_info")).json()
            status = (await http.get("/weightsync/status")).json()
            generated = await http.post("/generate", json=GENERATE)
            health = await http.get("/health")
            with_token = [
                (await http.post(p, json=b, headers=bearer_headers(TOKEN))).status_code
                for p, b in [("/pause_generation", {"mode": "in_place"}), ("/continue_generation", {})]
            ]
            return refused, info, status, generated, health.status_code, with_token

    refused, info, status, generated, health, with_token = run(main())
    assert all(codes == (401, 403) for codes in refused.values()), refused
    assert not info["paused"] and info["weight_version"] == "0"
    assert status["groups"] == [] and status["staging_version"] is None and status["failed_versions"] == 0
    assert generated.status_code == 200 and len(generated.json()["output_ids"]) == 2
    assert health == 200 and with_token == [200, 200]


def test_a_request_can_be_aborted_only_with_the_token(tiny_model_path):
    long = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True},
            "rid": "victim"}  # fmt: skip

    async def main():
        async with serving(tiny_model_path, token=TOKEN) as (engine, http):
            pending = asyncio.create_task(http.post("/generate", json=long))
            while "victim" not in engine._by_rid or not engine._by_rid["victim"].output_ids:
                await asyncio.sleep(0.01)  # until the request is generating
            stranger = await http.post("/abort_request", json={"rid": "victim"})
            still_running = not engine._by_rid["victim"].done
            owner = await http.post("/abort_request", json={"rid": "victim"}, headers=bearer_headers(TOKEN))
            return stranger.status_code, still_running, owner.status_code, (await pending).json()

    stranger, still_running, owner, out = run(main())
    assert stranger == 401 and still_running
    assert owner == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < 1000


def test_beyond_loopback_a_token_is_required_to_start_and_for_generation(tiny_model_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(ValueError, match=TOKEN_ENV):
        build_app(None, host="0.0.0.0")  # type: ignore[arg-type]  # refused before the engine is touched

    from slipstream.rollouter.serve import main as serve_main

    assert serve_main(["--model", str(tiny_model_path), "--host", "0.0.0.0"]) == 2

    async def main():
        async with serving(tiny_model_path, token=TOKEN, host="0.0.0.0") as (_engine, http):
            bare = [(await http.post("/generate", json=GENERATE)).status_code,
                    (await http.get("/model_info")).status_code, (await http.get("/health")).status_code]  # fmt: skip
            authed = await http.post("/generate", json=GENERATE, headers=bearer_headers(TOKEN))
            return bare, authed.status_code

    assert run(main()) == ([401, 401, 200], 200)


def test_the_token_comes_from_the_environment_and_loopback_without_one_is_open(tiny_model_path, monkeypatch):
    async def pause_status(**app_kwargs) -> int:
        async with serving(tiny_model_path, **app_kwargs) as (_engine, http):
            code = (await http.post("/pause_generation", json={"mode": "in_place"})).status_code
            await http.post("/continue_generation", json={}, headers=bearer_headers(TOKEN))
            return code

    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert run(pause_status()) == 401
    monkeypatch.delenv(TOKEN_ENV)
    assert run(pause_status()) == 200  # a standalone server on loopback, no token set: as SGLang and vLLM


@pytest.mark.timeout(300)
def test_a_pipeline_push_with_the_token_reaches_a_guarded_server(tiny_model_path, tmp_path):
    """A real `slipstream serve` with the token in its environment: the publisher with the token pushes a
    version, one without it is refused and changes nothing."""
    import torch
    from transformers import AutoModelForCausalLM

    from slipstream.rollouter.clients import make_client
    from slipstream.rollouter.config import RolloutConfig
    from slipstream.rollouter.launch import launch_server
    from slipstream.weightsync.config import WeightSyncConfig
    from slipstream.weightsync.publisher import WeightPublisher

    cfg = WeightSyncConfig(device="cpu", bucket_mb=4, timeout_s=30, keep_last=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    server = launch_server(server_kind("embedded"), tiny_model_path, cfg=RolloutConfig(embedded=TEST_ENGINE),
                           env={TOKEN_ENV: TOKEN}, log_path=tmp_path / "server.log")  # fmt: skip
    try:
        server.wait_healthy(180)
        assert TOKEN not in " ".join(server.command)  # never on the command line
        stranger = WeightPublisher(cfg, [server.url], server_kind("embedded"), token="")
        try:
            refused = stranger.publish(1, model.named_parameters())
        finally:
            stranger.close()
        owner = WeightPublisher(cfg, [server.url], server_kind("embedded"), token=TOKEN)
        try:
            pushed = owner.publish(2, model.named_parameters())
        finally:
            owner.close()

        async def versions():
            client = make_client(server_kind("embedded"), server.url)
            try:
                bare = await client.weight_version()
                with pytest.raises(Exception, match="401"):
                    await client.pause("in_place")
                client.authorize(TOKEN)
                await client.pause("in_place")
                await client.resume()
                return bare
            finally:
                await client.aclose()

        served = run(versions())
    finally:
        server.stop()
    assert refused.ok == [] and "HTTP 401" in refused.failed[server.url]
    assert pushed.ok == [server.url] and served == 2


def test_a_standalone_server_without_a_token_makes_one_unless_told_to_run_open(monkeypatch, capsys):
    """`slipstream serve` without $SLIPSTREAM_SERVER_TOKEN no longer leaves pause, abort and weight pushes open
    to every local process: it makes a token and prints it; --open (loopback only) is the explicit way out."""
    from slipstream.rollouter.serve import build_parser, control_token

    def token_for(*flags: str) -> str:
        return control_token(build_parser().parse_args(["--model", "m", *flags]))

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    made = token_for()
    assert len(made) >= 32 and made in capsys.readouterr().err and token_for() != made
    assert token_for("--open") == "" and "--open" in capsys.readouterr().err
    with pytest.raises(ValueError, match=TOKEN_ENV):
        token_for("--open", "--host", "0.0.0.0")  # open beyond loopback: refused
    with pytest.raises(ValueError, match=TOKEN_ENV):
        token_for("--host", "0.0.0.0")  # beyond loopback the token is chosen, not made
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert token_for() == TOKEN and TOKEN not in capsys.readouterr().err
    with pytest.raises(ValueError, match="contradict"):
        token_for("--open")


def test_the_launcher_runs_a_server_open_only_when_launched_without_a_token(
    tiny_model_path, tmp_path, monkeypatch
):
    from slipstream.rollouter.config import RolloutConfig
    from slipstream.rollouter.launch import launch_server

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    cfg = RolloutConfig(embedded=TEST_ENGINE)
    for env, is_open in (({TOKEN_ENV: TOKEN}, False), (None, True)):
        server = launch_server(
            server_kind("embedded"), tiny_model_path, cfg=cfg, env=env, log_path=tmp_path / "s.log"
        )
        server.stop()
        assert ("--open" in server.command) is is_open
