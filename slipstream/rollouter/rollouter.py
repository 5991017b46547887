"""The rollouter: streams prompts through agent loops into the queue, under staleness control.

One asyncio task admits groups through the :class:`~slipstream.rollouter.gate.StalenessGate` and starts
a task per group: ``n`` agent-loop episodes of one prompt run concurrently against the inference servers
(through the :class:`~slipstream.rollouter.partial.PartialRolloutClient`, which resumes requests aborted
by a weight update), each trajectory is scored off the event loop, and the finished group is ``put`` into
the queue (waiting on back-pressure). A finished group frees nothing in the gate: the budget is about
versions, not about what is in flight. A background task collects groups the trainer dropped as too
stale (``queue.pop_dropped``): their budget is refunded and their prompts generated again first.

Identity: group ``e<epoch>-p<index>`` (``-a<k>`` for the k-th re-generation after a drop, since the
queue refuses ids it has seen; ``-s<k>`` for the k-th re-sample after dynamic sampling filtered it),
trajectories ``<group_id>-<i>``; the group's typed ``Provenance`` (``queue/types.py``) carries
``prompt_index``, ``epoch``, ``attempt``, ``data_source``, and ``keep_stale`` once the prompt was dropped
``async.max_stale_drops`` times.

Rewards: each response is scored off the event loop, then shaped by the overlong penalty
(``reward.overlong_buffer_len``, agents/rewards/overlong.py). With ``rollout.dynamic_sampling`` on, a
group whose samples all score the same is not put: its gate unit is refunded (so another group starts in
its place) and its prompt is sampled again, up to ``max_attempts`` times, then skipped until the next pass
(``rollouter/filtered_groups``, ``rollouter/filter_ratio``, ``rollouter/prompts_filtered_out``).

No starvation under the hard staleness cap: a prompt dropped ``async.max_stale_drops`` times is generated
once more with ``keep_stale`` set, and the trainer trains on that group whatever its staleness
(``rollouter/stale_kept_groups``). Resuming the dropped group from its partial rollout instead would not
help: the trainer drops *finished* groups, and a resumed response keeps the versions of its first tokens,
so it would be just as stale.

Modes (``async.partial_rollout``): ``abort`` and ``in_place`` need nothing from the rollouter (the
controller pauses the servers; the wrapper resumes aborted requests); ``off``: the controller calls
:meth:`Rollouter.drain` before a weight push (admission stops, in-flight groups finish) and
:meth:`Rollouter.set_version` after it (admission reopens). The ``sync`` mode is the gate with
threshold 0 and ``sync_every`` 1 plus a drain before each push.

Nothing is lost: a group whose generation fails is refunded and retried (up to ``MAX_GROUP_FAILURES``
times, then :meth:`run` raises); :meth:`state_dict` records the prompt position and every prompt admitted
but not yet put, which a resumed run generates again (the queue's de-duplication drops a group that was
in fact put).

Worked example (the controller's side)::

    settings = rollouter_settings(cfg)    # slipstream/config.py
    rollouter = Rollouter(settings, balancer, queue, tokenizer, PromptSource.from_config(settings.data))
    task = asyncio.create_task(rollouter.run())
    ...                                   # trainer steps; every sync_every steps:
    await rollouter.drain()               # only with partial_rollout = off (and sync)
    push_weights(version=step)
    rollouter.set_version(step)
    log.log(step, rollouter.metrics())
    await rollouter.stop(); await task
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import msgspec
import numpy as np

from slipstream.agents.base import AgentLoopOutput
from slipstream.agents.data import PromptRef, PromptSource, Sample, load_samples
from slipstream.agents.multimodal import ImageTokens, group_images, images_refused
from slipstream.agents.protocol import InferenceClient, SamplingParams
from slipstream.agents.registry import make_agent_loop
from slipstream.agents.rewards.overlong import shape
from slipstream.agents.rewards.runner import RewardResult, RewardRunner
from slipstream.queue.base import QueueProducer
from slipstream.queue.errors import QueueFull
from slipstream.queue.types import Provenance, SampleOutcome, Trajectory, TrajectoryGroup
from slipstream.rollouter.evaluation import Evaluator
from slipstream.rollouter.gate import StalenessGate
from slipstream.rollouter.partial import PartialRolloutClient
from slipstream.rollouter.server_stats import ServerStats
from slipstream.rollouter.settings import RollouterSettings
from slipstream.rollouter.state import GateCount, PendingPrompt, PromptPosition, RolloutState
from slipstream.rollouter.stats import RolloutStats
from slipstream.utils.logging import get_logger

log = get_logger(__name__)

# A prompt whose group fails this many times in a row stops the run (a bug, not bad luck).
MAX_GROUP_FAILURES = 3
# Seconds between polls of the queue for groups the trainer dropped as too stale.
DROPPED_POLL_S = 1.0
# Seconds between reads of the servers' own counters (server/* metrics; a step takes longer).
SERVER_STATS_POLL_S = 2.0


class _Work(msgspec.Struct, kw_only=True):
    """A prompt to generate a group for; ``attempt`` counts re-generations after the trainer dropped it."""

    ref: PromptRef
    attempt: int = 0
    failures: int = 0
    # Groups of this prompt dynamic sampling dropped in a row (all samples scored the same).
    resamples: int = 0
    # Just taken from the prompt source (owed work, e.g. a dropped group, goes before it).
    fresh: bool = False

    @property
    def group_id(self) -> str:
        base = f"e{self.ref.epoch}-p{self.ref.index}"
        base = f"{base}-a{self.attempt}" if self.attempt else base
        return f"{base}-s{self.resamples}" if self.resamples else base


class GroupInterrupted(RuntimeError):
    """A group ended with an aborted episode while the run was not stopping (generate it again)."""


class Rollouter:
    """Generates groups of trajectories and streams them into the queue (see the module docstring).

    Lifecycle: construct, ``await run()`` in a task, ``set_version`` after each weight push, ``drain``
    around pushes without partial rollouts, ``await stop()`` to end early; ``metrics()`` any time.
    All methods must be called from the event loop that runs :meth:`run`.
    """

    def __init__(
        self,
        settings: RollouterSettings,
        client: InferenceClient,
        queue: QueueProducer,
        tokenizer: Any,
        prompts: PromptSource,
        val_samples: list[Sample] | None = None,
        server_stats: ServerStats | None = None,
    ) -> None:
        self.settings = settings
        # The servers' own counters (server/* metrics), polled beside generation when given.
        self.server_stats = server_stats
        num_servers = len(settings.rollout.server_urls) or settings.rollout.num_servers
        self.client = PartialRolloutClient(
            client, max_in_flight=settings.rollout.max_concurrent_per_server * num_servers
        )
        self.agent = make_agent_loop(settings.agent, self.client, tokenizer)
        if hasattr(self.agent, "image_refusal"):  # the gateway's loop: whether its image parts can be served
            self.agent.image_refusal = images_refused(settings.rollout.backend, settings.rollout.vllm.route)
        self._images: ImageTokens | None = None  # the model's image token counts, read at the first image
        self.rewards = RewardRunner(settings.reward)
        self.rewards.check({s.data_source for s in prompts.samples})
        # The settings hold the mode's preset already (slipstream/config.py: rollouter_settings).
        self.gate = StalenessGate(
            batch_groups=settings.batch_groups,
            sync_every=settings.sync_every,
            staleness_threshold=settings.staleness_threshold,
        )
        self.queue = queue
        self.prompts = prompts
        s = settings.rollout.sampling
        self.sampling = SamplingParams(
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            return_routed_experts=settings.return_routes,
        )
        self.stats = RolloutStats(settings.sync_every)
        self.version = 0
        self._todo: deque[_Work] = deque()  # before new prompts: dropped groups, resumed in-flight ones
        self._in_flight: dict[str, _Work] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._changed = asyncio.Event()  # a group finished or a drop arrived: the admission loop looks again
        self._idle = asyncio.Event()  # no group in flight (drain waits on it)
        self._idle.set()
        self._stopping = False
        self._running = False
        self._fatal: BaseException | None = None
        self._waiting: _Work | None = None
        # Seconds between polls for dropped groups (and the longest an idle admission wait sleeps).
        self.poll_s = DROPPED_POLL_S
        # Held-out prompts evaluated beside generation (eval.every); their samples never reach the queue.
        if val_samples is None and settings.eval_.every > 0:
            val_samples = load_samples(settings.data.val_files)
        self.rewards.check({s.data_source for s in val_samples or []})
        self.evaluator = Evaluator(settings, client, tokenizer, self.rewards, val_samples or [])

    # ------------------------------------------------------------------ controller API
    async def run(self) -> None:
        """Generate until every prompt is served and every group put, or until :meth:`stop`."""
        if self._running:
            raise RuntimeError("Rollouter.run is already running")
        self._running = True
        self.evaluator.on_version(self.version)  # a fresh run's version 0 is evaluated before training
        poller = asyncio.create_task(self._poll_dropped())
        counting = (
            asyncio.create_task(self.server_stats.run(SERVER_STATS_POLL_S)) if self.server_stats else None
        )
        try:
            await self._admit_loop()
        except BaseException:
            await self.stop()  # no group task outlives a failed run
            raise
        else:
            if not self.evaluator.running:
                self.rewards.close()  # the worker processes start again if run() is called again
        finally:
            for task in (poller, counting):
                if task is not None:
                    task.cancel()
            await asyncio.gather(*(t for t in (poller, counting) if t is not None), return_exceptions=True)
            self._running = False
            self._changed.set()
        self._raise_fatal()

    async def stop(self) -> None:
        """Stop admitting, abort in-flight requests and end :meth:`run`. In-flight prompts stay in
        :meth:`state_dict` to be generated again."""
        self._stopping = True
        self.gate.shutdown()
        self._changed.set()
        try:
            await self.client.abort_all()
        except TimeoutError:
            log.warning("aborting in-flight requests timed out; cancelling their tasks")
        tasks = set(self._tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=10.0)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await self.evaluator.stop()
        self.rewards.close()

    def set_version(self, version: int) -> None:
        """The servers now serve ``version``: open the gate (its budget grows with the version)."""
        self.version = max(self.version, version)
        self.gate.set_version(version)
        self._changed.set()
        self.evaluator.on_version(self.version)

    def set_staleness_threshold(self, staleness_threshold: float) -> None:
        """The autotune controller moved ``async.staleness_threshold``: the gate's budget follows it."""
        self.gate.set_threshold(staleness_threshold)
        self._changed.set()

    async def drain(self) -> None:
        """Stop admitting until the next :meth:`set_version` and wait until no group is in flight."""
        self.gate.close()
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self._in_flight and self._running:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"drain: {len(self._in_flight)} groups still in flight")
            try:  # woken when the last group leaves; the 1 s cap notices a run that ended meanwhile
                await asyncio.wait_for(self._idle.wait(), min(remaining, 1.0))
            except TimeoutError:
                pass
            self._raise_fatal()

    def metrics(self) -> dict[str, float]:
        gauges = {
            "requests_active": self.client.active,
            "requests_queued": self.client.queued,
            "groups_in_flight": len(self._in_flight),
            "gate_admitted": self.gate.admitted,
            "gate_budget": self.gate.budget,
            "version": self.version,
            **self.agent.metrics(),
        }
        out = self.stats.collect(
            tokens=self.client.generated_tokens, busy_s=self.client.busy_seconds(), gauges=gauges
        )
        servers = self.server_stats.collect() if self.server_stats is not None else {}
        return {**out, **self.evaluator.metrics(), **servers}

    def state_dict(self) -> RolloutState:
        """The prompt position, the gate's count and every prompt owed but not yet put.

        Groups in flight are saved as pending prompts and their gate units as refunded, so a resumed run
        admits them again exactly once."""
        waiting = [self._waiting] if self._waiting is not None else []
        pending = [*self._in_flight.values(), *waiting, *self._todo]
        gate = self.gate.state_dict()
        return RolloutState(
            prompts=PromptPosition(**self.prompts.state_dict()),
            gate=GateCount(
                admitted=gate["admitted"] - len(self._in_flight), refunded=gate.get("refunded", 0)
            ),
            pending=[PendingPrompt(w.ref.epoch, w.ref.index, w.attempt, w.resamples) for w in pending],
        )

    async def checkpoint_state(self) -> RolloutState:
        """:meth:`state_dict` for a run checkpoint taken between trainer steps: the drops the trainer already
        reported are taken in first, so they are in this state (one popped while the trainer saves would be
        in neither this state nor the queue snapshot's dropped list), and no new drop arrives until the
        checkpoint is written."""
        await self._collect_dropped()
        return self.state_dict()

    def set_judges(self, urls: list[str], token: str | None = None) -> None:
        """The judge servers the reward service calls from now on (``token``: their own, when it changes)."""
        service = self.rewards.service
        if token:
            service.authorize(token)
        service.set_urls(urls)

    async def finish_eval(self, version: int) -> None:
        """Wait for the running evaluation, then evaluate ``version`` if it was not (the end of a run)."""
        await self.evaluator.evaluate_now(version)

    def load_state_dict(self, state: RolloutState) -> None:
        if self._running:
            raise RuntimeError("load_state_dict must be called before run()")
        self.prompts.load_state_dict(state.prompts.as_dict())
        self.gate.load_state_dict(state.gate.as_dict())
        self._todo = deque(
            _Work(ref=PromptRef(p.epoch, p.index), attempt=p.attempt, resamples=p.resamples)
            for p in state.pending
        )

    # ------------------------------------------------------------------ admission
    async def _admit_loop(self) -> None:
        while not self._stopping:
            self._raise_fatal()
            work = self._next_work()
            if work is None:
                if not self._in_flight and not self._todo:
                    await self._collect_dropped()  # a last look: the trainer may have dropped the tail
                    if not self._todo:
                        return
                await self._wait_for_change()
                continue
            self._waiting = work  # owed while it waits for the gate: state_dict must list it
            admitted = await self._admit()
            self._waiting = None
            if not admitted:
                self._todo.appendleft(work)
                continue
            if self._todo and work.fresh:
                # A dropped group arrived while this new prompt waited: the re-generation goes first.
                self._todo.append(msgspec.structs.replace(work, fresh=False))
                work = self._todo.popleft()
            self._start(work)

    async def _admit(self) -> bool:
        """Wait for the gate; wake up for dropped groups too (they go first once refunded)."""
        while not self._stopping:
            if await self.gate.admit(timeout_s=self.poll_s):
                return True
            self._raise_fatal()
        return False

    def _next_work(self) -> _Work | None:
        if self._todo:
            return self._todo.popleft()
        while (item := self.prompts.next()) is not None:
            ref, sample = item
            if self._prompt_fits(sample):
                return _Work(ref=ref, fresh=True)
            self.stats.count("prompts_skipped")
        return None

    def _prompt_fits(self, sample: Sample) -> bool:
        length = len(self.agent.prompt_ids(sample))
        if sample.images:  # each image's one pad becomes its tokens on the server
            length += sum(self._image_tokens().count(image) - 1 for image in sample.images)
        if length <= self.settings.data.max_prompt_tokens:
            return True
        log.warning(
            "prompt %d is %d tokens, over data.max_prompt_tokens=%d; skipped",
            sample.index,
            length,
            self.settings.data.max_prompt_tokens,
        )
        return False

    def _image_tokens(self) -> ImageTokens:
        if self._images is None:
            self._images = ImageTokens.from_model(self.settings.model.path) or ImageTokens()
        return self._images

    async def _wait_for_change(self) -> None:
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), self.poll_s)
        except TimeoutError:
            pass

    def _start(self, work: _Work) -> None:
        self._in_flight[work.group_id] = work
        self._idle.clear()
        task = asyncio.create_task(self._run_group(work), name=f"group {work.group_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ one group
    async def _run_group(self, work: _Work) -> None:
        try:
            group = await self._generate_group(work)
            if group is None:
                return  # stopping: stays in _in_flight, so state_dict keeps the prompt
            informative = self._informative(group)
            self.stats.record_group(filtered=not informative)
            if not informative:
                self._filtered(work)
                return
            await self._put(group)
            if group.meta.keep_stale:
                self.stats.count("stale_kept_groups")
            self._in_flight.pop(work.group_id, None)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            self._group_failed(work, err)
        finally:
            if not self._in_flight:
                self._idle.set()
            self._changed.set()

    async def _generate_group(self, work: _Work) -> TrajectoryGroup | None:
        sample = self.prompts.get(work.ref.index)
        gid = work.group_id
        async with asyncio.TaskGroup() as tg:
            episodes = [
                tg.create_task(self.agent.run(sample, self.sampling, uid=f"{gid}-{i}"))
                for i in range(self.settings.rollout.n)
            ]
        outputs = [e.result() for e in episodes]
        if self._stopping:
            return None
        if any(o.finish_reason == "abort" for o in outputs):
            raise GroupInterrupted(f"group {gid}: an episode was aborted")
        async with asyncio.TaskGroup() as tg:
            scores = [tg.create_task(self._score(sample, o)) for o in outputs]
        trajectories = []
        for i, (out, score) in enumerate(zip(outputs, scores, strict=True)):
            trajectories.append(self._trajectory(gid, i, out, score.result()))
            for k, seg in enumerate(out.earlier_segments):  # same reward and group; its own sequence
                trajectories.append(self._trajectory(gid, i, seg, score.result(), segment=k))
        cfg = self.settings
        if cfg.return_routes:
            _require_routes(gid, trajectories)
        provenance = Provenance(
            prompt_index=work.ref.index,
            epoch=work.ref.epoch,
            attempt=work.attempt,
            data_source=sample.data_source,
            # dropped often enough: the trainer takes it whatever its staleness
            keep_stale=cfg.stale_policy == "drop" and work.attempt >= cfg.max_stale_drops,
        )
        # the prompt's images go once per group: every trajectory's prompt holds their pads (the sample's, or
        # those the episodes sent through the gateway)
        episodes = [seg for out in outputs for seg in (out, *out.earlier_segments)]
        try:
            images = group_images(sample.images, episodes)
        except ValueError as err:
            raise ValueError(f"group {gid}: {err}") from None
        return TrajectoryGroup.from_trajectories(trajectories, provenance, images=images)

    async def _score(self, sample: Sample, out: AgentLoopOutput) -> RewardResult:
        if out.reward is not None:  # the episode scored itself (the external loop: the harness's reward)
            return RewardResult(score=out.reward, components=out.reward_components, error=out.reward_error)
        return await self.rewards.score(
            sample.data_source, out.response_text, sample.ground_truth, sample.extra_info
        )

    def _trajectory(
        self, gid: str, i: int, out: AgentLoopOutput, score: RewardResult, segment: int = -1
    ) -> Trajectory:
        out.validate()
        rcfg = self.settings.reward
        score = shape(
            score,
            len(out.response_ids),
            max_response_len=self.sampling.max_new_tokens,
            buffer_len=rcfg.overlong_buffer_len,
            penalty_factor=rcfg.overlong_penalty_factor,
        )
        metrics = {
            **out.metrics,
            "num_resumes": float(out.num_resumes),
            "reward_error": float(bool(score.error)),
        }
        if segment < 0:  # an episode's earlier segments are trained, not counted as more episodes
            self.stats.record_trajectory(
                versions=out.versions,
                current_version=self.version,
                num_resumes=out.num_resumes,
                reward=score.score,
                reward_error=bool(score.error),
                response_len=len(out.response_ids),
                num_turns=out.num_turns,
                finish_reason=out.finish_reason,
            )
        return Trajectory(
            uid=f"{gid}-{i}" if segment < 0 else f"{gid}-{i}-seg{segment}",
            episode="" if segment < 0 else f"{gid}-{i}",
            group_id=gid,
            prompt_ids=out.prompt_ids,
            response_ids=out.response_ids,
            loss_mask=out.loss_mask,
            logprobs=out.logprobs,
            versions=out.versions,
            reward=score.score,
            reward_components=score.components,
            finish_reason=out.finish_reason,
            num_turns=out.num_turns,
            metrics=metrics,
            outcome=SampleOutcome(reward_error=score.error, segment=segment),
            routed_experts=_padded_routes(
                out.routed_experts, len(out.prompt_ids) + len(out.response_ids) - 1
            ),
        )

    async def _put(self, group: TrajectoryGroup) -> None:
        """Put, waiting on back-pressure; a put that times out (queue full for put_timeout_s) is retried."""
        while True:
            try:
                stored = await self.queue.put(group, timeout_s=self.settings.put_timeout_s)
                break
            except QueueFull:
                if self._stopping:
                    raise
                log.warning(
                    "queue full for %.0fs; still waiting to put group %s",
                    self.settings.put_timeout_s,
                    group.group_id,
                )
        self.stats.count("groups_put" if stored else "groups_duplicate")

    # ------------------------------------------------------------------ dynamic sampling
    def _informative(self, group: TrajectoryGroup) -> bool:
        """Whether the group's samples differ in the filter's metric (always True with the filter off)."""
        ds = self.settings.rollout.dynamic_sampling
        if not ds.enable:
            return True
        values = set()
        for s in group.meta.samples:
            score = s.reward_components.get("task_score", s.reward)
            if ds.metric == "reward":
                values.add(s.reward)
            elif ds.metric == "score":
                values.add(score)
            elif ds.metric in s.reward_components:
                values.add(s.reward_components[ds.metric])
            elif s.outcome.reward_error:  # a failed reward call has no components; it scored 0
                values.add(score)
            else:
                raise KeyError(
                    f"rollout.dynamic_sampling.metric: the reward of {s.uid} has no component "
                    f"`{ds.metric}` (it has {sorted(s.reward_components) or 'none'}); use score or reward"
                )
        return len(values) > 1

    def _filtered(self, work: _Work) -> None:
        """Drop a group whose samples all scored the same: refund its unit (another group starts in its
        place) and sample its prompt again, or skip the prompt after ``max_attempts`` such groups."""
        self._in_flight.pop(work.group_id, None)
        self.gate.refund(1)
        self.stats.count("filtered_groups")
        max_attempts = self.settings.rollout.dynamic_sampling.max_attempts
        if work.resamples + 1 < max_attempts or self._stopping:
            # Stopping: the prompt stays owed, so a resumed run samples it again.
            self._todo.append(msgspec.structs.replace(work, resamples=work.resamples + 1, fresh=False))
            return
        self.stats.count("prompts_filtered_out")
        if max_attempts > 1:
            log.info(
                "prompt %d: %d groups in a row scored the same for every sample; skipped",
                work.ref.index,
                max_attempts,
            )

    def _group_failed(self, work: _Work, err: Exception) -> None:
        """Refund the group's unit and queue its prompt again; too many failures in a row end the run."""
        if isinstance(err, BaseExceptionGroup) and len(err.exceptions) == 1:
            err = err.exceptions[0]  # the TaskGroup's wrapper says nothing; its one cause does
        self._in_flight.pop(work.group_id, None)
        self.gate.refund(1)
        self.stats.count("groups_failed")
        if self._stopping:
            self._todo.appendleft(work)
            return
        work = msgspec.structs.replace(work, failures=work.failures + 1)
        log.warning(
            "group %s failed (%d/%d): %s: %s",
            work.group_id,
            work.failures,
            MAX_GROUP_FAILURES,
            type(err).__name__,
            err,
        )
        if work.failures >= MAX_GROUP_FAILURES:
            self._fatal = RuntimeError(
                f"group {work.group_id} failed {work.failures} times; last error: {err!r}"
            )
            self._fatal.__cause__ = err
        self._todo.appendleft(work)

    def _raise_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    # ------------------------------------------------------------------ dropped groups
    async def _poll_dropped(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self._collect_dropped()

    async def _collect_dropped(self) -> None:
        try:
            metas = await self.queue.pop_dropped(max_groups=1024)
        except Exception as err:  # the queue being briefly unreachable must not end generation
            log.warning("could not fetch dropped groups: %s", err)
            return
        for meta in metas:
            origin = meta.provenance
            if origin is None:
                log.warning("dropped group %s has no provenance; it was not produced here", meta.group_id)
                continue
            work = _Work(ref=PromptRef(origin.epoch, origin.prompt_index), attempt=origin.attempt + 1)
            if work.attempt == self.settings.max_stale_drops:
                log.warning(
                    "prompt %d was dropped as too stale %d times (async.max_stale_drops); its next group "
                    "is trained on whatever its staleness",
                    work.ref.index,
                    work.attempt,
                )
            if work.group_id in self._in_flight or any(w.group_id == work.group_id for w in self._todo):
                log.warning("group %s was reported dropped twice; generating it again once", meta.group_id)
                continue
            if self.gate.admitted > 0:  # 0 only when the group was admitted before a restart
                self.gate.refund(1)
            self._todo.append(work)
            self.stats.count("groups_dropped")
        if metas:
            self._changed.set()


def _require_routes(gid: str, trajectories: list[Trajectory]) -> None:
    """With routing replay on, a group none of whose trajectories carries routes fails (and, failing again
    and again, ends the run naming why) rather than being trained with the trainer's own routing unnoticed.
    A group where some carry them and some do not is refused by ``TrajectoryGroup.from_trajectories``."""
    if all(t.routed_experts is None for t in trajectories):
        raise ValueError(
            f"group {gid}: trainer.moe.routing_replay is `rollout`, but the server returned no routes for "
            f"its samples (a dense model, a server that does not return routes, or an agent loop that "
            f"drops them)"
        )


def _padded_routes(routes: Any, rows: int) -> Any:
    """An episode's routes over its ``rows`` tokens: tokens inserted after its last generate (tool output),
    which no server forward routed, get -1 (the trainer's router picks)."""
    if routes is None or len(routes) >= rows:
        return routes  # more rows than tokens: Trajectory.validate refuses it, naming both
    pad = np.full((rows - len(routes), *routes.shape[1:]), -1, dtype=np.int16)
    return np.concatenate([routes.astype(np.int16), pad])
