"""Rewards from a served model: an LLM judge or a reward model behind HTTP, called async and in batches.

A data source mapped to ``service`` in ``reward.sources`` is scored by the servers of ``reward.service``
instead of a function in the worker pool (rule rewards keep the pool). The servers are the user's own
(``reward.service.urls``) or a pool the pipeline starts for the run (``reward.service.launch``, handed over
as URLs and a token with :meth:`RewardService.authorize`); either way they are not rollout servers, so no
weight push and no rollout request ever reaches them.

Two wire protocols, chosen by ``reward.service.protocol`` (JSON over HTTP, base URLs without ``/v1``):

``judge``: OpenAI-compatible ``POST {url}/v1/chat/completions``, one sample per request (the endpoint
    takes one conversation)::

        {"model": M, "messages": [{"role": "user", "content": <judge_template formatted>}],
         "max_tokens": N, "temperature": T}
        -> {"choices": [{"message": {"content": "... Score: 0.8"}}]}

    The score is the number after the last ``Score:`` in the reply (or the whole reply when it is just a
    number), divided by ``judge_max_score``; a number outside ``[0, judge_max_score]`` is malformed.

``score``: ``POST {url}/score`` with up to ``batch_size`` samples per request::

        {"model": M, "items": [{"response": str, "ground_truth": any, "extra_info": {...}}, ...]}
        -> {"scores": [0.7, {"score": 0.1, "format": 1.0}, ...]}     # one per item, in order

    An entry is a number or a dict with ``score`` and named components, as a reward function returns.

Batching costs no latency: a sample waits only while every request slot (``max_concurrent``) is busy, and
the next free slot takes up to ``batch_size`` of the waiting samples at once. A request that times out
(``timeout_s``, the whole request), cannot connect, gets 408, 429 or 5xx, or gets a malformed reply is
retried on the next URL after ``backoff_s * 2**(n-1)`` seconds (at most ``backoff_max_s``), up to
``retries`` times; only the items of a batch that failed are sent again. Another 4xx is not retried. A
sample that still fails scores ``failure_score`` with its reason as the reward error (and in a warning,
at most one per ``WARN_EVERY_S``): the run goes on.
:class:`~slipstream.agents.rewards.runner.RewardRunner` also bounds a sample's whole call (waiting for a
slot, every retry) by ``reward.timeout_s``, as it bounds a reward function.

Worked example::

    service = RewardService(RewardServiceConfig(urls=["http://127.0.0.1:30010"], protocol="score"))
    await service.score("It is 7", "7", {"question": "3 + 4?"})    # RewardResult(score=1.0)
    await service.aclose()
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections import deque
from typing import Any

import httpx
import msgspec

from slipstream.agents.config import RewardConfig, RewardServiceConfig
from slipstream.agents.rewards.result import RewardResult, normalise
from slipstream.utils.logging import get_logger

# The judge's verdict: the last `Score: <number>` of its reply.
_SCORE_RE = re.compile(r"score\s*[:=]\s*\**\s*([-+]?\d+(?:\.\d+)?)", re.IGNORECASE)
_RETRY_STATUS = {408, 429}
WARN_EVERY_S = 30.0  # a failing server logs one warning per this many seconds, with the latest reason

log = get_logger(__name__)


class _Failure(msgspec.Struct):
    reason: str
    retry: bool = True


class _Item:
    __slots__ = ("response", "ground_truth", "extra_info", "future")

    def __init__(self, response: str, ground_truth: Any, extra_info: dict[str, Any], future: asyncio.Future):
        self.response = response
        self.ground_truth = ground_truth
        self.extra_info = extra_info
        self.future = future


def check_service(cfg: RewardConfig) -> None:
    """Raise ValueError naming the key when a data source is mapped to ``service`` and
    ``reward.service`` cannot serve it (no URLs, a URL that is not http(s), a judge template that does not
    format)."""
    from slipstream.agents.rewards import SERVICE_REWARD

    users = sorted(source for source, name in cfg.sources.items() if name == SERVICE_REWARD)
    if not users:
        return
    s = cfg.service
    if s.urls and s.launch.model_path:
        raise ValueError(
            "reward.service.urls, reward.service.launch.model_path: both set; the judge servers are either "
            "yours (urls) or started by the run (launch), not both"
        )
    if not s.urls and not s.launch.model_path:
        raise ValueError(
            f"reward.service.urls, reward.service.launch.model_path: neither is set, but reward.sources maps "
            f"`{users[0]}` to `{SERVICE_REWARD}`; list the base URLs of your judge or reward-model servers, "
            "or name the model whose servers the run starts"
        )
    if cfg.timeout_s < s.timeout_s:
        raise ValueError(
            f"reward.timeout_s: {cfg.timeout_s:g} s bounds a served reward's whole call (waiting, retries) and "
            f"is below one request's reward.service.timeout_s={s.timeout_s:g}; raise it"
        )
    for url in s.urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward.service.urls: `{url}` is not an http:// or https:// URL")
    if s.protocol == "judge":
        try:
            s.judge_template.format(question="q", response="r", ground_truth="g")
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(
                f"reward.service.judge_template: does not format with {{question}}, {{response}} and "
                f"{{ground_truth}} ({type(err).__name__}: {err})"
            ) from None


def parse_judge_reply(text: str, max_score: float) -> float:
    """The judge's score in [0, 1]; ValueError when the reply has none or it is out of range."""
    found = _SCORE_RE.findall(text)
    value_text = found[-1] if found else text.strip()
    try:
        value = float(value_text)
    except ValueError:
        raise ValueError(f"no `Score: <number>` in the judge's reply {text[-200:]!r}") from None
    if not 0.0 <= value <= max_score:
        raise ValueError(f"judge score {value:g} is outside [0, {max_score:g}]")
    return value / max_score


def _jsonable(obj: Any) -> Any:
    # Ground truths and extra_info read from parquet may hold numpy arrays and scalars.
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


class RewardService:
    """Scores samples with the servers of ``reward.service`` (see the module docstring for the protocols).

    Lifecycle: create (nothing connects until the first call), ``await score(...)`` from any task of one
    event loop, ``await aclose()`` (or ``close()`` from synchronous code) at the end; ``score`` may be called
    again after that. Counters: ``requests`` sent, ``retries``, ``failures`` (samples that got no score).
    """

    def __init__(self, cfg: RewardServiceConfig) -> None:
        self.cfg = cfg
        self.requests = 0
        self.retries = 0
        self.failures = 0
        self._pending: deque[_Item] = deque()
        self._in_flight = 0
        self._kick_scheduled = False
        self._next_url = 0
        self._http: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task] = set()
        self._token = ""
        self._next_warning = 0.0

    def authorize(self, token: str) -> RewardService:
        """Present ``token`` as the bearer token (instead of ``api_key_env``'s): the servers the pipeline
        started for the run guard their routes with it. Before the first call; returns self."""
        self._token = token
        return self

    def set_urls(self, urls: list[str]) -> None:
        """Call ``urls`` from now on (requests in flight finish, or are retried on these)."""
        self.cfg = msgspec.structs.replace(self.cfg, urls=list(urls))

    @property
    def batch_size(self) -> int:
        return self.cfg.batch_size if self.cfg.protocol == "score" else 1

    async def score(self, response: str, ground_truth: Any, extra_info: dict[str, Any]) -> RewardResult:
        """Score one sample; never raises for a failing server (the result's ``error`` says why)."""
        if not self.cfg.urls:
            return self._failed("reward.service.urls is empty")
        loop = asyncio.get_running_loop()
        item = _Item(response, ground_truth, extra_info, loop.create_future())
        self._pending.append(item)
        if not self._kick_scheduled:
            # Start requests once the tasks already runnable have queued their samples too: they batch.
            self._kick_scheduled = True
            loop.call_soon(self._kick)
        return await item.future

    def _kick(self) -> None:
        self._kick_scheduled = False
        while self._pending and self._in_flight < self.cfg.max_concurrent:
            batch = []
            while self._pending and len(batch) < self.batch_size:
                item = self._pending.popleft()
                if not item.future.done():  # its caller was cancelled
                    batch.append(item)
            if not batch:
                continue
            self._in_flight += 1
            task = asyncio.get_running_loop().create_task(self._run_batch(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run_batch(self, batch: list[_Item]) -> None:
        todo = batch
        attempts = self.cfg.retries + 1
        try:
            for attempt in range(attempts):
                if attempt:
                    self.retries += 1
                    await asyncio.sleep(min(self.cfg.backoff_max_s, self.cfg.backoff_s * 2 ** (attempt - 1)))
                outcomes = await self._request(self._pick_url(), todo)
                again = []
                for item, outcome in zip(todo, outcomes, strict=True):
                    if isinstance(outcome, RewardResult):
                        _settle(item, outcome)
                    elif outcome.retry and attempt + 1 < attempts:
                        again.append(item)
                    else:
                        tries = f" (after {attempt + 1} attempts)" if attempt else ""
                        _settle(item, self._failed(outcome.reason + tries))
                todo = again
                if not todo:
                    break
        finally:
            for item in todo:  # cancelled mid-way (the run is stopping)
                _settle(item, self._failed("reward service call cancelled"))
            self._in_flight -= 1
            self._kick()

    def _pick_url(self) -> str:
        url = self.cfg.urls[self._next_url % len(self.cfg.urls)]
        self._next_url += 1
        url = url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            key = self._token or (os.environ.get(self.cfg.api_key_env, "") if self.cfg.api_key_env else "")
            self._http = httpx.AsyncClient(
                headers={"Authorization": f"Bearer {key}"} if key else {},
                timeout=httpx.Timeout(self.cfg.timeout_s),
                limits=httpx.Limits(max_connections=self.cfg.max_concurrent),
            )
        return self._http

    async def _request(self, url: str, batch: list[_Item]) -> list[RewardResult | _Failure]:
        """One POST for ``batch``: a result or a failure per item, never an exception (but cancellation)."""
        if self.cfg.protocol == "judge":
            path, body = "/v1/chat/completions", self._judge_body(batch[0])
        else:
            path, body = "/score", self._score_body(batch)
        try:
            content = msgspec.json.encode(body, enc_hook=_jsonable)
        except (TypeError, ValueError, OverflowError) as err:
            return [_Failure(f"sample is not JSON-encodable: {err}", retry=False)] * len(batch)
        self.requests += 1
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                response = await self._client().post(
                    url + path, content=content, headers={"Content-Type": "application/json"}
                )
        except (TimeoutError, httpx.TimeoutException):
            return [_Failure(f"{url}: timeout after {self.cfg.timeout_s:g}s")] * len(batch)
        except httpx.HTTPError as err:
            return [_Failure(f"{url}: {type(err).__name__}: {err}")] * len(batch)
        if response.status_code != 200:
            retry = response.status_code in _RETRY_STATUS or response.status_code >= 500
            text = " ".join(response.text[:200].split())
            return [_Failure(f"{url}: HTTP {response.status_code}: {text}", retry=retry)] * len(batch)
        try:
            reply = msgspec.json.decode(response.content)
            if self.cfg.protocol == "judge":
                return [self._parse_judge(reply)]
            return self._parse_scores(reply, len(batch))
        except (msgspec.DecodeError, ValueError, KeyError, IndexError, TypeError) as err:
            return [_Failure(f"{url}: malformed reply: {err}")] * len(batch)

    def _judge_body(self, item: _Item) -> dict[str, Any]:
        info = item.extra_info or {}
        question = info.get("question", info.get("prompt", ""))
        prompt = self.cfg.judge_template.format(
            question=question, response=item.response, ground_truth=item.ground_truth
        )
        return {
            "model": self.cfg.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.cfg.judge_max_tokens,
            "temperature": self.cfg.judge_temperature,
        }

    def _score_body(self, batch: list[_Item]) -> dict[str, Any]:
        items = [
            {"response": i.response, "ground_truth": i.ground_truth, "extra_info": i.extra_info}
            for i in batch
        ]
        return {"model": self.cfg.model, "items": items}

    def _parse_judge(self, reply: Any) -> RewardResult | _Failure:
        text = reply["choices"][0]["message"]["content"]
        if not isinstance(text, str):
            raise ValueError(f"choices[0].message.content is {type(text).__name__}, not text")
        try:
            return RewardResult(score=parse_judge_reply(text, self.cfg.judge_max_score))
        except ValueError as err:
            return _Failure(f"malformed judge reply: {err}")

    def _parse_scores(self, reply: Any, n: int) -> list[RewardResult | _Failure]:
        scores = reply["scores"]
        if not isinstance(scores, list) or len(scores) != n:
            got = len(scores) if isinstance(scores, list) else type(scores).__name__
            raise ValueError(f"`scores` has {got} entries for {n} items")
        out: list[RewardResult | _Failure] = []
        for entry in scores:
            try:
                score, components = normalise(entry)
                out.append(RewardResult(score=score, components=components))
            except (TypeError, ValueError) as err:
                out.append(_Failure(f"malformed score {entry!r}: {err}"))
        return out

    def _failed(self, reason: str) -> RewardResult:
        self.failures += 1
        now = time.monotonic()
        if now >= self._next_warning:  # the reason reaches the log, not only the trajectory's outcome
            self._next_warning = now + WARN_EVERY_S
            log.warning("reward service: %d samples scored failure_score so far; the latest: %s",
                        self.failures, reason[:300])  # fmt: skip
        return RewardResult(score=self.cfg.failure_score, error=f"reward service: {reason}"[:500])

    async def aclose(self) -> None:
        """Cancel the requests in flight (their samples fail) and close the connections."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http is not None:
            http, self._http = self._http, None
            await http.aclose()

    def close(self) -> None:
        """:meth:`aclose` from synchronous code: inside a running loop the connections close in a task."""
        for task in list(self._tasks):
            task.cancel()
        http, self._http = self._http, None
        if http is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop to close it on; its connections go with the loop that opened them
        task = loop.create_task(http.aclose())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _settle(item: _Item, result: RewardResult) -> None:
    if not item.future.done():
        item.future.set_result(result)
