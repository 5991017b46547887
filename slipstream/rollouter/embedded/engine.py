"""The embedded inference engine: transformers' continuous batching, made fit for RL.

transformers' ``ContinuousBatchingManager`` runs the model in a background thread and streams tokens with
their log-probabilities. RL needs four more things, which this module adds around it:

* **per-token weight versions**: every generated token is stamped with the version of the weights that
  produced it, also when an update lands in the middle of a request;
* **abort that keeps partial output**: transformers' ``cancel_request`` drops a request silently, so the
  engine streams every request internally and answers an abort with the tokens received so far;
* **pause modes** as SGLang has them: ``abort`` (in-flight requests end with their partial output) and
  ``in_place`` (they freeze, keep their KV cache and continue after the pause); in both, new requests
  wait at a gate until ``resume``;
* **atomic weight updates** (:class:`slipstream.weightsync.types.WeightTarget`): everything is validated
  first, then copied in while the generation loop is parked in ``manager.pause()``;
* **health that means progress**: :meth:`EmbeddedEngine.health_problem` also reports a stall (requests in
  flight, not paused in place, and no token for ``stall_timeout_s``), so ``/health`` fails and the
  pipeline restarts a wedged server instead of trusting a thread that is merely alive. transformers'
  scheduler is swapped for one that lifts its "cache full" admission block when requests are cancelled
  (scheduler.py), which is the wedge this watchdog first caught.

How version stamps stay exact: the generation loop delivers a step's tokens to the event loop (with
``call_soon_threadsafe``) before it checks for a pause request, and the weight update schedules its
"version changed" callback on the same event loop while the generation loop is parked. Callbacks run in
FIFO order, so every token delivered before the marker came from the old weights and every token after it
from the new ones. Asynchronous double-buffered batching would break this order, so it is turned off.

Prefix caching is off: after an update, cached blocks would hold keys and values computed with the old
weights and a new request sharing the prefix would silently reuse them. (In ``in_place`` mode running
requests do keep their old KV cache, as in SGLang; that is what the mode means.)

Lifecycle::

    engine = EmbeddedEngine(model_path, EmbeddedServerConfig())   # loads the model (blocking)
    await engine.start()                                          # inside the serving event loop
    state = await engine.submit([1, 2, 3], SamplingParams(max_new_tokens=8), rid="a")
    await engine.wait(state)        # state.output_ids, state.logprobs, state.versions, state.finish
    engine.apply_weights(named_tensors, version=1)                 # from any thread
    engine.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from slipstream.agents.protocol import SamplingParams
from slipstream.rollouter.config import EmbeddedServerConfig
from slipstream.rollouter.embedded import attention, routes, scheduler
from slipstream.rollouter.embedded.sampling import (
    PLACEHOLDER_TEMPERATURE,
    PLACEHOLDER_TOP_K,
    PLACEHOLDER_TOP_P,
    FilterUse,
    filters_used,
    install_fast_warpers,
    request_sampling_kwargs,
)
from slipstream.utils.logging import get_logger
from slipstream.utils.moe import is_moe
from slipstream.utils.tensors import parse_dtype

log = get_logger(__name__)

PauseMode = Literal["abort", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "in_place")
# How long to wait for the generation loop to park or to stop before calling it broken.
_PAUSE_TIMEOUT_S = 120.0


class RequestError(ValueError):
    """A request the engine cannot run; the message names the offending field (HTTP 400)."""


class EngineUnavailable(RuntimeError):
    """The generation loop is not running (stopped or crashed) (HTTP 503)."""


@dataclass
class Finish:
    """Why a request ended, in SGLang's shapes: ``stop`` (+ matched token), ``length`` or ``abort``."""

    type: Literal["stop", "length", "abort"]
    matched: int | None = None
    length: int | None = None
    message: str | None = None

    def to_json(self) -> dict:
        out: dict = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        elif self.type == "length":
            out["length"] = self.length
        else:
            out["message"] = self.message or "aborted"
        return out


@dataclass
class RequestState:
    """One request as the event loop sees it; the lists only grow, ``finish`` is set once."""

    rid: str
    cb_id: str
    input_ids: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: Finish | None = None
    # MoE models: the experts each layer routed the tokens to, set when it finishes (embedded/routes.py)
    routed_experts: torch.Tensor | None = None
    # True once handed to the generation loop (False while held at the pause gate).
    submitted: bool = False
    # Whether it counts in the engine's FilterUse as (top-k, top-p) while submitted.
    filters: tuple[bool, bool] = (False, False)
    created: float = field(default_factory=time.perf_counter)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def done(self) -> bool:
        return self.finish is not None

    def version_spans(self) -> list[dict]:
        """SGLang's ``weight_versions``: runs of equal version over output indexes, ``end`` exclusive."""
        spans: list[dict] = []
        for i, v in enumerate(self.versions):
            if spans and spans[-1]["version"] == v:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": v, "start": i, "end": i + 1})
        return spans


class _PauseHolder(threading.Thread):
    """Holds ``manager.pause()`` from its own thread between ``/pause_generation`` and ``/continue``.

    transformers counts pause holders per thread, so the thread that enters the context must be the one
    that leaves it; the HTTP calls that start and end an in-place pause arrive as separate requests.
    """

    def __init__(self, manager) -> None:
        super().__init__(name="slipstream-pause-holder", daemon=True)
        self._manager = manager
        self.acquired = threading.Event()
        self.release = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self._manager.pause():
                self.acquired.set()
                self.release.wait()
        except BaseException as err:  # noqa: BLE001 - reported to the caller of pause()
            self.error = err
            self.acquired.set()


class EmbeddedEngine:
    """Continuous batching behind an asyncio API, with versioned weights and SGLang's pause semantics.

    Invariants: ``len(output_ids) == len(logprobs) == len(versions)`` for every request at every moment;
    versions along one request never decrease; a request ends exactly once (``finish``), and an aborted
    one keeps every token delivered before the abort. ``submit``/``abort``/``pause``/``resume`` run on
    the event loop given to :meth:`start`; ``apply_weights`` may be called from any thread.
    """

    def __init__(
        self,
        model_path: str | Path,
        cfg: EmbeddedServerConfig | None = None,
        *,
        weight_version: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Load the model (blocking). ``clock`` times the stall watchdog; tests pass a fake one."""
        from transformers import AutoModelForCausalLM

        self.cfg = cfg or EmbeddedServerConfig()
        if self.cfg.attn_implementation == "sdpa":
            attention.install()
            if not attention.is_routed("sdpa"):
                log.warning(
                    "this transformers version does not route continuous batching to the per-request SDPA"
                    " (slipstream/rollouter/embedded/attention.py): requests attend across each other"
                )
        self.model_path = str(model_path)
        self.tokenizer = _load_tokenizer(self.model_path)
        dtype = parse_dtype(self.cfg.dtype, key="rollout.embedded.dtype")
        model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=dtype, attn_implementation=self.cfg.attn_implementation
        )
        self.model = model.to(self.cfg.device).eval()
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.eos_token_ids = _eos_ids(self.model)
        self._routes = routes.RouteRecorder(self.model) if is_moe(self.model) else None
        self._params = dict(self.model.state_dict(keep_vars=True))
        self._version = int(weight_version)
        self._stamp = int(weight_version)  # the version stamped on tokens; only touched on the event loop
        self._weights_lock = threading.Lock()
        self._manager = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._by_rid: dict[str, RequestState] = {}
        self._ids = itertools.count()
        self._gate: asyncio.Event | None = None
        self._pause_mode: PauseMode | None = None
        self._holder: _PauseHolder | None = None
        self._filters = FilterUse()
        # Tokens generated since start, all requests together (a progress counter for /model_info).
        self.generated_tokens = 0
        # Watchdog state: requests handed to the generation loop and not finished, and when the loop last
        # showed progress (a token, or the first request after an idle spell, or the end of a pause).
        self._clock = clock
        self._in_flight = 0
        self._progress_at = clock()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the generation thread; call from the event loop that will serve requests."""
        from transformers import ContinuousBatchingConfig, GenerationConfig

        self._loop = asyncio.get_running_loop()
        self._gate = asyncio.Event()
        self._gate.set()
        gen_cfg = GenerationConfig(
            do_sample=True,
            temperature=PLACEHOLDER_TEMPERATURE,
            top_k=PLACEHOLDER_TOP_K,
            top_p=PLACEHOLDER_TOP_P,
            max_new_tokens=self.cfg.max_model_len,
            eos_token_id=list(self.eos_token_ids) or None,
            pad_token_id=self.model.config.pad_token_id,
        )
        on_cuda = str(self.cfg.device).startswith("cuda")
        cb_cfg = ContinuousBatchingConfig(
            return_logprobs=True,
            per_request_processors=True,
            page_size=self.cfg.kv_page_size,
            num_blocks=math.ceil(self.cfg.kv_cache_tokens / self.cfg.kv_page_size),
            max_batch_tokens=self.cfg.max_batch_tokens,
            max_requests_per_batch=self.cfg.max_running_requests,
            allow_block_sharing=False,
            scheduler_type=scheduler.install(),
            use_async_batching=False,
            use_cuda_graph=None if on_cuda else False,
            auto_switch_to_flash=False,
            seed=None if self.cfg.seed < 0 else self.cfg.seed,
        )
        manager = self.model.init_continuous_batching(
            generation_config=gen_cfg, continuous_batching_config=cb_cfg
        )
        install_fast_warpers(manager, self._filters)
        if self._routes is not None:
            self._routes.attach(manager)
        manager.start()
        self._manager = manager

    def stop(self, timeout_s: float = 30.0) -> None:
        """End every request (finish ``abort``) and stop the generation thread."""
        for state in list(self._by_rid.values()):
            self._finish(state, Finish("abort", message="the server is shutting down"))
        if self._holder is not None:
            self._holder.release.set()
            self._holder = None
        if self._manager is not None and self._manager.is_running():
            self._manager.stop(block=True, timeout=timeout_s)
        self._manager = None

    @property
    def running(self) -> bool:
        """The generation thread is alive and has not failed (it may still be stalled)."""
        mgr = self._manager
        return mgr is not None and mgr.is_running() and mgr.background_thread_status.fatal_error is None

    @property
    def healthy(self) -> bool:
        return self.health_problem() is None

    def health_problem(self) -> str | None:
        """Why ``/health`` should fail, or None: the generation loop is down, or it stopped making progress."""
        mgr = self._manager
        if mgr is None or not mgr.is_running():
            return "the generation loop is not running"
        if mgr.background_thread_status.fatal_error is not None:
            return f"the generation loop failed: {mgr.background_thread_status.fatal_error}"
        return self.stall_problem()

    def stall_problem(self) -> str | None:
        """A stall: requests in flight, not paused in place, and no token for ``stall_timeout_s`` seconds.

        An in-place pause freezes requests on purpose, so it does not count (and restarts the clock when it
        ends); requests held at the pause gate are not in flight.
        """
        limit = self.cfg.stall_timeout_s
        if limit <= 0 or self._in_flight == 0 or self._pause_mode == "in_place":
            return None
        idle = self._clock() - self._progress_at
        if idle < limit:
            return None
        return (
            f"stalled: {self._in_flight} requests in flight and no token generated for {idle:.1f} s"
            f" (stall_timeout_s {limit:g})"
        )

    @property
    def records_routes(self) -> bool:
        """Whether finished requests carry ``routed_experts`` (the model is a mixture of experts)."""
        return self._routes is not None

    @property
    def paused(self) -> PauseMode | None:
        return self._pause_mode

    @property
    def num_running(self) -> int:
        return len(self._by_rid)

    # ------------------------------------------------------------------ requests

    def validate(self, input_ids: list[int], sampling: SamplingParams) -> int:
        """Check a request; return the ``max_new_tokens`` it will run with (clamped to the context)."""
        if not input_ids:
            raise RequestError("input_ids is empty: a prompt needs at least one token")
        bad = next((t for t in input_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(
                f"input_ids contains token id {bad}, outside the vocabulary [0, {self.vocab_size})"
            )
        room = self.cfg.max_model_len - len(input_ids)
        if room < 1:
            raise RequestError(
                f"the prompt has {len(input_ids)} tokens; this server accepts at most "
                f"{self.cfg.max_model_len - 1} (max_model_len {self.cfg.max_model_len} includes the response)"
            )
        if sampling.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be at least 1, got {sampling.max_new_tokens}")
        if not (math.isfinite(sampling.temperature) and sampling.temperature >= 0):
            raise RequestError(f"temperature must be a finite number >= 0, got {sampling.temperature}")
        if not (0 < sampling.top_p <= 1):
            raise RequestError(f"top_p must be in (0, 1], got {sampling.top_p}")
        if sampling.top_k == 0 or sampling.top_k < -1:
            raise RequestError(f"top_k must be -1 (off) or at least 1, got {sampling.top_k}")
        bad = next((t for t in sampling.stop_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(
                f"stop_token_ids contains {bad}, outside the vocabulary [0, {self.vocab_size})"
            )
        return min(sampling.max_new_tokens, room)

    async def submit(
        self, input_ids: list[int], sampling: SamplingParams, *, rid: str, ignore_eos: bool = False
    ) -> RequestState:
        """Validate and enqueue a request; while the engine is paused it waits at the gate first.

        Returns the live :class:`RequestState`; follow it with :meth:`stream` or :meth:`wait`.
        """
        if not self.running:
            raise EngineUnavailable("the generation loop is not running")
        max_new = self.validate(input_ids, sampling)
        if rid in self._by_rid:
            raise RequestError(f"rid {rid!r} is already running on this server")
        stop_ids = set(sampling.stop_token_ids) | (set() if ignore_eos else set(self.eos_token_ids))
        state = RequestState(
            rid=rid,
            cb_id=f"{rid}#{next(self._ids)}",
            input_ids=list(input_ids),
            max_new_tokens=max_new,
            stop_ids=frozenset(stop_ids),
        )
        self._by_rid[rid] = state
        assert self._gate is not None
        await self._gate.wait()
        if state.done:  # aborted while held at the gate
            return state
        kwargs = request_sampling_kwargs(
            sampling.temperature, sampling.top_k, sampling.top_p, self.vocab_size
        )
        mgr = self._manager
        mgr.register_result_handler(state.cb_id, lambda out, s=state: self._on_output(s, out))
        # Counted in before the generation loop can see the request (the warpers read the count).
        filters = self._filters.acquire(*filters_used(kwargs, self.vocab_size))
        if self._routes is not None:
            self._routes.open(state.cb_id)
        added = mgr.add_request(
            state.input_ids,
            request_id=state.cb_id,
            max_new_tokens=max_new,
            streaming=True,
            eos_token_id=sorted(stop_ids),
            **kwargs,
        )
        if added is None:
            self._filters.release(filters)
            self._finish(state, Finish("abort", message="the generation loop is not accepting requests"))
            raise EngineUnavailable("the generation loop is not accepting requests")
        state.filters = filters
        if self._in_flight == 0:  # the stall clock starts with the first request after an idle spell
            self._progress_at = self._clock()
        self._in_flight += 1
        state.submitted = True
        return state

    async def stream(self, state: RequestState) -> AsyncIterator[RequestState]:
        """Yield ``state`` each time it gained tokens or finished (updates may coalesce); ends after finish."""
        while True:
            await state.changed.wait()
            state.changed.clear()
            yield state
            if state.done:
                return

    async def wait(self, state: RequestState) -> RequestState:
        async for _ in self.stream(state):
            pass
        return state

    def abort(self, rid: str, message: str = "aborted by /abort_request") -> bool:
        """End request ``rid`` now with the tokens it has; False when no such request is running."""
        state = self._by_rid.get(rid)
        if state is None:
            return False
        self._finish(state, Finish("abort", message=message))
        return True

    def abort_all(self, *, submitted_only: bool = False, message: str = "aborted by /abort_request") -> int:
        states = [s for s in self._by_rid.values() if s.submitted or not submitted_only]
        for state in states:
            self._finish(state, Finish("abort", message=message))
        return len(states)

    def _on_output(self, state: RequestState, out) -> None:
        """Runs on the event loop for every streamed step of one request."""
        if state.done:  # aborted: tokens still in flight from the generation thread are dropped
            return
        if out.error is not None:
            self._finish(state, Finish("abort", message=f"generation failed: {out.error}"))
            return
        n = len(state.output_ids)
        new = out.generated_tokens[n:]
        state.output_ids.extend(new)
        state.logprobs.extend(out.logprobs[n : n + len(new)])
        state.versions.extend([self._stamp] * len(new))
        self.generated_tokens += len(new)
        if new:
            self._progress_at = self._clock()
        if out.is_finished():
            last = state.output_ids[-1] if state.output_ids else None
            if last is not None and last in state.stop_ids:
                self._finish(state, Finish("stop", matched=last))
            else:
                self._finish(state, Finish("length", length=len(state.output_ids)))
        else:
            state.changed.set()

    def _finish(self, state: RequestState, finish: Finish) -> None:
        if state.done:
            return
        state.finish = finish
        self._by_rid.pop(state.rid, None)
        if self._routes is not None:
            tokens = len(state.input_ids) + len(state.output_ids) - 1
            state.routed_experts = self._routes.take(state.cb_id, tokens)
        if state.submitted:
            self._in_flight -= 1
            self._filters.release(state.filters)
        mgr = self._manager
        if finish.type == "abort" and state.submitted and mgr is not None:
            mgr.cancel_request(state.cb_id)
            # transformers removes a handler only when its request finishes; a cancelled one never does.
            with mgr.output_router._lock:
                mgr.output_router.result_handlers.pop(state.cb_id, None)
        state.changed.set()

    # ------------------------------------------------------------------ pause / resume

    async def pause(self, mode: str) -> None:
        """Hold new requests at the gate; ``abort`` ends running ones, ``in_place`` freezes them."""
        if mode not in PAUSE_MODES:
            raise RequestError(f"pause mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        assert self._gate is not None
        self._gate.clear()
        if mode == "abort":
            self.abort_all(submitted_only=True, message="aborted by /pause_generation")
            self._pause_mode = self._pause_mode or "abort"
            return
        if self._holder is None:
            holder = _PauseHolder(self._manager)
            holder.start()
            acquired = await asyncio.to_thread(holder.acquired.wait, _PAUSE_TIMEOUT_S)
            if holder.error is not None or not acquired:
                holder.release.set()
                raise EngineUnavailable(f"the generation loop could not pause: {holder.error or 'timed out'}")
            self._holder = holder
        self._pause_mode = "in_place"

    async def resume(self) -> None:
        """Let frozen requests continue and held requests start."""
        holder, self._holder = self._holder, None
        if holder is not None:
            holder.release.set()
            await asyncio.to_thread(holder.join, _PAUSE_TIMEOUT_S)
        self._pause_mode = None
        self._progress_at = self._clock()  # time spent paused is not a stall
        assert self._gate is not None
        self._gate.set()

    # ------------------------------------------------------------------ weights (WeightTarget)

    @property
    def weight_version(self) -> int:
        return self._version

    def weight_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {name: (tuple(p.shape), p.dtype) for name, p in self.model.named_parameters()}

    def apply_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Validate every tensor, then copy them all in with generation paused and set the version.

        Names may also be tied aliases (``lm_head.weight`` of a model with tied embeddings); dtypes are
        cast to the serving dtype. Raises ``ValueError`` and changes nothing when a name is unknown, a
        shape differs, a tensor is not floating point or ``version`` is lower than the serving one.
        """
        staged = list(named_tensors)
        self._check_weights(staged, version)
        with self._weights_lock:
            mgr = self._manager
            if mgr is not None and mgr.is_running():
                with mgr.pause():
                    self._copy_weights(staged, version)
            else:
                self._copy_weights(staged, version)

    update_weights = apply_weights

    def _check_weights(self, staged: list[tuple[str, torch.Tensor]], version: int) -> None:
        if int(version) < self._version:
            raise ValueError(f"weight version {version} is older than the serving version {self._version}")
        for name, tensor in staged:
            target = self._params.get(name)
            if target is None:
                raise ValueError(f"unknown parameter {name!r}; weight_specs() lists the accepted names")
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"parameter {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            if not tensor.is_floating_point():
                raise ValueError(f"parameter {name!r} has dtype {tensor.dtype}; a floating dtype is required")

    @torch.no_grad()
    def _copy_weights(self, staged: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy on the generation loop's stream and wait for it, so no step reads half-copied weights.

        The loop computes on a stream of its own (transformers' ``compute_stream`` on an accelerator), and a
        copy queued on the caller's stream would still be running when the loop resumes: its first step,
        stamped with the new version, could read a mix of old and new weights. So the copies go on the loop's
        stream after everything already queued there (its last step, which read the old weights) and after
        the caller's pending work (which may still be producing the tensors), and the stream is synchronised
        before the version changes and the pause ends. On CPU there is no stream and copies are synchronous.
        """
        stream = self._generation_stream()
        if stream is not None and isinstance(stream, torch.Stream):
            stream.wait_stream(torch.get_device_module(stream.device).current_stream(stream.device))
        with _stream_context(stream):
            for name, tensor in staged:
                self._params[name].data.copy_(tensor)
        if stream is not None:
            stream.synchronize()
        self._version = int(version)
        if self._loop is not None and not self._loop.is_closed():
            # Queued behind every token the generation loop delivered before it parked (see module doc).
            self._loop.call_soon_threadsafe(self._set_stamp, int(version))
        else:
            self._stamp = int(version)

    def _set_stamp(self, version: int) -> None:
        self._stamp = version

    def _generation_stream(self):  # noqa: ANN202 - a torch.Stream or None
        """The stream the generation loop computes on; None on CPU (no streams: every op is synchronous)."""
        if self.model.device.type == "cpu":
            return None
        processor = getattr(self._manager, "batch_processor", None)
        stream = getattr(getattr(processor, "inputs_and_outputs", None), "compute_stream", None)
        if stream is None:  # the loop has not built its processor yet, or runs on the default stream
            stream = torch.get_device_module(self.model.device).current_stream(self.model.device)
        return stream


def _stream_context(stream):  # noqa: ANN001, ANN202
    """Make ``stream`` current for the block (a no-op for None and for stand-ins that are not torch streams)."""
    if not isinstance(stream, torch.Stream):
        return contextlib.nullcontext()
    return torch.get_device_module(stream.device).stream(stream)


def _load_tokenizer(path: str):
    """The checkpoint's tokenizer, or None for a weights-only directory (text endpoints then answer 400)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        log.warning("no tokenizer in %s (%s): only token-id requests will work", path, err)
        return None


def _eos_ids(model) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int) and value >= 0:
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value if v is not None and v >= 0)
    return tuple(sorted(ids))
