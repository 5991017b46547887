"""SGLang and vLLM clients: request building and response parsing against a fake server on loopback.

The fake answers with payloads shaped as sglang 0.5.23 and vllm 0.33 document them
(../shared/research/inference_apis.md §A, §B) and records what it received. Live tests against real
servers need a GPU and the engines installed; they are marked `gpu`.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from slipstream.agents.protocol import SamplingParams
from slipstream.rollouter.clients import make_client
from slipstream.rollouter.clients.base import ServerError, ServerUnavailable, expand_spans, parse_version
from slipstream.serverapi import EMBEDDED, SGLANG
from slipstream.serverkinds import server_kind
from slipstream.serverkinds.sglang import SGLangClient, build_generate_payload, parse_generate_response
from slipstream.serverkinds.vllm import VLLMClient, build_completions_payload, parse_completions_response
from slipstream.utils.net import free_port
from tests.rollouter.conftest import run

SGLANG_GENERATE = {
    "text": "abc",
    "output_ids": [11, 12, 13, 2],
    "meta_info": {
        "id": "r1",
        "finish_reason": {"type": "stop", "matched": 2},
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "cached_tokens": 0,
        "weight_version": "8",
        "weight_versions": [{"version": "7", "start": 0, "end": 2}, {"version": "8", "start": 2, "end": 4}],
        "output_token_logprobs": [[-0.1, 11, None], [-0.2, 12, None], [-0.3, 13, None], [-0.4, 2, None]],
        "num_retractions": 0,
    },
}

VLLM_COMPLETION = {
    "id": "cmpl-r1",
    "object": "text_completion",
    "model": "m",
    "choices": [
        {
            "index": 0,
            "text": "abc",
            "logprobs": {
                "text_offset": [0, 1, 2],
                "token_logprobs": [-0.5, -0.25, -0.125],
                "tokens": ["a", "b", "c"],
                "top_logprobs": [{"a": -0.5}, {"b": -0.25}, {"c": -0.125}],
            },
            "finish_reason": "length",
            "stop_reason": None,
            "prompt_token_ids": [1, 2],
            "token_ids": [21, 22, 23],
            "weight_versions": [{"version": "4", "start": 0, "end": 3}],
        }
    ],
    "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5},
}

VLLM_GENERATE = {
    "request_id": "r2",
    "choices": [
        {
            "index": 0,
            "token_ids": [31, 32],
            "logprobs": {"content": [{"token_id": 31, "logprob": -1.5}, {"token_id": 32, "logprob": -0.5}]},
            "finish_reason": "abort",
            "weight_versions": [
                {"version": "2", "start": 0, "end": 1},
                {"version": "3", "start": 1, "end": 2},
            ],
        }
    ],
    "prompt_token_ids": [1],
    "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
}


class FakeServer:
    """Answers each (method, path) with a queue of (status, json) replies and records every request."""

    def __init__(self) -> None:
        self.replies: dict[tuple[str, str], list[tuple[int, object]]] = {}
        self.requests: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, method: str) -> None:
                url = urlparse(self.path)
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                fake.requests.append(
                    {
                        "method": method,
                        "path": url.path,
                        "query": parse_qs(url.query),
                        "body": json.loads(raw or b"null"),
                    }
                )
                queue = fake.replies.get((method, url.path)) or [(404, {"error": "no such route"})]
                status, payload = queue.pop(0) if len(queue) > 1 else queue[0]
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._answer("GET")

            def do_POST(self) -> None:
                self._answer("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def reply(self, method: str, path: str, *answers: tuple[int, object]) -> None:
        self.replies[(method, path)] = list(answers)

    def bodies(self, path: str) -> list:
        return [r["body"] for r in self.requests if r["path"] == path]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def fake():
    server = FakeServer()
    yield server
    server.close()


SAMPLING = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, top_k=-1, stop_token_ids=[7])


def test_version_helpers():
    assert parse_version("12") == 12 and parse_version(3) == 3 and parse_version("default") == 0
    assert expand_spans(
        [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 2, "end": 3}], 3, 0
    ) == [
        1,
        1,
        2,
    ]
    assert expand_spans(None, 2, 5) == [5, 5]


def test_sglang_payload_and_parse():
    payload = build_generate_payload([1, 2, 3], SAMPLING, "r1")
    assert payload == {
        "input_ids": [1, 2, 3],
        "sampling_params": {
            "max_new_tokens": 16,
            "temperature": 0.9,
            "top_p": 0.95,
            "top_k": -1,
            "stop_token_ids": [7],
        },
        "return_logprob": True,
        "rid": "r1",
        "stream": False,
    }
    out = parse_generate_response(SGLANG_GENERATE, rid="r1", server="http://s")
    assert out.output_ids == [11, 12, 13, 2] and out.logprobs == [-0.1, -0.2, -0.3, -0.4]
    assert out.versions == [7, 7, 8, 8] and out.finish_reason == "stop" and out.prompt_tokens == 3


def test_sglang_parse_without_spans_uses_weight_version_and_rejects_missing_logprobs():
    body = json.loads(json.dumps(SGLANG_GENERATE))
    del body["meta_info"]["weight_versions"]
    assert parse_generate_response(body, rid="r1", server="s").versions == [8] * 4
    del body["meta_info"]["output_token_logprobs"]
    with pytest.raises(ValueError, match="return_logprob"):
        parse_generate_response(body, rid="r1", server="s")


def test_sglang_client_against_fake_server(fake):
    fake.reply("POST", "/generate", (200, SGLANG_GENERATE))
    fake.reply("POST", "/pause_generation", (200, {"message": "ok", "status": "ok"}))
    fake.reply("POST", "/continue_generation", (200, {"message": "ok", "status": "ok"}))
    fake.reply("POST", "/abort_request", (200, {}))
    fake.reply("GET", "/model_info", (200, {"model_path": "m", "weight_version": "8"}))

    async def main():
        client = SGLangClient(fake.url)
        try:
            out = await client.generate([1, 2, 3], SAMPLING, rid="r1")
            await client.pause("in_place")
            with pytest.raises(ValueError, match="pause modes"):
                await client.pause("wait")
            await client.resume()
            await client.abort("r1")
            await client.abort_all()
            return out, await client.weight_version()
        finally:
            await client.aclose()

    out, version = run(main())
    assert out.server == fake.url and version == 8
    assert fake.bodies("/generate")[0]["rid"] == "r1"
    assert fake.bodies("/pause_generation") == [{"mode": "in_place"}]
    assert fake.bodies("/abort_request") == [{"rid": "r1"}, {"rid": "", "abort_all": True}]


def test_vllm_payload_and_parse():
    payload = build_completions_payload([1, 2], SAMPLING, "r1")
    assert payload["prompt"] == [1, 2] and payload["max_tokens"] == 16 and payload["logprobs"] == 0
    assert payload["return_token_ids"] and payload["return_weight_versions"] and payload["request_id"] == "r1"
    assert payload["top_k"] == 0 and payload["stop_token_ids"] == [7]
    out = parse_completions_response(VLLM_COMPLETION, rid="r1", server="s", fallback_version=0)
    assert out.output_ids == [21, 22, 23] and out.logprobs == [-0.5, -0.25, -0.125]
    assert out.versions == [4, 4, 4] and out.finish_reason == "length" and out.prompt_tokens == 2


def test_vllm_client_completions_retries_503_while_paused(fake):
    paused = (503, {"error": {"message": "engine is paused", "type": "RetryableRequestError"}})
    fake.reply("POST", "/v1/completions", paused, paused, (200, VLLM_COMPLETION))
    fake.reply("POST", "/pause", (200, {"status": "paused"}))
    fake.reply("POST", "/resume", (200, {"status": "resumed"}))
    fake.reply("POST", "/abort_requests", (200, {"status": "aborted", "aborted": 1}))
    fake.reply("GET", "/weight_info", (200, {"weight_version": "4"}))

    async def main():
        client = VLLMClient(fake.url, retry_interval_s=0.01)
        try:
            out = await client.generate([1, 2], SAMPLING, rid="r1", session_id="s1")
            await client.pause("in_place")
            await client.pause("abort")
            await client.resume()
            await client.abort("r1")
            await client.abort_all()
            return out, await client.weight_version()
        finally:
            await client.aclose()

    out, version = run(main())
    assert out.output_ids == [21, 22, 23] and out.versions == [4, 4, 4] and version == 4
    assert len(fake.bodies("/v1/completions")) == 3
    assert fake.bodies("/v1/completions")[0]["session_id"] == "s1"
    pauses = [r["query"] for r in fake.requests if r["path"] == "/pause"]
    assert pauses == [{"mode": ["keep"], "clear_cache": ["true"]}, {"mode": ["abort"], "clear_cache": ["true"]}]
    assert fake.bodies("/abort_requests") == [{"request_ids": ["cmpl-r1-0"]}, {"request_ids": []}]


def test_vllm_client_generate_api_and_version_fallback(fake):
    no_spans = json.loads(json.dumps(VLLM_GENERATE))
    del no_spans["choices"][0]["weight_versions"]
    fake.reply("POST", "/inference/v1/generate", (200, VLLM_GENERATE), (200, no_spans))
    fake.reply("GET", "/weight_info", (200, {"weight_version": "6"}))
    fake.reply("POST", "/inference/v1/abort_requests", (200, {}))

    async def main():
        client = VLLMClient(fake.url, api="generate")
        try:
            first = await client.generate([1], SAMPLING, rid="r2")
            second = await client.generate([1], SAMPLING, rid="r3")
            await client.abort("r3")
            return first, second
        finally:
            await client.aclose()

    first, second = run(main())
    assert first.output_ids == [31, 32] and first.logprobs == [-1.5, -0.5]
    assert first.versions == [2, 3] and first.finish_reason == "abort"
    assert second.versions == [6, 6]
    body = fake.bodies("/inference/v1/generate")[0]
    assert (
        body["token_ids"] == [1]
        and body["sampling_params"]["max_tokens"] == 16
        and body["request_id"] == "r2"
    )
    # vLLM names a token-in/token-out engine request "generate-tokens-<rid>"; the bare rid aborts nothing
    assert fake.bodies("/inference/v1/abort_requests") == [{"request_ids": ["generate-tokens-r3"]}]


def test_errors_name_the_server_and_its_message(fake):
    fake.reply(
        "POST", "/generate", (400, {"error": {"message": "input too long"}}), (503, {"error": "engine down"})
    )

    async def main():
        client = SGLangClient(fake.url)
        dead = SGLangClient(f"http://127.0.0.1:{free_port()}")
        try:
            with pytest.raises(ServerError, match="input too long") as bad:
                await client.generate([1], SAMPLING)
            with pytest.raises(
                ServerUnavailable, match="engine down"
            ) as down:  # the balancer fails over on it
                await client.generate([1], SAMPLING)
            assert down.value.status == 503
            with pytest.raises(ServerUnavailable):
                await dead.generate([1], SAMPLING)
            return bad.value.status, await dead.health()
        finally:
            await client.aclose()
            await dead.aclose()

    status, healthy = run(main())
    assert status == 400 and healthy is False


def test_make_client_builds_the_kinds_client():
    async def main():
        names = ("embedded", "sglang", "vllm")
        clients = [make_client(server_kind(name), "http://127.0.0.1:1") for name in names]
        kinds = [type(c) for c in clients]
        for c in clients:
            await c.aclose()
        return kinds

    assert run(main()) == [SGLangClient, SGLangClient, VLLMClient]


def test_each_kind_speaks_its_own_description(fake):
    """The embedded server has SGLang's routes but its own pause modes (our retract is its abort)."""
    fake.reply("POST", "/pause_generation", (200, {"message": "ok", "status": "ok"}))

    async def main():
        embedded, sglang = (
            make_client(server_kind("embedded"), fake.url),
            make_client(server_kind("sglang"), fake.url),
        )
        try:
            await embedded.pause("retract")
            await sglang.pause("retract")
            return embedded.server_api, sglang.server_api
        finally:
            await embedded.aclose()
            await sglang.aclose()

    assert run(main()) == (EMBEDDED, SGLANG)
    assert fake.bodies("/pause_generation") == [{"mode": "abort"}, {"mode": "retract"}]


def _live_roundtrip(kind: str, model_path) -> None:
    from slipstream.rollouter.launch import launch_server

    with launch_server(server_kind(kind), model_path) as server:
        server.wait_healthy(900)

        async def main():
            client = make_client(server_kind(kind), server.url)
            try:
                out = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=8))
                await client.pause("in_place")
                await client.resume()
                return out, await client.weight_version()
            finally:
                await client.aclose()

        out, version = run(main(), timeout_s=600)
        assert len(out.output_ids) == len(out.logprobs) == len(out.versions) >= 1
        assert version == 0


# Skipped at collection without the package, so the model fixture never runs for a test that cannot.
@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm")
def test_live_vllm(tiny_model_path):
    _live_roundtrip("vllm", tiny_model_path)


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang")
def test_live_sglang(tiny_model_path):
    _live_roundtrip("sglang", tiny_model_path)
