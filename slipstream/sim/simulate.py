"""`slipstream simulate CONFIG [key=value ...] --profile P [--steps N] [--json]`: a run in virtual time.
(`slipstream simulate --autotune-eval [--json]`: the autotune controller against static settings,
``sim/autotune_eval.py``; ``sim/command.py`` sends the command to one or the other.)

A discrete-event model of the pipeline (design.md §1) that runs the same config through the same rules as
the real parts, at any scale, in seconds. What is the product's own code, driven with a virtual clock:

* the mode presets (:func:`slipstream.pipeline.modes.prepare_config`);
* the staleness gate (:class:`slipstream.rollouter.gate.StalenessGate`: ``try_admit``, ``refund``,
  ``close`` before a drain, ``set_version`` after a push);
* the hard cap (:meth:`slipstream.config.AsyncConfig.staleness` against ``max_staleness``, ``stale_policy``,
  and the ``keep_stale`` mark after ``max_stale_drops`` drops, as the trainer and rollouter apply them);
* the balancer (:class:`~slipstream.rollouter.balancer.LoadBalancer` over stand-in servers: its ``_pick``
  chooses the server of every request, at most ``rollout.max_concurrent_per_server`` on each);

What is modelled, with the profile's rates (slipstream/sim/profile.py):

* servers: ``rollout.num_servers``; a request prefills its prompt, then decodes at ``decode(k) / k``
  tokens/s while ``k`` requests decode on its server (processor sharing);
* the rollouter: a group of ``rollout.n`` requests starts when the gate admits it and is put into the queue
  when its last sample ends; dropped groups are generated again first;
* the trainer: leases ``trainer.batch_groups`` whole groups in put order (stale ones are dropped as the
  trainer does), trains ``fixed_s + tokens / (tokens_per_s_per_rank * num_ranks)``; every ``sync_every``
  steps a push: with ``partial_rollout: off`` (and ``sync``) the gate closes and in-flight groups finish
  first; during the push every server pauses; ``abort`` ends the decoding requests, which resume after
  the push by prefilling prompt + partial response again (their first tokens keep the old version);
  ``in_place`` continues them; then the controller's per-step overhead.

Dynamic sampling (``rollout.dynamic_sampling.enable``): each finished group is, with the profile's
``filtered_fraction``, one whose samples all scored the same; it is generated in full and then not put (no
training), its gate unit is refunded so another group starts, and its prompt is sampled again up to
``max_attempts`` times, as the rollouter does. Each group is drawn independently (a prompt's difficulty
does not carry over to its re-sample).

Changes during a run (what the autotune controller and its evaluation do, ``pipeline/autotune.py``,
``sim/autotune_eval.py``): ``on_step`` is called after each step's bookkeeping with the step's metrics
under the run's own keys (:meth:`Simulation.step_metrics`); from it :meth:`Simulation.set_knobs` changes
``staleness_threshold``, ``sync_every`` (the gate's and the hard cap's) and ``max_concurrent_per_server``
(the balancer's) as the pipeline does, and :meth:`Simulation.lose_server` / :meth:`Simulation.restore_server`
take a server out of the balancer and bring it back (its requests move to the others and prefill again).

Not modelled: failures and restarts (but for a server lost on request), queue capacity (the gate bounds the queue in practice), multi-turn
tools, the dropped-group poll interval (1 s), prefill contention (a prefill is a delay
that does not slow other requests).

Output (``--json``): steps/s, samples/s, tokens/s, trainer and rollouter idle ratios (defined as the run's
metrics define them), the staleness of trained groups (in weight versions), dropped groups, and
``time_to_steps_s``, the virtual seconds to the end of the steps asked for.

Worked example::

    cfg = sim_config("configs/quickstart.yaml", ["async.mode=sync"])
    res = simulate(cfg, load_profile("quickstart.profile.yaml"), steps=10)
    res.step_s_mean, res.trainer_idle_ratio
"""

from __future__ import annotations

import heapq
import json
import math
import random
import statistics
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec

from slipstream.cli_args import (
    JSON_OBJECT,
    add_config_positionals,
    add_json_flag,
    add_seed_flag,
    command_parser,
    doc_paragraph,
)
from slipstream.config import Config, ConfigError, load_config, rollouter_settings
from slipstream.pipeline.modes import prepare_config
from slipstream.rollouter.balancer import LoadBalancer
from slipstream.rollouter.gate import StalenessGate
from slipstream.sim.types import Profile, ProfileError, load_profile, scale_to_model

_EPS = 1e-9


def sim_config(path: str, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config a run of ``path`` with ``overrides`` would use (the mode's preset applied)."""
    return prepare_config(load_config(path, list(overrides)))[0]


class _SimServerClient:
    """What the balancer needs of a server client to choose among servers: its URL."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url


def sim_balancer(num_servers: int, cap: int) -> tuple[LoadBalancer, dict[str, int]]:
    """The real balancer over ``num_servers`` stand-in servers, and each one's index by URL. The simulator
    asks it where a request goes (``_pick``) and counts outstanding requests the way ``_acquire`` and
    ``_release`` do, without the HTTP around them."""
    urls = [f"sim://server{i}" for i in range(num_servers)]
    lb = LoadBalancer([_SimServerClient(u) for u in urls], max_concurrent_per_server=cap)  # type: ignore[misc]
    return lb, {u: i for i, u in enumerate(urls)}


@dataclass
class _Group:
    gid: int
    prompt: int
    attempt: int
    keep_stale: bool
    pending: int
    lengths: list[int] = field(default_factory=list)
    resamples: int = 0  # groups of this prompt dynamic sampling filtered before this one
    min_version: int | None = None
    tokens: int = 0


@dataclass
class _Req:
    group: _Group
    length: int  # response tokens it will generate
    done: float = 0.0  # generated so far (set at aborts)
    server: int = -1
    thr: float = 0.0  # processor-sharing threshold on its server
    version: int | None = None  # version of its first token
    key: int = 0  # a run-unique number: orders equal thresholds the same way in every run (id() does not)
    epoch: int = 0  # its server's epoch when it was sent there (a lost server's requests move on)


@dataclass
class _Server:
    v0: float = 0.0  # tokens each decoding request has received since time t0 ... at t0
    t0: float = 0.0
    rate: float = 0.0  # tokens/s of each decoding request
    decoding: dict[int, _Req] = field(default_factory=dict)
    heap: list[tuple[float, int]] = field(default_factory=list)
    slots: int = 0  # requests held: prefilling, decoding, paused
    parked: list[_Req] = field(default_factory=list)  # prefilled during a pause
    aborted: list[_Req] = field(default_factory=list)
    stamp: int = 0
    epoch: int = 0  # +1 each time the server is lost
    down: bool = False

    def v(self, t: float) -> float:
        return self.v0 + self.rate * (t - self.t0)


@dataclass
class SimResult:
    mode: str
    steps: int
    seconds: float
    steps_per_s: float
    samples_per_s: float
    tokens_per_s: float
    step_s_mean: float
    step_s_steady: float  # mean over the second half of the steps
    samples_per_step: int
    trainer_idle_ratio: float  # mean over steps of lease wait / step window (trainer/idle_ratio)
    rollouter_idle_ratio: float  # mean over steps of the share with no request in flight
    # trained groups, in weight versions (pushes since the oldest token), the unit max_staleness bounds
    staleness_versions_mean: float
    staleness_versions_max: int
    staleness_versions_hist: dict[str, int]
    dropped_groups: int
    filtered_groups: int  # generated, then dropped by dynamic sampling (all samples scored the same)
    stale_kept_groups: int
    resumed_requests: int
    generated_tokens: int
    step_s: list[float] = field(default_factory=list)
    trainer_idle: list[float] = field(default_factory=list)  # per step
    rollouter_idle: list[float] = field(default_factory=list)
    step_log: list[dict[str, float]] = field(default_factory=list)  # per step: Simulation.step_metrics()

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("step_s", "trainer_idle", "rollouter_idle", "step_log"):
            out.pop(key)
        out["time_to_steps_s"] = out.pop("seconds")  # from the start to the end of the last step
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


class Simulation:
    """One simulated run (module docstring). Lifecycle: construct, ``run()`` once."""

    def __init__(self, cfg: Config, profile: Profile, *, steps: int | None = None, seed: int = 0) -> None:
        self.cfg, self.prof = cfg, profile
        self.acfg = cfg.async_
        self.mode = cfg.async_.mode
        self.steps = steps or cfg.run.total_steps or 20
        self.batch = cfg.trainer.batch_groups
        self.n = cfg.rollout.n
        self.cap = cfg.rollout.max_concurrent_per_server
        self.max_len = cfg.rollout.sampling.max_new_tokens
        self.ranks = cfg.trainer.num_ranks
        self.gate = StalenessGate.from_settings(rollouter_settings(cfg))
        self.rng = random.Random(seed)
        num_servers = len(cfg.rollout.server_urls) or cfg.rollout.num_servers
        self.servers = [_Server() for _ in range(num_servers)]
        self.lb, self.server_index = sim_balancer(num_servers, self.cap)
        self.urls = list(self.server_index)
        self.waiting: deque[_Req] = deque()  # requests no server has room for
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.t = 0.0
        self.todo: deque[tuple[int, int, int]] = deque()  # (prompt, attempt, resamples) owed first
        self.next_prompt = 0
        self.next_gid = 0
        self.next_req = 0
        self.in_flight = 0  # groups
        self.live_reqs = 0
        self.queue: deque[_Group] = deque()
        self.version = 0  # trainer steps done
        self.published = 0
        self.paused = False
        self.state = "wait"  # wait | train | drain | push | overhead
        self.batch_groups: list[_Group] = []
        self.wait_since = 0.0
        self.lease_wait = 0.0
        self.step_start = 0.0
        self.busy = 0.0
        self.busy_mark = 0.0
        self.busy_at_step = 0.0
        self.step_walls: list[float] = []
        self.idle_ratios: list[float] = []
        self._wait_mark = 0.0
        self._last_trained = 0.0
        self.steps_done = 0
        self.rollouter_idle: list[float] = []
        self.staleness: list[int] = []  # versions behind, per trained group
        self.dropped = 0
        self.kept_stale = 0
        self.resumed = 0
        self.generated = 0
        self.trained_tokens = 0
        self.push_s = profile.push.seconds
        ds = cfg.rollout.dynamic_sampling
        self.filter_on, self.max_attempts = bool(ds.enable), int(ds.max_attempts)
        self.filter_rng = random.Random(seed + 7919)  # its own stream: the lengths drawn stay the same
        self.filtered = 0
        self._decode = profile.decode.rate
        # per step, for step_metrics() and on_step
        self.on_step: Callable[[Simulation, dict[str, float]], None] | None = None
        self.step_log: list[dict[str, float]] = []
        self._step_stale: list[int] = []
        self._step_lengths: list[int] = []
        self._step_tokens = 0
        self._step_dropped = 0
        self._step_groups = 0
        self._step_filtered = 0

    # ------------------------------------------------------------------ driver
    def run(self) -> SimResult:
        self._admit()
        while self.steps_done < self.steps:
            if not self.events:
                raise RuntimeError(
                    f"simulation stalled at step {self.version}: nothing in flight and the trainer waits "
                    f"({len(self.queue)} groups queued, gate admitted {self.gate.admitted} of {self.gate.budget})"
                )
            t, _, kind, data = heapq.heappop(self.events)
            self._advance(t)
            getattr(self, f"_on_{kind}")(data)
        return self._result()

    def _at(self, t: float, kind: str, data: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, data))

    def _advance(self, t: float) -> None:
        if self.live_reqs > 0:
            self.busy += t - self.t
        self.t = t

    # ------------------------------------------------------------------ rollouter
    def _admit(self) -> None:
        while True:
            if self.todo:
                prompt, attempt, resamples = self.todo[0]
            else:
                prompt, attempt, resamples = self.next_prompt, 0, 0
            if not self.gate.try_admit():
                return
            if self.todo:
                self.todo.popleft()
            else:
                self.next_prompt += 1
            self._start_group(prompt, attempt, resamples)

    def _start_group(self, prompt: int, attempt: int, resamples: int = 0) -> None:
        keep = self.acfg.stale_policy == "drop" and attempt >= self.acfg.max_stale_drops
        group = _Group(self.next_gid, prompt, attempt, keep, pending=self.n, resamples=resamples)
        self.next_gid += 1
        self.in_flight += 1
        for _ in range(self.n):
            self.live_reqs += 1
            self.next_req += 1
            self._submit(_Req(group, self._draw_length(), key=self.next_req))

    def _draw_length(self) -> int:
        lens = self.prof.lengths
        scale = max(0.0, 1.0 + lens.drift_per_step * self.version)
        if lens.samples:
            raw = self.rng.choice(lens.samples) * scale
        else:
            sigma = lens.sigma
            mu = math.log(lens.mean * scale) - sigma * sigma / 2
            raw = self.rng.lognormvariate(mu, sigma)
        return int(min(self.max_len, max(1, round(raw))))

    def _submit(self, req: _Req) -> None:
        url = self.lb._pick(None, set())
        if url is None:
            self.waiting.append(req)  # the balancer's _acquire waits for a release
            return
        self.lb._outstanding[url] += 1
        idx = self.server_index[url]
        self.servers[idx].slots += 1
        req.server, req.epoch = idx, self.servers[idx].epoch
        prefill = (self.prof.prompt_tokens + req.done) / self.prof.prefill_tokens_per_s
        self._at(self.t + prefill, "prefilled", req)

    def _on_prefilled(self, req: _Req) -> None:
        server = self.servers[req.server]
        if req.epoch != server.epoch:  # its server was lost while it prefilled
            self._move(req)
            return
        if self.paused:
            server.parked.append(req)
            return
        self._decode_start(server, req)
        self._reschedule(req.server)

    def _decode_start(self, server: _Server, req: _Req) -> None:
        if req.version is None:
            req.version = self.published
        server.v0, server.t0 = server.v(self.t), self.t
        req.thr = server.v0 + (req.length - req.done)
        server.decoding[req.key] = req
        heapq.heappush(server.heap, (req.thr, req.key))

    def _reschedule(self, idx: int) -> None:
        server = self.servers[idx]
        server.v0, server.t0 = server.v(self.t), self.t
        k = len(server.decoding)
        server.rate = 0.0 if self.paused or k == 0 else self._decode(k) / k
        server.stamp += 1
        if server.rate > 0:
            when = self.t + max(0.0, server.heap[0][0] - server.v0) / server.rate
            self._at(when, "complete", (idx, server.stamp))

    def _on_complete(self, data: tuple[int, int]) -> None:
        idx, stamp = data
        server = self.servers[idx]
        if stamp != server.stamp:
            return  # superseded by a later change of this server's rate
        v = server.v(self.t)
        finished = []
        while server.heap and server.heap[0][0] <= v + _EPS * max(1.0, v):
            _, key = heapq.heappop(server.heap)
            finished.append(server.decoding.pop(key))
        self._reschedule(idx)
        for req in finished:
            self._finish(req)

    def _finish(self, req: _Req) -> None:
        server = self.servers[req.server]
        server.slots -= 1
        self.lb._release(self.urls[req.server])
        self.live_reqs -= 1
        self.generated += req.length
        group = req.group
        group.pending -= 1
        group.tokens += req.length + int(self.prof.prompt_tokens)
        group.lengths.append(req.length)
        group.min_version = req.version if group.min_version is None else min(group.min_version, req.version)
        if self.waiting:
            self._submit(self.waiting.popleft())
        if group.pending == 0:
            self.in_flight -= 1
            self._step_groups += 1
            if self._filtered_out(group):
                if self.state == "drain" and self.in_flight == 0:
                    self._push()
                return
            self.queue.append(group)
            if group.keep_stale:
                self.kept_stale += 1
            if self.state == "wait":
                self._lease()
            elif self.state == "drain" and self.in_flight == 0:
                self._push()

    def _filtered_out(self, group: _Group) -> bool:
        """Dynamic sampling: drop a group whose samples all scored the same (a draw with the profile's
        ``filtered_fraction``), refund its unit, sample its prompt again up to ``max_attempts`` times."""
        if not self.filter_on or self.filter_rng.random() >= self.prof.filtered_fraction:
            return False
        self.filtered += 1
        self._step_filtered += 1
        self.gate.refund(1)
        if group.resamples + 1 < self.max_attempts:
            self.todo.append((group.prompt, group.attempt, group.resamples + 1))
        self._admit()
        return True

    # ------------------------------------------------------------------ trainer
    def _lease(self) -> None:
        """Take groups in put order until a batch is held, dropping the stale ones as the trainer does."""
        refunded = False
        while self.queue and len(self.batch_groups) < self.batch:
            group = self.queue.popleft()
            too_stale = (
                self.acfg.stale_policy == "drop"
                and self.acfg.staleness(self.version, group.min_version) > self.acfg.max_staleness
                and not group.keep_stale
            )
            if too_stale:
                self.dropped += 1
                self._step_dropped += 1
                self.gate.refund(1)
                self.todo.append((group.prompt, group.attempt + 1, 0))
                refunded = True
                continue
            self.batch_groups.append(group)
        if refunded:
            self._admit()
        if len(self.batch_groups) < self.batch:
            return
        self.lease_wait += self.t - self.wait_since
        tokens = sum(g.tokens for g in self.batch_groups)
        for g in self.batch_groups:
            self.staleness.append(self.acfg.staleness(self.version, g.min_version))
            self._step_stale.append(self.staleness[-1])
            self._step_lengths += g.lengths
        self.trained_tokens += tokens
        self._step_tokens = tokens
        self.batch_groups = []
        self.state = "train"
        rate = self.prof.trainer.tokens_per_s_per_rank * self.ranks
        self._at(self.t + self.prof.trainer.fixed_s + tokens / rate, "trained")

    def _on_trained(self, _: Any) -> None:
        # What the controller measures when a step returns: its window runs from the end of the previous
        # step's push and bookkeeping to now (trainer/idle_ratio = lease wait / window); the step time is
        # the time between two such moments.
        window = max(self.t - self.step_start, _EPS)
        self.idle_ratios.append(min(1.0, (self.lease_wait - self._wait_mark) / window))
        self._wait_mark = self.lease_wait
        self.step_walls.append(self.t - self._last_trained)
        self._last_trained = self.t
        self.version += 1
        if self.version % self.acfg.sync_every:
            self._overhead()
        elif self.acfg.partial_rollout == "off":
            self.gate.close()
            self.state = "drain"
            if self.in_flight == 0:
                self._push()
        else:
            self._push()

    def _push(self) -> None:
        self.state = "push"
        self.paused = True
        for idx, server in enumerate(self.servers):
            v = server.v(self.t)
            if self.acfg.partial_rollout == "abort":
                for req in server.decoding.values():
                    req.done = req.length - max(0.0, req.thr - v)
                    server.aborted.append(req)
                server.decoding.clear()
                server.heap.clear()
            self._reschedule(idx)
        self._at(self.t + self.push_s, "pushed")

    def _on_pushed(self, _: Any) -> None:
        self.paused = False
        self.published = self.version
        for idx, server in enumerate(self.servers):
            for req in server.parked:
                self._decode_start(server, req)
            server.parked.clear()
            for req in server.aborted:  # resubmitted: prompt + partial prefilled again
                self.resumed += 1
                prefill = (self.prof.prompt_tokens + req.done) / self.prof.prefill_tokens_per_s
                self._at(self.t + prefill, "prefilled", req)
            server.aborted.clear()
            self._reschedule(idx)
        self.gate.set_version(self.version)
        self._admit()
        self._overhead()

    def _overhead(self) -> None:
        self.state = "overhead"
        self._at(self.t + self.prof.step_overhead_s, "step_end")

    def _on_step_end(self, _: Any) -> None:
        # the rollouter's window runs from one step's bookkeeping to the next (RolloutStats.collect)
        wall = max(self.t - self.step_start, _EPS)
        self.rollouter_idle.append(min(1.0, max(0.0, 1.0 - (self.busy - self.busy_at_step) / wall)))
        self.busy_at_step = self.busy
        self.step_start = self.t
        self.steps_done += 1
        self.state = "wait"
        self.wait_since = self.t
        metrics = self.step_metrics()
        self.step_log.append(metrics)
        if self.on_step is not None and self.steps_done < self.steps:
            self.on_step(self, metrics)
        self._lease()

    def step_metrics(self) -> dict[str, float]:
        """The step just ended, under the keys the run's record uses (docs/tuning.md); starts the next."""
        lengths = sorted(self._step_lengths)
        wall = self.step_walls[-1] if self.step_walls else 0.0
        stale_mean = statistics.fmean(self._step_stale) if self._step_stale else 0.0
        out = {
            "step": float(self.steps_done),
            "trainer/idle_ratio": self.idle_ratios[-1],
            "rollouter/idle_ratio": self.rollouter_idle[-1],
            "trainer/staleness_versions_mean": stale_mean,
            "trainer/staleness_versions_max": float(max(self._step_stale, default=0)),
            "trainer/dropped_groups": float(self._step_dropped),
            "queue/ready_groups": float(len(self.queue)),
            "rollouter/requests_queued": float(len(self.waiting)),
            "trainer/response_len_mean": statistics.fmean(lengths) if lengths else 0.0,
            "trainer/response_len_p90": float(lengths[int(0.9 * (len(lengths) - 1))]) if lengths else 0.0,
            "perf/step_wall_s": wall,
            "trainer/tokens": float(self._step_tokens),
            "trainer/samples": float(len(lengths)),
            "perf/trained_tokens_per_s": self._step_tokens / wall if wall > 0 else 0.0,
            "perf/elapsed_s": self.t,
        }
        if self.filter_on and self._step_groups:
            out["rollouter/filter_ratio"] = self._step_filtered / self._step_groups
        self._step_stale, self._step_lengths = [], []
        self._step_dropped = self._step_groups = self._step_filtered = 0
        return out

    # ------------------------------------------------------------------ changes during a run
    def set_knobs(
        self,
        *,
        staleness_threshold: float | None = None,
        sync_every: int | None = None,
        concurrency: int | None = None,
    ) -> None:
        """Change the knobs as the pipeline does between steps: the gate's budget (and the hard cap's unit
        for ``sync_every``) and the balancer's per-server cap; newly allowed groups and requests start now."""
        if staleness_threshold is not None:
            self.gate.staleness_threshold = staleness_threshold
        if sync_every is not None and sync_every != self.acfg.sync_every:
            self.gate.sync_every = sync_every
            self.acfg = msgspec.structs.replace(self.acfg, sync_every=sync_every)
        if concurrency is not None:
            self.cap = self.lb.max_concurrent_per_server = concurrency
            while self.waiting and self.lb._pick(None, set()) is not None:
                self._submit(self.waiting.popleft())
        self._admit()

    def lose_server(self, idx: int) -> None:
        """Server ``idx`` dies: the balancer marks it dead and its requests start again on the others,
        prompt + what they had generated prefilled again (as a resumed request)."""
        server = self.servers[idx]
        self.lb.mark_dead(self.urls[idx])
        server.down, server.epoch = True, server.epoch + 1
        v = server.v(self.t)
        moved = list(server.parked) + list(server.aborted)
        for req in server.decoding.values():
            req.done = req.length - max(0.0, req.thr - v)
            moved.append(req)
        server.decoding.clear()
        server.heap.clear()
        server.parked.clear()
        server.aborted.clear()
        self._reschedule(idx)
        for req in moved:
            self._move(req)

    def restore_server(self, idx: int) -> None:
        """Server ``idx`` is back (the balancer's ``add``); waiting requests go to it."""
        self.servers[idx].down = False
        self.lb.add(_SimServerClient(self.urls[idx]))
        while self.waiting and self.lb._pick(None, set()) is not None:
            self._submit(self.waiting.popleft())

    def _move(self, req: _Req) -> None:
        self.servers[req.server].slots -= 1
        self.lb._release(self.urls[req.server])
        self.resumed += 1
        self._submit(req)

    # ------------------------------------------------------------------ result
    def _result(self) -> SimResult:
        secs = max(self.t, _EPS)
        steps = len(self.step_walls)
        half = self.step_walls[steps // 2 :] or self.step_walls
        hist: dict[str, int] = {}
        for s in self.staleness:
            hist[str(s)] = hist.get(str(s), 0) + 1
        return SimResult(
            mode=self.mode,
            steps=steps,
            seconds=secs,
            steps_per_s=steps / secs,
            samples_per_s=steps * self.batch * self.n / secs,
            tokens_per_s=self.trained_tokens / secs,
            step_s_mean=statistics.fmean(self.step_walls),
            step_s_steady=statistics.fmean(half),
            samples_per_step=self.batch * self.n,
            trainer_idle_ratio=statistics.fmean(self.idle_ratios),
            rollouter_idle_ratio=statistics.fmean(self.rollouter_idle),
            staleness_versions_mean=statistics.fmean(self.staleness) if self.staleness else 0.0,
            staleness_versions_max=max(self.staleness, default=0),
            staleness_versions_hist=dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
            dropped_groups=self.dropped,
            filtered_groups=self.filtered,
            stale_kept_groups=self.kept_stale,
            resumed_requests=self.resumed,
            generated_tokens=self.generated,
            step_s=list(self.step_walls),
            trainer_idle=list(self.idle_ratios),
            rollouter_idle=list(self.rollouter_idle),
            step_log=list(self.step_log),
        )


def simulate(cfg: Config, profile: Profile, *, steps: int | None = None, seed: int = 0) -> SimResult:
    """Simulate ``cfg`` (prepared: see :func:`sim_config`) for ``steps`` trainer steps."""
    return Simulation(cfg, profile, steps=steps, seed=seed).run()


def main(argv: list[str]) -> int:
    p = command_parser("slipstream simulate", doc_paragraph(__doc__))
    add_config_positionals(p)
    # Hand-written: the config comes as CONFIG key=value; the profile and step count are the simulation's own.
    p.add_argument("--profile", required=True, help="profile YAML (slipstream profile RUN_DIR -o ...)")
    p.add_argument("--steps", type=int, help="trainer steps (default: run.total_steps, else 20)")
    p.add_argument(
        "--scale-to-model",
        action="store_true",
        help="carry the profile's rates over to the config's model.path (its config.json or a known shape, as "
        "`plan memory` reads it): per-token rates by active parameters (an MoE's routed share), push bytes "
        "by total parameters; the profile must name its model (model: {params, active_params})",
    )
    add_seed_flag(p)
    add_json_flag(p, JSON_OBJECT)
    args = p.parse_args(argv)
    try:
        cfg = sim_config(args.config, args.overrides)
        prof = load_profile(args.profile)
        if args.scale_to_model:
            from slipstream.planning.memory import model_shape

            shape = model_shape(cfg.model.path)
            prof = scale_to_model(prof, shape.params, shape.active_params if shape.experts else 0)
    except (ConfigError, ProfileError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    res = simulate(cfg, prof, steps=args.steps, seed=args.seed)
    summary = res.summary()
    if args.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            print(f"{key:>22}: {value}")
    return 0
