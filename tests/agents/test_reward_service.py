"""The served judge / reward-model reward against a fake server on loopback: scores parsed, batching and the
concurrency bound kept, failures retried and then recorded as failed rewards with their reason.

The fake server decides by the response text it is asked to score: ``good:<x>`` scores x, ``flaky:<x>``
answers 500 the first time and x after, ``e500`` always 500, ``e400`` always 400, ``hang`` never answers
(until the test ends), ``garbage`` answers without a score, ``badjson`` with a body that is not JSON.
Nothing here depends on how long anything takes: a hung request is one the server never answers.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from slipstream.agents.config import RewardConfig, RewardServiceConfig
from slipstream.agents.rewards.runner import RewardRunner
from slipstream.agents.rewards.service import RewardService, parse_judge_reply


class FakeServer:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.requests: list[tuple[str, dict]] = []
        self.auth: list[str] = []  # each request's Authorization header
        self.seen: Counter[str] = Counter()
        self.in_flight = self.max_in_flight = self.arrivals = 0
        self.gate = 0  # > 0: hold each request until its group of `gate` requests has arrived
        self.release = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.auth.append(self.headers.get("Authorization", ""))
                try:
                    server.handle(self, body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on a hung request

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def handle(self, handler: BaseHTTPRequestHandler, body: dict) -> None:
        texts = (
            [body["messages"][0]["content"].split("RESPONSE=")[1]]
            if "messages" in body
            else [item["response"] for item in body["items"]]
        )
        with self.cond:
            self.requests.append((handler.path, body))
            self.arrivals += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            group_end = -(-self.arrivals // self.gate) * self.gate if self.gate else 0
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.arrivals >= group_end, timeout=20)  # a safety net, not a check
            firsts = [self.seen[t] == 0 for t in texts]
            self.seen.update(texts)
        try:
            self.reply(handler, "messages" in body, texts, firsts)
        finally:
            with self.cond:
                self.in_flight -= 1

    def reply(self, handler, judge: bool, texts: list[str], firsts: list[bool]) -> None:
        if "hang" in texts:
            self.release.wait()
            return
        first_flaky = any(t.startswith("flaky") and first for t, first in zip(texts, firsts, strict=True))
        status = 500 if "e500" in texts or first_flaky else 400 if "e400" in texts else 200
        if status != 200:
            return self.send(handler, status, {"error": {"message": f"failed with {status}"}})
        if "badjson" in texts:
            return self.send(handler, 200, b"{not json")
        scores = [self.value(t) for t in texts]
        if judge:
            content = "Looks fine." if scores[0] is None else f"The reasoning holds.\nScore: {scores[0]}"
            return self.send(
                handler, 200, {"choices": [{"message": {"role": "assistant", "content": content}}]}
            )
        return self.send(handler, 200, {"scores": ["n/a" if s is None else s for s in scores]})

    @staticmethod
    def value(text: str):
        if text.startswith(("good:", "flaky:")):
            value = text.split(":", 1)[1]
            return json.loads(value) if value.startswith("{") else float(value)
        return None  # garbage

    @staticmethod
    def send(handler, status: int, body) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    fake = FakeServer()
    yield fake
    fake.close()


def service_cfg(url: str | list[str], **kw) -> RewardServiceConfig:
    kw.setdefault("judge_template", "Q={question} REF={ground_truth} RESPONSE={response}")
    kw.setdefault("backoff_s", 0.001)
    kw.setdefault("retries", 2)
    return RewardServiceConfig(urls=[url] if isinstance(url, str) else url, **kw)


def score_all(cfg: RewardServiceConfig, texts: list[str], extra_info: dict | None = None):
    async def main():
        service = RewardService(cfg)
        try:
            results = await asyncio.gather(*(service.score(t, "42", extra_info or {}) for t in texts))
        finally:
            await service.aclose()
        return results, service

    return asyncio.run(main())


def test_judge_scores_are_parsed(server):
    cfg = service_cfg(server.url, model="my-judge", judge_max_score=10)
    (a, b), service = score_all(cfg, ["good:7", "good:10"], {"question": "6 x 7?"})
    assert (a.score, a.error, b.score) == (0.7, "", 1.0)
    path, body = server.requests[0]
    assert path == "/v1/chat/completions" and body["model"] == "my-judge" and body["temperature"] == 0.0
    assert body["messages"][0]["content"] in (
        "Q=6 x 7? REF=42 RESPONSE=good:7",
        "Q=6 x 7? REF=42 RESPONSE=good:10",
    )
    assert service.requests == 2 and service.failures == 0
    assert parse_judge_reply("**Score:** 3\n...\nScore = 4", 5) == 0.8
    assert parse_judge_reply(" 0.25 ", 1) == 0.25
    with pytest.raises(ValueError, match="outside"):
        parse_judge_reply("Score: 11", 10)


def test_score_protocol_batches_under_the_concurrency_bound(server):
    texts = [f"good:0.{i}" for i in range(10)]
    texts[3] = 'good:{"score": 0.3, "format": 1.0}'
    results, service = score_all(
        service_cfg(server.url, protocol="score", batch_size=4, max_concurrent=1), texts
    )
    assert [r.score for r in results] == [i / 10 for i in range(10)]
    assert results[3].components == {"format": 1.0} and not any(r.error for r in results)
    assert [(p, len(b["items"])) for p, b in server.requests] == [("/score", 4), ("/score", 4), ("/score", 2)]
    assert server.max_in_flight == 1 and service.requests == 3


def test_concurrency_bound_is_reached_and_never_passed(server):
    server.gate = 3  # each request waits until three are in flight, which a bound of 3 allows
    results, _ = score_all(service_cfg(server.url, max_concurrent=3), [f"good:0.{i}" for i in range(9)])
    assert [r.score for r in results] == [i / 10 for i in range(9)]
    assert server.max_in_flight == 3 and len(server.requests) == 9


def test_failures_are_retried_then_recorded_with_their_reason(server):
    cfg = service_cfg(server.url, retries=2, failure_score=-1.0)
    texts = ["flaky:0.5", "e500", "e400", "garbage", "badjson"]
    flaky, e500, e400, garbage, badjson = score_all(cfg, texts)[0]
    assert (flaky.score, flaky.error) == (0.5, "")
    assert e500.score == -1.0 and "HTTP 500: " in e500.error and "failed with 500" in e500.error
    assert e500.error.endswith("(after 3 attempts)") and e500.error.startswith("reward service: ")
    assert "HTTP 400" in e400.error and "attempts" not in e400.error  # a client error is not retried
    assert (
        "malformed judge reply: no `Score: <number>`" in garbage.error
        and "(after 3 attempts)" in garbage.error
    )
    assert "malformed reply" in badjson.error and badjson.score == -1.0
    assert server.seen == Counter({"flaky:0.5": 2, "e500": 3, "e400": 1, "garbage": 3, "badjson": 3})


def test_a_request_never_answered_times_out_and_is_retried(server):
    # The server never answers `hang`, so every attempt ends at the client's timeout whatever the load.
    (hang, good), service = score_all(service_cfg(server.url, retries=1, timeout_s=2.0), ["hang", "good:1"])
    assert (
        hang.score == 0.0
        and hang.error == f"reward service: {server.url}: timeout after 2s (after 2 attempts)"
    )
    assert good.score == 1.0 or "timeout" in good.error  # scored beside it (a loaded machine may time it out)
    # both attempts were made; on a loaded machine one may time out before the server has read it
    assert 1 <= server.seen["hang"] <= 2 and service.failures >= 1


def test_only_the_failed_items_of_a_batch_are_sent_again(server):
    cfg = service_cfg(server.url, protocol="score", batch_size=3, max_concurrent=1, retries=1)
    good, garbage, half = score_all(cfg, ["good:1", "garbage", "good:0.5"])[0]
    assert (good.score, half.score) == (1.0, 0.5)
    assert "malformed score 'n/a'" in garbage.error and garbage.score == 0.0
    assert [len(b["items"]) for _, b in server.requests] == [3, 1]


def test_a_dead_url_fails_over_to_the_next(server):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    (result,), service = score_all(service_cfg([dead, server.url], retries=1), ["good:0.9"])
    assert (result.score, result.error, service.retries) == (0.9, "", 1)


def test_runner_routes_service_sources_and_keeps_rule_rewards_in_the_pool(server):
    async def main():
        cfg = RewardConfig(
            num_workers=1,
            timeout_s=120.0,  # the first call also spawns the worker
            sources={"judged": "service", "sums": "arithmetic"},
            service=service_cfg(server.url, retries=0),
        )
        with RewardRunner(cfg) as runner:
            runner.check(["judged", "sums"])
            judged, failed, rule = await asyncio.gather(
                runner.score("judged", "good:0.25", "x", {}),
                runner.score("judged", "e500", "x", {}),
                runner.score("sums", "It is 7", "7", {}),
            )
            await runner.service.aclose()
        assert (judged.score, judged.error) == (0.25, "")
        assert failed.score == 0.0 and "HTTP 500" in failed.error
        assert (rule.score, rule.error) == (1.0, "")
        assert runner.calls == 3 and runner.errors == 1
        assert sorted(server.seen) == ["e500", "good:0.25"]  # the rule reward never reached the server

    asyncio.run(main())
    with pytest.raises(KeyError, match="reward.service.urls is empty"):
        RewardRunner(RewardConfig(sources={"judged": "service"})).check(["judged"])


def test_reward_timeout_bounds_the_whole_call(server):
    # Six attempts of 0.2 s each cannot end within 0.5 s, whatever the load: the runner's bound ends it.
    async def main():
        service = service_cfg(server.url, retries=5, timeout_s=0.2, failure_score=-1.0)
        cfg = RewardConfig(timeout_s=0.5, sources={"judged": "service"}, service=service)
        with RewardRunner(cfg) as runner:
            result = await runner.score("judged", "hang", "x", {})
            await runner.service.aclose()
        assert result.score == -1.0 and result.error == "reward service: no score within reward.timeout_s=0.5"
        assert runner.timeouts == 1 and runner.errors == 1

    asyncio.run(main())


def test_a_token_handed_over_replaces_the_api_key_env(server, monkeypatch):
    # The pipeline hands the judge servers it started to the service with their own token (authorize).
    monkeypatch.setenv("JUDGE_KEY", "from-env")

    async def main(token: str):
        service = RewardService(service_cfg(server.url, api_key_env="JUDGE_KEY"))
        if token:
            service.authorize(token)
        try:
            return await service.score("good:1", "x", {})
        finally:
            await service.aclose()

    assert asyncio.run(main("")).score == 1.0
    assert asyncio.run(main("run-token")).score == 1.0
    assert server.auth == ["Bearer from-env", "Bearer run-token"]
