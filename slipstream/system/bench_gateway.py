"""`slipstream bench gateway`: what the agent gateway adds to a request, and whether it records exactly.

One embedded server process on loopback serves a tiny random model (or ``--model``). The same chat request
(greedy, ``--max-tokens`` new tokens) is sent by the official ``openai`` client two ways, alternating:

* direct: to the server's own ``/v1/chat/completions`` (it renders the template and generates);
* gateway: to a gateway session (a fresh one per request, its key sent per request over one keep-alive
  connection, as the direct route has) that renders the template, calls the server's
  token-in/token-out ``/generate`` through the rollouter's partial-rollout client, and records the turn.

``overhead_p50_ms`` is the median of the paired differences (each gateway request against the direct
request just before it), steadier than the difference of the medians (also reported) under drifting load. ``tokens_match`` is true when every recorded token,
logprob and version equals what the server returned (a recording wrapper below the gateway keeps the raw
outputs) and the gateway's greedy tokens equal the direct route's.

    slipstream bench gateway --json
    {"direct_p50_ms": ..., "gateway_p50_ms": ..., "overhead_p50_ms": ..., "tokens_match": true, ...}
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from slipstream.agents.protocol import SamplingParams
from slipstream.cli_args import JSON_ONLY, add_json_flag, command_parser, doc_paragraph
from slipstream.rollouter.config import EmbeddedServerConfig, RolloutConfig
from slipstream.rollouter.launch import launch_server
from slipstream.rollouter.partial import PartialRolloutClient
from slipstream.serverkinds import server_kind
from slipstream.serverkinds.sglang import SGLangClient

MESSAGES = [{"role": "user", "content": "Write one sentence about rivers."}]


class _Recorder:
    def __init__(self, client) -> None:
        self.client = client
        self.outputs = []

    async def generate(self, input_ids, sampling, *, rid=None, session_id=None):
        out = await self.client.generate(input_ids, sampling, rid=rid, session_id=session_id)
        self.outputs.append(msgspec_copy(out))
        return out

    async def abort(self, rid):
        await self.client.abort(rid)


def msgspec_copy(out):
    import msgspec

    return msgspec.structs.replace(out, output_ids=list(out.output_ids), logprobs=list(out.logprobs),
                                   versions=list(out.versions))  # fmt: skip


async def _measure(url: str, tokenizer, requests: int, max_tokens: int) -> dict:
    from openai import AsyncOpenAI

    from slipstream.agents.gateway import Gateway

    raw = SGLangClient(url)
    recorder = _Recorder(raw)
    sampling = SamplingParams(max_new_tokens=max_tokens, temperature=0.0)
    gateway = Gateway(PartialRolloutClient(recorder, max_in_flight=4), tokenizer, sampling=sampling)
    await gateway.start()
    direct = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    # One client (one keep-alive connection) for the gateway too: a session's key, sent per request, picks
    # the session on the bare /v1 routes, so both paths pay the same connection costs.
    via_gateway = AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="set-per-request", max_retries=0)
    times: dict[str, list[float]] = {"direct": [], "gateway": []}
    match = True
    try:
        for i in range(requests + 1):  # the first round warms both paths up and is not counted
            t0 = time.perf_counter()
            d = await direct.chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=max_tokens, temperature=0.0,
                extra_body={"return_token_ids": True},
            )  # fmt: skip
            t1 = time.perf_counter()
            session = gateway.open_session(f"bench-{i}")
            g = await via_gateway.chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=max_tokens, extra_body={"return_token_ids": True},
                extra_headers={"Authorization": f"Bearer {session.api_key}"},
            )  # fmt: skip
            t2 = time.perf_counter()
            episode = await gateway.close_session(session)
            seg, served = episode.segments[0], recorder.outputs[-1]
            match = match and (
                seg.response_ids == served.output_ids
                and seg.logprobs == served.logprobs
                and seg.versions == served.versions
                and g.choices[0].model_extra["token_ids"] == served.output_ids
                and d.choices[0].model_extra["token_ids"] == served.output_ids
            )
            if i:
                times["direct"].append((t1 - t0) * 1e3)
                times["gateway"].append((t2 - t1) * 1e3)
    finally:
        await direct.close()
        await via_gateway.close()
        await gateway.stop()
        await raw.aclose()
    direct_p50, gateway_p50 = statistics.median(times["direct"]), statistics.median(times["gateway"])
    return {
        "direct_p50_ms": round(direct_p50, 2),
        "gateway_p50_ms": round(gateway_p50, 2),
        # Median of the paired differences (each gateway request against the direct one just before it):
        # steadier than the difference of the medians on a machine whose load drifts.
        "overhead_p50_ms": round(
            statistics.median(g - d for g, d in zip(times["gateway"], times["direct"], strict=True)), 2
        ),
        "overhead_of_medians_ms": round(gateway_p50 - direct_p50, 2),
        "tokens_match": match,
        "requests": requests,
        "completion_tokens": len(recorder.outputs[-1].output_ids),
    }


def run_bench(model: str | None, requests: int, max_tokens: int, threads: int, log) -> dict:
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="slipstream-bench-gateway-") as tmp:
        if model is None:
            from slipstream.utils.tiny_models import make_tiny_model

            model_path = make_tiny_model(Path(tmp) / "tiny")
        else:
            from slipstream.rollouter.models import resolve_model_path

            model_path = resolve_model_path(model)
        engine = EmbeddedServerConfig(num_threads=threads, max_model_len=1024, kv_cache_tokens=8192, seed=0)
        server = launch_server(server_kind("embedded"), model_path, cfg=RolloutConfig(embedded=engine),
                               log_path=Path(tmp) / "server.log")  # fmt: skip
        try:
            server.wait_healthy(timeout_s=300)
            log(f"server up at {server.url}; {requests} requests per path, {max_tokens} tokens each")
            tokenizer = AutoTokenizer.from_pretrained(model_path)
            summary = asyncio.run(_measure(server.url, tokenizer, requests, max_tokens))
        finally:
            server.stop()
    summary["model"] = model or "tiny-random"
    summary["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("slipstream bench gateway", doc_paragraph(__doc__))
    # Hand-written: request counts and sizes of the measurement, no config key.
    parser.add_argument(
        "--model", default=None, help="known model name or HF directory (default: tiny random)"
    )
    parser.add_argument("--requests", type=int, default=30, help="timed requests per path")
    parser.add_argument("--max-tokens", type=int, default=16, help="new tokens per request (greedy)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    add_json_flag(parser, JSON_ONLY)
    ns = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop the server

    def log(msg: str) -> None:
        print(f"[bench gateway] {msg}", file=sys.stderr if ns.json else sys.stdout, flush=True)

    summary = run_bench(ns.model, ns.requests, ns.max_tokens, ns.threads, log)
    print(json.dumps(summary))
    return 0
