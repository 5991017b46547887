"""The autotune controller (``async.autotune: throughput``): every ``async.autotune_every`` steps it reads the
run's own metrics and moves ``async.staleness_threshold``, ``async.sync_every`` and
``rollout.max_concurrent_per_server`` toward fewer idle seconds, inside ``async.autotune_bounds``.

Pure logic, no I/O: the step driver (or the simulator, ``sim/autotune_eval.py``) hands it each step's
metrics as an :class:`Observation` and applies the :class:`Decision` it returns. Its whole memory is an
:class:`AutotuneState` (a msgspec Struct: it goes into the pipeline checkpoint and a resumed run goes on
from it).

The rules, in order (docs/tuning.md, "The autotune controller"). A window ends on a push step, so that it
holds whole push cycles:

1. **Hold on a missing metric.** A metric a rule needs that no part reported is never guessed: the
   decision holds and names it (``hold: missing trainer/idle_ratio``); without
   ``rollouter/requests_queued`` the concurrency is never moved.
2. **Back off** when the window trained a group over ``staleness_cap``, the setting dropped more than
   ``DROP_TOLERANCE`` of its groups over the hard cap (counted over every window since it began, from
   ``MIN_DROPS`` drops on), or the mismatch went over ``mismatch_cap``: the threshold goes one rung down the
   ladder (:data:`THRESHOLDS`), and the rung it left becomes a ceiling it does not climb to again (at the
   lowest rung, ``sync_every`` goes down by one). Windows that began within one dwell after a change
   (``quiet_until``) are not counted: the old setting's groups are still being dropped.
3. **Generation-bound** (``trainer/idle_ratio`` above ``IDLE_HIGH``): requests waiting for a server slot
   (``rollouter/requests_queued`` > 0) double the per-server concurrency; when the servers have room (no
   request waiting at most of the window's non-push steps), the gate's budget grows (``sync_every`` x2,
   then the threshold one rung), only within the target (the cap where the trainer enforces it,
   ``max_staleness <= staleness_cap``: the budget's own in-order bound, :func:`in_order_bound`, within
   it; else the window's maximum plus what the move adds in order, one version under it), and only
   once the last budget's groups have been trained (the minimum dwell, ``ceil(sync_every * (1 +
   threshold)) + 1`` steps after a change). Far from balance (``FAR``) every move that applies is made at
   once, x4 (``VERY_FAR``: the concurrency x8 and ``sync_every`` x4, threshold up to two rungs); near it,
   one.
4. Otherwise hold: the trainer does not wait, so nothing the knobs do would train faster.

Stability: a knob only goes up on rule 3 and only down on rule 2, and a back-off leaves a ceiling behind,
so on a steady workload the setting climbs, backs off at most once per rung, and stays. The ceilings are
forgotten when the workload changes (``REGIME_CHANGE``, ``FILTER_CHANGE``: the mean response length or the
filter ratio moved), and raises given up are retried when the trainer waits much more than when the
controller settled (``IDLE_JUMP``: a lost server), so a run whose responses grow is tuned again.

Worked example::

    tuner = Autotuner(bounds, every=4, start=Knobs(staleness_threshold=0.0, sync_every=1, concurrency=8))
    for step in ...:
        decision = tuner.observe(Observation.from_metrics(metrics))
        if decision is not None and decision.changed:
            apply(decision.knobs)        # the gate's threshold (the pipeline: only it), sync_every, the cap
            log.info("autotune: %s", decision.reason)
"""

from __future__ import annotations

import math
import statistics
from typing import Literal

import msgspec

from slipstream.config import AutotuneBounds

# The threshold ladder: rungs are where the admission budget changes by a useful amount.
THRESHOLDS = (0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0)
IDLE_HIGH = 0.05  # the trainer waits more than this share of its step: generation is the bottleneck
FAR = 0.3  # ... more than this: far from balance, every move that applies at once
VERY_FAR = 0.6  # ... more than this: the concurrency x8 and sync_every x4 (near balance x2, far x4 and x2)
REGIME_CHANGE = 0.25  # relative move of the mean response length that counts as a new workload
FILTER_CHANGE = 0.15  # absolute move of the filter ratio that does
IDLE_JUMP = 0.15  # trainer idle this much above its level when the controller settled: a new workload
# Share of the groups the hard cap may drop under one setting before the controller backs off, counted over
# every window since the setting began, and only from MIN_DROPS drops on (one window's one or two drops are
# noise). A rare long response dropped costs its generation once, while a lower setting costs every step.
# Drops are not free either: a dropped prompt is generated again, and one dropped async.max_stale_drops
# times is trained whatever its staleness, over the cap; the more a setting drops, the likelier that is.
DROP_TOLERANCE = 0.03
MIN_DROPS = 3

# Observation field -> the metric key it reads (the run's record; docs/tuning.md "Reading a run").
METRIC_KEYS: dict[str, str] = {
    "trainer_idle": "trainer/idle_ratio",
    "rollouter_idle": "rollouter/idle_ratio",
    "queue_depth": "queue/ready_groups",
    "requests_queued": "rollouter/requests_queued",
    "staleness_mean": "trainer/staleness_versions_mean",
    "staleness_max": "trainer/staleness_versions_max",
    "dropped_groups": "trainer/dropped_groups",
    "response_len_mean": "trainer/response_len_mean",
    "response_len_p90": "trainer/response_len_p90",
    "filter_ratio": "rollouter/filter_ratio",
    "tokens": "trainer/tokens",
    "samples": "trainer/samples",
    "elapsed_s": "perf/elapsed_s",
    "mismatch": "trainer/approx_kl_behaviour",
}
KNOB_KEYS = {"threshold": "async.staleness_threshold", "sync_every": "async.sync_every",
             "concurrency": "rollout.max_concurrent_per_server"}  # fmt: skip
# What every decision needs; the concurrency rule also needs requests_queued, the mismatch cap mismatch.
REQUIRED = ("trainer_idle", "rollouter_idle", "staleness_max", "dropped_groups", "tokens", "elapsed_s")


class Observation(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One step's measurements; None: the part that measures it did not report it."""

    trainer_idle: float | None = None
    rollouter_idle: float | None = None
    queue_depth: float | None = None
    requests_queued: float | None = None
    staleness_mean: float | None = None
    staleness_max: float | None = None
    dropped_groups: float | None = None
    response_len_mean: float | None = None
    response_len_p90: float | None = None
    filter_ratio: float | None = None
    tokens: float | None = None  # trained this step (prompt + response)
    samples: float | None = None  # trained this step
    elapsed_s: float | None = None  # since the run started, when the step's record was made
    mismatch: float | None = None

    @classmethod
    def from_metrics(cls, metrics: dict[str, float | None]) -> Observation:
        """From a step's record; a key absent or not finite is None."""
        values = {}
        for name, key in METRIC_KEYS.items():
            v = metrics.get(key)
            values[name] = float(v) if isinstance(v, int | float) and math.isfinite(v) else None
        return cls(**values)


class Knobs(msgspec.Struct, kw_only=True, frozen=True):
    staleness_threshold: float
    sync_every: int
    concurrency: int

    def describe(self) -> str:
        return (
            f"async.staleness_threshold={self.staleness_threshold:g} async.sync_every={self.sync_every} "
            f"rollout.max_concurrent_per_server={self.concurrency}"
        )


class Decision(msgspec.Struct, kw_only=True, frozen=True):
    """What one decision did: ``knobs`` (the setting from now on), ``changed`` (the keys it moved) and the
    measurement that caused it, in words."""

    step: int
    knobs: Knobs
    changed: list[str]
    action: Literal["raise", "lower", "hold"]
    reason: str

    def metrics(self) -> dict[str, float]:
        """The ``autotune/*`` keys of the step's record."""
        return {
            "autotune/staleness_threshold": self.knobs.staleness_threshold,
            "autotune/sync_every": float(self.knobs.sync_every),
            "autotune/concurrency": float(self.knobs.concurrency),
            "autotune/changed": float(bool(self.changed)),
            "autotune/held_missing": float(self.reason.startswith("hold: missing")),
        }


class Window(msgspec.Struct, kw_only=True):
    """One decision window, summarised (what a later decision compares with)."""

    trainer_idle: float = 0.0
    tokens_per_s: float = 0.0
    response_len_mean: float | None = None
    filter_ratio: float | None = None


class AutotuneState(msgspec.Struct, kw_only=True):
    """The controller's whole memory (saved in the pipeline checkpoint)."""

    knobs: Knobs
    steps: int = 0
    window: list[Observation] = []
    threshold_ceiling: float | None = None  # a rung that went over the staleness cap
    blocked: list[str] = []  # knobs a back-off lowered (sync_every): not raised until the workload changes
    reference: Window | None = None  # the workload when the controller last changed or settled
    changes: int = 0
    since_change: int = 0  # steps since a knob last moved
    # After a back-off, groups the old setting admitted are still trained (and dropped) until this step: they
    # say nothing about the new setting, so no second back-off before it.
    quiet_until: int = 0
    # Groups dropped over the cap since the setting began, and groups trained or dropped, outside the
    # quiet windows: the drop share a back-off is judged on.
    setting_dropped: float = 0.0
    setting_groups: float = 0.0


class Autotuner:
    """The controller (module docstring). ``observe`` once per trainer step; it returns a decision every
    ``every`` steps and None between."""

    def __init__(
        self,
        bounds: AutotuneBounds,
        *,
        every: int,
        start: Knobs,
        max_staleness: int | None = None,
        group_size: int = 1,
        state: AutotuneState | None = None,
    ) -> None:
        self.bounds, self.every = bounds, every
        self.cap = bounds.staleness_cap if max_staleness is None else min(bounds.staleness_cap, max_staleness)
        # The staleness it steers to: the cap itself where the trainer enforces it (async.max_staleness at the
        # cap: a group over it is dropped, never trained; prepare_config sets it so when the controller runs),
        # else one version under it, so that a window reaching the target backs off before one goes over.
        self.enforced = max_staleness is not None and max_staleness <= bounds.staleness_cap
        self.target = self.cap if self.enforced else max(self.cap - 1, 0)
        self.group_size = group_size
        self.state = state if state is not None else AutotuneState(knobs=start)

    # ------------------------------------------------------------------ the loop
    def observe(self, obs: Observation) -> Decision | None:
        st = self.state
        st.steps += 1
        st.since_change += 1
        st.window.append(obs)
        # A window ends on a push step, so that every window holds whole push cycles (comparable tokens/s).
        if len(st.window) < self.every or st.steps % st.knobs.sync_every:
            return None
        # The first record opens the window: its tokens count toward the previous one (_summary).
        window, st.window = st.window, st.window[-1:]
        decision = self._decide(window)
        if decision.changed:
            st.changes += 1
        return decision

    def _decide(self, window: list[Observation]) -> Decision:
        st = self.state
        missing = [METRIC_KEYS[f] for f in REQUIRED if any(getattr(o, f) is None for o in window)]
        if self.bounds.mismatch_cap is not None and any(o.mismatch is None for o in window):
            missing.append(METRIC_KEYS["mismatch"])
        if missing:
            return self._hold(f"hold: missing {', '.join(missing)} (not reported; the setting stays)")
        w = _summary(window, self.state.knobs)
        stale_max = max(o.staleness_max or 0.0 for o in window)
        dropped = sum(o.dropped_groups or 0.0 for o in window)
        seen = (
            f"trainer idle {w.trainer_idle:.2f}, staleness max {stale_max:g} (cap {self.cap}), "
            f"{w.tokens_per_s:.0f} tokens/s"
        )
        self._forget_if_new_workload(w)
        # 2. back off
        mismatch = max(o.mismatch or 0.0 for o in window)
        drops = self._count_drops(window)
        over = stale_max > self.cap or drops is not None
        if over and st.steps < st.quiet_until:
            return self._hold(
                f"hold: {dropped:g} groups dropped, admitted before the last back-off (trained until step "
                f"{st.quiet_until})"
            )
        if over or (self.bounds.mismatch_cap is not None and mismatch > self.bounds.mismatch_cap):
            cause = (
                f"staleness max {stale_max:g} over the cap {self.cap}"
                if stale_max > self.cap
                else drops
                if drops is not None
                else f"mismatch {mismatch:.3g} > cap {self.bounds.mismatch_cap:g}"
            )
            return self._back_off(w, cause)
        # 4. generation-bound
        if w.trainer_idle > IDLE_HIGH:
            return self._raise(window, w, stale_max, seen)
        st.reference = w
        return self._hold(f"hold: the trainer waits little ({seen})")

    def _count_drops(self, window: list[Observation]) -> str | None:
        """Adds the window's groups to the setting's count; the drops in words when they call for a back-off:
        over ``DROP_TOLERANCE`` of the setting's groups and at least ``MIN_DROPS`` of them, or any drop without
        the ``trainer/samples`` gauge (the share unknown). A window that began before ``quiet_until`` is not
        counted: its drops are the old setting's groups. Its first record belongs to the previous window."""
        st = self.state
        lost = sum(o.dropped_groups or 0.0 for o in window[1:])
        if lost and any(o.samples is None for o in window[1:]):
            return f"{lost:g} groups dropped over async.max_staleness ({METRIC_KEYS['samples']} missing)"
        if st.steps - len(window) + 1 >= st.quiet_until:
            st.setting_dropped += lost
            st.setting_groups += lost + sum(o.samples or 0.0 for o in window[1:]) / self.group_size
        share = st.setting_dropped / st.setting_groups if st.setting_dropped else 0.0
        if share <= DROP_TOLERANCE or st.setting_dropped < MIN_DROPS:
            return None
        return (
            f"{st.setting_dropped:g} of {st.setting_groups:.0f} groups ({share:.0%}) dropped over "
            f"async.max_staleness since the setting began"
        )

    def _raise(self, window: list[Observation], w: Window, stale_max: float, seen: str) -> Decision:
        """The trainer waits: more requests per server when requests wait for a slot, else a bigger gate
        budget (``sync_every`` x2, then the threshold a rung up), each only where it keeps the staleness
        within the target (:meth:`_fits`). Far from balance (``FAR``) every move that applies is made at once,
        and bigger ones (``VERY_FAR``); near it, one."""
        st, b, k = self.state, self.bounds, self.state.knobs
        far, very_far = w.trainer_idle > FAR, w.trainer_idle > VERY_FAR
        moves: dict[str, float] = {}
        why: list[str] = []
        queued_vals = [o.requests_queued for o in window]
        queued = None if None in queued_vals else statistics.fmean(q or 0.0 for q in queued_vals)
        # requests waited for a slot at most steps' ends: the servers are full, the gate is not what limits.
        # A push step's record is left out (with sync_every > 1, the window's first and last): the requests a
        # push aborted are all re-submitted at once, a burst that says nothing about the servers' room.
        mid = queued_vals[1:-1] if len(queued_vals) > 2 and k.sync_every > 1 else queued_vals
        always_queued = queued is not None and sum((q or 0.0) > 0 for q in mid) * 2 > len(mid)
        if queued is None:
            why.append(f"{METRIC_KEYS['requests_queued']} missing: concurrency held")
        elif queued > 0:
            conc = min(b.concurrency_max, k.concurrency * (8 if very_far else 4 if far else 2))
            if conc > k.concurrency and "concurrency" not in st.blocked:
                moves["concurrency"] = conc
                why.append(f"{queued:.0f} requests wait for a server slot")
            elif always_queued:
                why.append(
                    f"{queued:.0f} requests wait for a slot at the concurrency bound: the servers are full"
                )
            else:
                why.append(
                    f"{queued:.0f} requests wait for a slot at the concurrency bound, after pushes only"
                )

        def fits(threshold: float, sync_every: int) -> bool:
            return self._fits(threshold, sync_every, stale_max)

        # A bigger budget helps only when the servers have room: no request waits for a slot (or more slots
        # are being opened now); and only once the last budget's staleness has shown (a group admitted at
        # the change is trained up to ceil(sync_every * (1 + threshold)) steps later): the minimum dwell.
        gate = (
            queued is not None
            and (not always_queued or "concurrency" in moves)
            and st.since_change >= dwell(k)
        )
        if gate and (far or not moves):
            every = min(b.sync_every_max, k.sync_every * (4 if very_far else 2))
            if every > k.sync_every and "sync_every" not in st.blocked and fits(k.staleness_threshold, every):
                moves["sync_every"] = every
        if gate and (far or not moves):
            every = int(moves.get("sync_every", k.sync_every))
            ceiling = st.threshold_ceiling
            ups = [r for r in THRESHOLDS if r > k.staleness_threshold + 1e-9 and r <= b.staleness_threshold_max
                   and (ceiling is None or r < ceiling - 1e-9) and fits(r, every)][: 2 if far else 1]  # fmt: skip
            if ups and "threshold" not in st.blocked:
                moves["threshold"] = ups[-1]
        if moves:
            if "concurrency" not in moves:
                why.append("the servers have room: the gate holds groups back")
            return self._set(w, moves, "raise", f"the trainer waits ({seen}); " + "; ".join(why))
        if queued is not None and st.since_change < dwell(k):
            room = f"the last change's groups are still trained (until step {st.steps - st.since_change + dwell(k)})"
        elif always_queued:
            room = "requests wait for a server slot at most steps' ends"
        elif (up := _rung_above(k.staleness_threshold)) is None or fits(up, k.sync_every):
            room = "every knob at its bound or ceiling"
        else:
            room = "no room under the staleness cap"
        return self._hold(f"hold: the trainer waits but {room} ({seen}); " + "; ".join(why))

    def _fits(self, threshold: float, sync_every: int, stale_max: float) -> bool:
        """Whether a gate budget keeps the staleness within the target. Where the trainer enforces the cap,
        the budget's own in-order bound must be within it: the window's maximum already reaches the cap by
        the long tail's out-of-order groups, which the trainer drops and the drop count judges (rule 2).
        Else the window's maximum plus what the move adds in order must stay within the target."""
        bound = in_order_bound(threshold, sync_every)
        if self.enforced:
            return bound <= self.target
        k = self.state.knobs
        return stale_max + max(0, bound - in_order_bound(k.staleness_threshold, k.sync_every)) <= self.target

    def _back_off(self, w: Window, cause: str) -> Decision:
        st, k = self.state, self.state.knobs
        st.quiet_until = st.steps + dwell(k)
        down = _rung_below(k.staleness_threshold)
        if down is not None:
            st.threshold_ceiling = k.staleness_threshold
            return self._set(w, {"threshold": down}, "lower", cause)
        if k.sync_every > self.bounds.sync_every_min:
            st.blocked.append("sync_every")
            return self._set(w, {"sync_every": k.sync_every - 1}, "lower", cause)
        return self._hold(f"hold: {cause}, but every knob is at its lowest")

    # ------------------------------------------------------------------ helpers
    def _set(self, w: Window, moves: dict[str, float], action: str, reason: str) -> Decision:
        st, k = self.state, self.state.knobs
        old = {"threshold": k.staleness_threshold, "sync_every": k.sync_every, "concurrency": k.concurrency}
        st.reference, st.since_change = w, 0
        st.setting_dropped = st.setting_groups = 0.0
        new = {**old, **moves}
        st.knobs = Knobs(
            staleness_threshold=float(new["threshold"]),
            sync_every=int(new["sync_every"]),
            concurrency=int(new["concurrency"]),
        )
        keys = [KNOB_KEYS[m] for m in moves]
        said = ", ".join(f"{KNOB_KEYS[m]} {old[m]:g} -> {v:g}" for m, v in moves.items())
        return Decision(step=st.steps, knobs=st.knobs, changed=keys, action=action,  # type: ignore[arg-type]
                        reason=f"{action} {said}: {reason}")  # fmt: skip

    def _hold(self, reason: str) -> Decision:
        st = self.state
        return Decision(step=st.steps, knobs=st.knobs, changed=[], action="hold", reason=reason)

    def _forget_if_new_workload(self, w: Window) -> None:
        st = self.state
        ref = st.reference
        if ref is None:
            return
        new = (
            _moved(ref.response_len_mean, w.response_len_mean, REGIME_CHANGE)
            or (ref.filter_ratio is not None and w.filter_ratio is not None
                and abs(w.filter_ratio - ref.filter_ratio) > FILTER_CHANGE)
        )  # fmt: skip
        if new:  # longer responses, another filter ratio: the ceilings found for the old workload go
            st.blocked, st.threshold_ceiling, st.reference = [], None, w
        elif w.trainer_idle > ref.trainer_idle + IDLE_JUMP:  # e.g. a server lost: blocked raises retried
            st.blocked, st.reference = [], w


def _summary(window: list[Observation], knobs: Knobs) -> Window:
    """Means over the window; tokens/s over its whole time (the first step's record opens it), pushes in."""

    def mean(name: str) -> float | None:
        vals = [getattr(o, name) for o in window if getattr(o, name) is not None]
        return statistics.fmean(vals) if vals else None

    span = (window[-1].elapsed_s or 0.0) - (window[0].elapsed_s or 0.0)
    tokens = sum(o.tokens or 0.0 for o in window[1:])
    return Window(
        trainer_idle=mean("trainer_idle") or 0.0,
        tokens_per_s=tokens / span if span > 0 else 0.0,
        response_len_mean=mean("response_len_mean"),
        filter_ratio=mean("filter_ratio"),
    )


def dwell(k: Knobs) -> int:
    """Steps until the groups admitted under ``k`` have been trained: ``ceil(sync_every * (1 + threshold)) + 1``
    (a group admitted at a change is trained up to that many steps later)."""
    return math.ceil(k.sync_every * (1 + k.staleness_threshold) - 1e-9) + 1


def in_order_bound(threshold: float, sync_every: int) -> int:
    """Versions a group is at most behind if groups finished in admission order (docs/tuning.md, "The
    admission budget"): ``(ceil(sync_every * (1 + threshold)) - 1) // sync_every``."""
    return (math.ceil(sync_every * (1 + threshold) - 1e-9) - 1) // sync_every


def _moved(a: float | None, b: float | None, rel: float) -> bool:
    return a is not None and b is not None and a > 0 and abs(b - a) / a > rel


def _rung_above(x: float) -> float | None:
    return next((r for r in THRESHOLDS if r > x + 1e-9), None)


def _rung_below(x: float) -> float | None:
    below = [r for r in THRESHOLDS if r < x - 1e-9]
    return below[-1] if below else None


__all__ = ["AutotuneState", "Autotuner", "Decision", "Knobs", "Observation", "Window"]
