"""Evaluation during fully asynchronous training: held-out prompts scored between weight pushes.

The rollouter never stops generating for training, so evaluation cannot be a phase between steps as in a
synchronous loop. Instead :class:`Evaluator` runs beside training generation on the same event loop and the
same servers: when a due weight version arrives (``eval.every``, module ``EvalConfig``) it starts one task
that sends every prompt of ``data.val_files`` ``eval.n`` times through its own
:class:`~slipstream.rollouter.partial.PartialRolloutClient`, which holds at most ``eval.max_concurrent``
requests in flight. That bound is what keeps evaluation from starving training: the rest of the servers'
capacity stays with the training groups, whose admission does not wait on evaluation at all. Evaluation
samples are scored by the rollouter's reward runner and summarised here; they never become trajectories,
are never put into the queue and never trained on.

Which version an evaluation measures: ``eval/version`` is the version the servers served when it started
(the version whose push made it due). Under ``async.partial_rollout: abort`` or ``in_place`` a push during
the evaluation interrupts its requests like training ones and they are resumed on the new weights, so their
later tokens come from a newer version; ``eval/partial_ratio`` is the share of samples with a token of a
version other than ``eval/version``, and ``eval/token_version_max`` the newest version any token came from.
Both stay at 0 / ``eval/version`` when an evaluation fits between two pushes (keep ``eval.max_concurrent``
large enough, or the val set small enough, for that).

One evaluation at a time: a version that becomes due while the previous evaluation still runs is skipped
(``eval/skipped`` counts them), so evaluations never pile up behind each other; ``evaluate_now`` (the end of
a run) waits for the running one and then evaluates the version asked for.

Metrics (:meth:`Evaluator.metrics`, merged into the rollouter's): once per finished evaluation, reported at
the next collection: ``eval/version``, ``eval/mean@<n>`` (mean reward over every sample), ``eval/pass@<n>``
(share of prompts with a correct sample: the reward's ``acc`` component when it has one, else reward > 0),
``eval/response_len_mean``, ``eval/finish_length``, ``eval/prompts``, ``eval/samples``, ``eval/reward_errors``,
``eval/partial_ratio``, ``eval/token_version_max``, ``eval/wall_s``, per data source
``eval/<source>/{mean,pass}@<n>`` when the val set has more than one; always the totals ``eval/skipped`` and
``eval/failed``.

Worked example::

    ev = Evaluator(settings, balancer, tokenizer, rewards, load_samples(settings.data.val_files))
    ev.on_version(0)          # due: starts evaluating version 0 in the background
    ev.on_version(1)          # not due (eval.every = 5)
    ...
    ev.metrics()              # {"eval/version": 0.0, "eval/mean@4": 0.31, "eval/pass@4": 0.62, ...}
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import msgspec

from slipstream.agents.base import AgentLoopOutput
from slipstream.agents.data import Sample
from slipstream.agents.multimodal import images_refused
from slipstream.agents.protocol import InferenceClient, SamplingParams
from slipstream.agents.registry import make_agent_loop
from slipstream.agents.rewards.runner import RewardResult
from slipstream.rollouter.partial import PartialRolloutClient
from slipstream.rollouter.settings import RollouterSettings
from slipstream.utils.logging import get_logger

log = get_logger(__name__)


class EvalSample(msgspec.Struct, kw_only=True):
    """One scored evaluation response (what the summary needs, nothing of the tokens)."""

    prompt_index: int
    data_source: str
    score: float
    components: dict[str, float] = {}
    error: str = ""
    response_len: int = 0
    finish_reason: str = "stop"
    versions: list[int] = []


def correct(sample: EvalSample) -> bool:
    """The reward's verdict: its ``acc`` component when present (rewards on a -1/1 scale keep it), else > 0."""
    if "acc" in sample.components:
        return sample.components["acc"] > 0
    return sample.score > 0


def summarize(samples: list[EvalSample], *, n: int, version: int) -> dict[str, float]:
    """mean@n, pass@n and the rest of one evaluation's metrics (module docstring), keys under ``eval/``.

    >>> s = [EvalSample(prompt_index=0, data_source="a", score=1.0), EvalSample(prompt_index=0, data_source="a",
    ...      score=0.0), EvalSample(prompt_index=1, data_source="a", score=0.0)]
    >>> m = summarize(s, n=2, version=3); (m["eval/mean@2"], m["eval/pass@2"])
    (0.3333333333333333, 0.5)
    """
    out = {"eval/version": float(version), **_scores(samples, n=n, prefix="eval/")}
    sources = sorted({s.data_source for s in samples})
    if len(sources) > 1:
        for source in sources:
            out.update(
                _scores([s for s in samples if s.data_source == source], n=n, prefix=f"eval/{source}/")
            )
    if samples:
        out["eval/response_len_mean"] = statistics.fmean(s.response_len for s in samples)
        out["eval/finish_length"] = sum(s.finish_reason == "length" for s in samples) / len(samples)
        out["eval/reward_errors"] = float(sum(bool(s.error) for s in samples))
        mixed = [
            s for s in samples if s.versions and (min(s.versions) != version or max(s.versions) != version)
        ]
        out["eval/partial_ratio"] = len(mixed) / len(samples)
        out["eval/token_version_max"] = float(
            max((max(s.versions) for s in samples if s.versions), default=version)
        )
    return out


def _scores(samples: list[EvalSample], *, n: int, prefix: str) -> dict[str, float]:
    by_prompt: dict[int, list[EvalSample]] = {}
    for s in samples:
        by_prompt.setdefault(s.prompt_index, []).append(s)
    out = {f"{prefix}prompts": float(len(by_prompt)), f"{prefix}samples": float(len(samples))}
    if samples:
        out[f"{prefix}mean@{n}"] = statistics.fmean(s.score for s in samples)
        solved = sum(any(correct(s) for s in group) for group in by_prompt.values())
        out[f"{prefix}pass@{n}"] = solved / len(by_prompt)
    return out


class Evaluator:
    """Evaluates ``samples`` at due weight versions, in the background (module docstring).

    Lifecycle: construct next to the rollouter; ``on_version(v)`` whenever the servers serve a new version
    (the first call also evaluates a fresh run's version 0); ``metrics()`` any time; ``await stop()`` at the end.
    All methods run on the rollouter's event loop. ``rewards`` needs ``async score(data_source, response,
    ground_truth, extra_info) -> RewardResult`` (the rollouter's :class:`RewardRunner`).
    """

    def __init__(
        self,
        settings: RollouterSettings,
        client: InferenceClient,
        tokenizer: Any,
        rewards: Any,
        samples: list[Sample],
    ) -> None:
        ecfg, s = settings.eval_, settings.rollout.sampling
        self.every = ecfg.every
        self.n = ecfg.n
        self.client = PartialRolloutClient(client, max_in_flight=ecfg.max_concurrent)
        # Built only when evaluating: some loops own resources (the external loop's gateway).
        self.agent = (
            make_agent_loop(settings.agent, self.client, tokenizer) if self.every and samples else None
        )
        if hasattr(self.agent, "image_refusal"):  # the gateway's loop: whether its image parts can be served
            self.agent.image_refusal = images_refused(settings.rollout.backend, settings.rollout.vllm.route)
        self.rewards = rewards
        self.sampling = SamplingParams(
            max_new_tokens=ecfg.max_new_tokens or s.max_new_tokens,
            temperature=s.temperature if ecfg.temperature is None else ecfg.temperature,
            top_p=s.top_p if ecfg.top_p is None else ecfg.top_p,
            top_k=s.top_k,
        )
        self.max_concurrent = ecfg.max_concurrent
        self.samples = self._fitting(samples, settings.data.max_prompt_tokens) if self.agent else []
        self.running_version: int | None = None
        self.skipped = 0
        self.failed = 0
        self.evaluated: list[int] = []  # versions evaluated to the end, in order
        self._bucket: int | None = None  # every-multiple of the last version that was due
        self._task: asyncio.Task[None] | None = None
        self._results: deque[dict[str, float]] = deque()
        self._stopping = False

    @property
    def enabled(self) -> bool:
        return self.every > 0 and bool(self.samples)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def _fitting(self, samples: list[Sample], max_prompt_tokens: int) -> list[Sample]:
        assert self.agent is not None
        fitting = [s for s in samples if len(self.agent.prompt_ids(s)) <= max_prompt_tokens]
        if len(fitting) < len(samples):
            log.warning(
                "evaluation: %d of %d prompts are over data.max_prompt_tokens=%d; skipped",
                len(samples) - len(fitting), len(samples), max_prompt_tokens,
            )  # fmt: skip
        return fitting

    # ------------------------------------------------------------------ scheduling
    def due(self, version: int) -> bool:
        """Version 0 on the first call, then the first version at or past each multiple of ``every``."""
        if not self.enabled:
            return False
        if self._bucket is None:
            return version == 0
        return version // self.every > self._bucket

    def on_version(self, version: int) -> None:
        """The servers serve ``version``: start its evaluation when due (skip it while one is running)."""
        if not self.enabled or self._stopping:
            return
        due = self.due(version)
        if self._bucket is None or due:
            self._bucket = version // self.every
        if not due:
            return
        if self.running:
            self.skipped += 1
            log.info("evaluation of version %d skipped: version %s is still being evaluated", version,
                     self.running_version)  # fmt: skip
            return
        self._start(version)

    async def evaluate_now(self, version: int) -> None:
        """Wait for a running evaluation, then evaluate ``version`` unless it was already (a run's end)."""
        if not self.enabled or self._stopping:
            return
        if self.running:
            await asyncio.shield(self._task)  # type: ignore[arg-type]
        if version not in self.evaluated:
            self._start(version)
            await asyncio.shield(self._task)  # type: ignore[arg-type]

    def _start(self, version: int) -> None:
        self.running_version = version
        self._task = asyncio.create_task(self._run(version), name=f"eval v{version}")

    def metrics(self) -> dict[str, float]:
        """The newest finished evaluation not reported yet (if any), plus the totals. Evaluations cannot
        overlap and the rollouter's metrics are collected after every push, so at most one is pending,
        except at a run's end (:meth:`evaluate_now`), where the newest is the one that matters."""
        out: dict[str, float] = {}
        while self._results:
            out = self._results.popleft()
        if self.every > 0:
            out["eval/skipped"] = float(self.skipped)
            out["eval/failed"] = float(self.failed)
        return out

    async def stop(self) -> None:
        """Abort the evaluation in flight (its results are dropped)."""
        self._stopping = True
        if self._task is None:
            return
        try:
            await self.client.abort_all()
        except TimeoutError:
            log.warning("aborting evaluation requests timed out; cancelling the evaluation")
        if not self._task.done():
            self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    # ------------------------------------------------------------------ one evaluation
    async def _run(self, version: int) -> None:
        t0 = time.monotonic()
        try:
            samples = await self._generate_all(version)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # evaluation failing must not end training generation
            self.failed += 1
            log.warning("evaluation of version %d failed: %s: %s", version, type(err).__name__, err)
            return
        finally:
            self.running_version = None
        if samples is None:
            return  # stopping
        result = summarize(samples, n=self.n, version=version)
        result["eval/wall_s"] = time.monotonic() - t0
        self.evaluated.append(version)
        self._results.append(result)
        log.info("evaluation of version %d: mean@%d %.3f, pass@%d %.3f (%d prompts, %.0f s)", version, self.n,
                 result.get(f"eval/mean@{self.n}", 0.0), self.n, result.get(f"eval/pass@{self.n}", 0.0),
                 len(self.samples), result["eval/wall_s"])  # fmt: skip

    async def _generate_all(self, version: int) -> list[EvalSample] | None:
        episodes: Iterator[tuple[Sample, int]] = ((s, i) for s in self.samples for i in range(self.n))
        results: list[EvalSample] = []

        async def worker() -> None:
            for sample, i in episodes:  # a shared iterator: each episode is taken by one worker
                result = await self._episode(sample, f"eval-v{version}-p{sample.index}-{i}")
                if result is None:
                    return
                results.append(result)

        workers = min(self.max_concurrent, len(self.samples) * self.n)
        async with asyncio.TaskGroup() as tg:
            for _ in range(workers):
                tg.create_task(worker())
        if self._stopping or len(results) < len(self.samples) * self.n:
            return None
        return results

    async def _episode(self, sample: Sample, uid: str) -> EvalSample | None:
        assert self.agent is not None
        out = await self.agent.run(sample, self.sampling, uid=uid)
        if out.finish_reason == "abort":  # only while stopping: the wrapper resumes every other abort
            return None
        score = await self._score(sample, out)
        return EvalSample(
            prompt_index=sample.index,
            data_source=sample.data_source,
            score=score.score,
            components=score.components,
            error=score.error,
            response_len=len(out.response_ids),
            finish_reason=out.finish_reason,
            versions=out.versions,
        )

    async def _score(self, sample: Sample, out: AgentLoopOutput) -> RewardResult:
        if out.reward is not None:  # the episode scored itself (an external harness)
            return RewardResult(score=out.reward, components=out.reward_components, error=out.reward_error)
        return await self.rewards.score(
            sample.data_source, out.response_text, sample.ground_truth, sample.extra_info
        )
