"""Partial rollouts made invisible to agent loops: resume aborted requests, count what is in flight.

When weights change under ``partial_rollout = abort``, the servers end every running request with
``finish_reason = "abort"`` and the tokens generated so far (SGLang's ``/pause_generation {mode: abort}``).
:class:`PartialRolloutClient` wraps the rollouter's client and, for such a request, re-submits
``prompt + partial output`` with the remaining token budget (the server holds it until generation
continues, now with the new weights) and concatenates the pieces: ids, log-probabilities and per-token
versions, so each token carries the version that produced it. The KV cache of the prefix is recomputed
(AReaL and verl do the same); agent loops only ever see ``stop`` or ``length``.

The wrapper resumes an abort in every mode (under ``in_place`` and ``off`` none is expected, and resuming
loses nothing); only while the rollouter is stopping does it return the abort, ending the episode.

It also bounds and measures the requests in flight: at most ``max_in_flight`` at once (the per-server
limit times the number of servers; the load balancer enforces the per-server share), ``queued`` counts
those waiting for a slot, and busy time (at least one request active) gives the rollouter's idle ratio.

Worked example::

    client = PartialRolloutClient(balancer, max_in_flight=128)
    out = await client.generate(prompt_ids, SamplingParams(max_new_tokens=512), rid="e0-p7-0")
    out.versions      # [4, 4, ..., 5, 5]: aborted once by the push of version 5, then resumed
    out.num_resumes   # 1
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import msgspec
import numpy as np

from slipstream.agents.protocol import GenerateOutput, InferenceClient, SamplingParams
from slipstream.utils.logging import get_logger

log = get_logger(__name__)

# Back-off between resumes that produced no new token (a server aborting again at once), doubling.
RESUME_BACKOFF_S = 0.05
MAX_RESUME_BACKOFF_S = 2.0


class PartialRolloutClient:
    """An :class:`~slipstream.agents.protocol.InferenceClient` that resumes aborted requests.

    Lifecycle: wrap the rollouter's client once; set :attr:`stopping` (or call :meth:`abort_all`) when the
    run ends. Use from one event loop.
    """

    def __init__(self, client: InferenceClient, *, max_in_flight: int, max_resumes: int = 1000) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.client = client
        self.max_in_flight = max_in_flight
        self.max_resumes = max_resumes
        self.stopping = False
        self._slots = asyncio.Semaphore(max_in_flight)
        # rid -> rid of the request now on the server (a resumed request gets a fresh one)
        self._active: dict[str, str] = {}
        # rids aborted through this wrapper: their abort is meant, not a weight update, so not resumed
        self._cancelled: set[str] = set()
        self.queued = 0
        self.generated_tokens = 0
        self.resumes = 0
        self._busy_s = 0.0
        self._busy_since: float | None = None

    @property
    def active(self) -> int:
        return len(self._active)

    def busy_seconds(self) -> float:
        """Seconds with at least one request in flight, up to now."""
        extra = time.monotonic() - self._busy_since if self._busy_since is not None else 0.0
        return self._busy_s + extra

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        session_id: str | None = None,
        **media: Any,
    ) -> GenerateOutput:
        """``media``: the request's images (``images=``, see ``InferenceClient``), sent again with every
        resumed piece: the re-submitted prompt still holds one pad per image, which the server expands."""
        rid = rid or uuid.uuid4().hex
        if rid in self._active:
            raise ValueError(f"request id `{rid}` is already in flight")
        self.queued += 1
        try:
            await self._slots.acquire()
        finally:
            self.queued -= 1
        self._enter(rid)
        try:
            return await self._generate_resuming(input_ids, sampling, rid, session_id, media)
        finally:
            self._leave(rid)
            self._slots.release()

    async def _generate_resuming(
        self, input_ids: list[int], sampling: SamplingParams, rid: str, session_id: str | None, media: dict
    ) -> GenerateOutput:
        out = GenerateOutput(output_ids=[], logprobs=[], versions=[], finish_reason="abort", rid=rid)
        backoff = RESUME_BACKOFF_S
        resumes = 0
        while True:
            remaining = sampling.max_new_tokens - len(out.output_ids)
            server_rid = rid if resumes == 0 else f"{rid}.r{resumes}"
            self._active[rid] = server_rid
            piece = await self.client.generate(
                input_ids + out.output_ids,
                msgspec.structs.replace(sampling, max_new_tokens=remaining),
                rid=server_rid,
                session_id=session_id,
                **media,
            )
            if piece.prompt_ids:  # images expanded: the prompt is the piece's prompt before the output
                out.prompt_ids = piece.prompt_ids[: len(piece.prompt_ids) - len(out.output_ids)]
            _append(out, piece)
            self.generated_tokens += len(piece.output_ids)
            if piece.finish_reason != "abort" or self.stopping or rid in self._cancelled:
                break
            if len(out.output_ids) >= sampling.max_new_tokens:
                out.finish_reason = "length"  # the pieces already used the whole budget
                break
            if resumes >= self.max_resumes:
                log.warning("request %s was aborted %d times; giving up on it", rid, resumes + 1)
                break
            resumes += 1
            self.resumes += 1
            if piece.output_ids:
                backoff = RESUME_BACKOFF_S
            else:  # aborted before producing anything: do not spin against a server that keeps aborting
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, MAX_RESUME_BACKOFF_S)
        out.prompt_tokens = len(input_ids)
        out.num_resumes += resumes
        return out

    async def abort(self, rid: str) -> None:
        """End request ``rid`` for good: its ``generate`` returns the partial output with ``abort``."""
        if rid in self._active:
            self._cancelled.add(rid)
        await self.client.abort(self._active.get(rid, rid))

    async def abort_all(self, timeout_s: float = 10.0) -> None:
        """Stop resuming and abort every request in flight (the rollouter is stopping)."""
        self.stopping = True
        rids = list(self._active.values())
        if not rids:
            return
        results = await asyncio.wait_for(
            asyncio.gather(*(self.client.abort(r) for r in rids), return_exceptions=True), timeout_s
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            log.warning("aborting %d of %d requests failed: %s", len(failed), len(rids), failed[0])

    def _enter(self, rid: str) -> None:
        if not self._active:
            self._busy_since = time.monotonic()
        self._active[rid] = rid

    def _leave(self, rid: str) -> None:
        self._active.pop(rid, None)
        self._cancelled.discard(rid)
        if not self._active and self._busy_since is not None:
            self._busy_s += time.monotonic() - self._busy_since
            self._busy_since = None


def _append(out: GenerateOutput, piece: GenerateOutput) -> None:
    if not (len(piece.output_ids) == len(piece.logprobs) == len(piece.versions)):
        raise ValueError(
            f"request {piece.rid}: server returned {len(piece.output_ids)} tokens, {len(piece.logprobs)} "
            f"logprobs and {len(piece.versions)} versions"
        )
    out.routed_experts = stitch_routes(out.routed_experts, piece.routed_experts)
    out.output_ids.extend(piece.output_ids)
    out.logprobs.extend(piece.logprobs)
    out.versions.extend(piece.versions)
    out.finish_reason = piece.finish_reason
    out.server = piece.server or out.server
    out.num_resumes += piece.num_resumes


def stitch_routes(earlier: Any, later: Any) -> Any:
    """The routes of a request resumed after an abort: the earlier segments' where they reached, the later's
    beyond.

    A resumed piece re-prefills prompt + partial output, so its routes (``[tokens - 1, layers, k]``) cover the
    whole sequence; the tokens the earlier segments already routed keep the experts they were generated
    with (rows an abort left unforwarded, -1, take the later piece's). Either may be None (no routes).
    """
    if later is None or earlier is None:
        return earlier if later is None else later
    n = min(len(earlier), len(later))
    head = np.where(earlier[:n] < 0, later[:n], earlier[:n]) if earlier.dtype.kind == "i" else earlier[:n]
    out = np.concatenate([head.astype(later.dtype, copy=False), later[n:]])
    return out.astype(np.uint8) if out.dtype != np.uint8 and out.size and (out >= 0).all() else out
