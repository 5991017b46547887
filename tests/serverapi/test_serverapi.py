"""Server descriptions: the requests they build, the one control object, and the embedded server's routes."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

import slipstream.serverapi as serverapi
from slipstream.serverapi import (
    EMBEDDED,
    OUR_PAUSE_MODES,
    SGLANG,
    VLLM,
    Call,
    ServerControl,
)

APIS = (EMBEDDED, SGLANG, VLLM)


def test_each_description_names_its_kind():
    # Which kinds exist is serverkinds.KINDS (tests/test_serverkinds.py); these describe the shipped three.
    assert [api.kind for api in APIS] == ["embedded", "sglang", "vllm"]


def test_pause_modes_map_our_names_to_each_servers():
    def names(api):
        return {ours: mode.server for ours, mode in api.pause_modes.items()}

    assert names(SGLANG) == {"abort": "abort", "in_place": "in_place", "retract": "retract"}
    assert names(EMBEDDED) == {"abort": "abort", "in_place": "in_place", "retract": "abort"}
    assert names(VLLM) == {"abort": "abort", "in_place": "keep", "retract": "abort", "wait": "wait"}
    for api in APIS:
        assert set(api.pause_modes) <= set(OUR_PAUSE_MODES)
        assert not api.pause_mode("abort").keeps_requests
    # vLLM clears its prefix cache at every pause, which preempts the frozen requests (serverapi/vllm.py)
    assert [api.pause_mode("in_place").keeps_requests for api in APIS] == [True, True, False]
    assert {VLLM.pause_call(m).params["clear_cache"] for m in VLLM.pause_modes} == {"true"}
    assert (
        VLLM.pause_mode("abort").new_requests == "rejected"
        and SGLANG.pause_mode("abort").new_requests == "held"
    )
    with pytest.raises(
        ValueError, match=r"sglang pause modes are \['abort', 'in_place', 'retract'\], got 'wait'"
    ):
        SGLANG.pause_call("wait")


def test_control_requests_per_server():
    assert SGLANG.pause_call("in_place") == Call("POST", "/pause_generation", json={"mode": "in_place"})
    assert EMBEDDED.pause_call("retract") == Call("POST", "/pause_generation", json={"mode": "abort"})
    assert SGLANG.resume_call() == Call("POST", "/continue_generation", json={})
    assert SGLANG.abort_call("r1") == Call("POST", "/abort_request", json={"rid": "r1"})
    assert SGLANG.abort_all_call() == Call("POST", "/abort_request", json={"rid": "", "abort_all": True})
    assert VLLM.pause_call("in_place") == Call("POST", "/pause", params={"mode": "keep", "clear_cache": "true"})
    assert VLLM.pause_call("abort") == Call("POST", "/pause", params={"mode": "abort", "clear_cache": "true"})
    assert VLLM.resume_call() == Call("POST", "/resume")
    # vLLM aborts by the id it gave the engine request, never by the bare request_id we sent
    assert VLLM.abort_call("r1") == Call("POST", "/abort_requests", json={"request_ids": ["cmpl-r1-0"]})
    assert VLLM.abort_call("r1", "generate") == Call(
        "POST", "/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-r1"]}
    )
    assert VLLM.abort_all_call() == Call("POST", "/abort_requests", json={"request_ids": []})
    with pytest.raises(ValueError, match="vllm has no generate route 'chat'"):
        VLLM.route("chat")


def test_weight_update_sequences():
    assert [str(ep) for ep in (VLLM.weights.begin, VLLM.weights.update, VLLM.weights.end)] == [
        "POST /start_weight_update",
        "POST /update_weights",
        "POST /finish_weight_update",
    ]
    assert SGLANG.weights.pause == VLLM.weights.pause == "before" and EMBEDDED.weights.pause == "at_end"
    assert EMBEDDED.weights.ranks is None and SGLANG.weights.ranks is not None
    assert {api.requirement for api in (SGLANG, VLLM)} == {"sglang==0.5.23", "vllm==0.33.0"}


def test_control_sends_through_its_owner_and_tracks_its_own_pause():
    sent: list[Call] = []

    async def send(call: Call) -> None:
        sent.append(call)

    async def main() -> list:
        control = ServerControl(VLLM, send)
        states = []
        mode = await control.pause("in_place")
        states.append((control.paused, mode.keeps_requests))
        await control.resume()
        states.append(control.paused)
        with pytest.raises(ValueError, match="vllm pause modes"):
            await control.pause("stop")
        await control.abort("r", "generate")
        await control.abort_all()
        return states

    assert asyncio.run(main()) == [("in_place", False), None]  # vLLM's keep recomputes (serverapi/vllm.py)
    assert [c.path for c in sent] == ["/pause", "/resume", "/inference/v1/abort_requests", "/abort_requests"]
    assert all(c.repeatable for c in sent)  # sent twice, each changes nothing more: safe to retry


def test_a_failed_send_leaves_the_pause_state_as_it_was():
    async def fails(call: Call) -> None:
        raise ConnectionError(call.path)

    async def main() -> ServerControl:
        control = ServerControl(SGLANG, fails)
        with pytest.raises(ConnectionError):
            await control.pause("abort")
        return control

    assert asyncio.run(main()).paused is None


def test_the_embedded_description_matches_the_embedded_servers_routes():
    from starlette.routing import Match

    from slipstream.rollouter.embedded.app import build_app
    from slipstream.rollouter.embedded.engine import PAUSE_MODES

    engine = SimpleNamespace(
        cfg=SimpleNamespace(max_request_bytes=1 << 20), model_path="/m/x", tokenizer=None
    )
    app = build_app(engine, token="")  # routes only: the engine starts with the app's lifespan

    def served(method: str, path: str) -> bool:
        scope = {"type": "http", "method": method, "path": path, "root_path": "", "path_params": {},
                 "query_string": b"", "headers": []}  # fmt: skip
        return any(route.matches(scope)[0] == Match.FULL for route in app.routes)

    endpoints = [(ep.method, ep.path) for ep in EMBEDDED.endpoints()]
    endpoints += [("POST", EMBEDDED.weights.stream_prepare.format(stream=s)) for s in ("nixl", "ipc")]
    endpoints += [("POST", EMBEDDED.weights.stream_connect.format(stream=s)) for s in ("nixl", "ipc")]
    assert [e for e in endpoints if not served(*e)] == []
    assert not served("POST", "/no_such_route")
    assert {mode.server for mode in EMBEDDED.pause_modes.values()} == set(PAUSE_MODES)


def test_the_package_imports_no_role():
    roles = ("agents", "pipeline", "queue", "rollouter", "trainer", "weightsync")
    forbidden = tuple(f"slipstream.{role}" for role in roles)
    imported = [
        (path.name, node.module)
        for path in Path(serverapi.__file__).parent.glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(forbidden)
    ]
    assert imported == []
