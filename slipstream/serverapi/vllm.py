"""vLLM's API (pinned: vllm 0.33.0, launched with ``VLLM_SERVER_DEV_MODE=1``; inference_apis.md §B).

* Generate, two token-in/token-out routes: ``POST /v1/completions`` (every server) and the native
  ``POST /inference/v1/generate`` (mounted with ``--enable-scale-out`` or ``--tokens-only``; 403 otherwise).
  Only the native route returns ``weight_versions`` spans on 0.32.0 (the CPU build); 0.33.0 adds them to
  completions with ``return_weight_versions``. vLLM renames the engine request of our
  ``request_id``: ``cmpl-<rid>-0`` and ``generate-tokens-<rid>`` (``entrypoints/scale_out/
  token_in_token_out/serving.py``); an abort must name that id, sent to the route's own
  ``abort_requests {request_ids}`` (an empty list aborts every request). Aborted requests come back with
  ``finish_reason == "abort"`` and their partial tokens.
* Pause: ``POST /pause?mode=abort|wait|keep&clear_cache=true``, resume ``POST /resume``. ``clear_cache``
  empties the prefix cache once the pause is complete, so no request after the push reuses a block
  computed under older weights (vLLM keys blocks by token ids and salt only, never by weights). In
  ``keep`` mode it also preempts the frozen requests (``_reset_caches(reset_running_requests=True)`` in
  ``v1/engine/core.py``): they stay on the server and recompute their cache under the new weights after
  resume, which is our ``retract``. The route's docstring calls the flag deprecated and ignored for
  ``keep``; the engine honours it in every mode on 0.32 and 0.33, and it is sent explicitly so a changed
  default cannot bring stale blocks back (``tests/vllm/test_vllm_weights_fresh_cache.py``). In ``abort`` and ``wait`` mode new requests get
  503 until resume (the client retries them; 0.32 holds them instead); in ``keep`` mode they are queued. vLLM has no ``retract``:
  ours maps to ``abort`` (the rollouter re-submits the partial output, which has the same effect).
* A version: pause → ``/start_weight_update`` → N × ``/update_weights {update_info}`` (after
  ``/init_weight_transfer_engine`` joined the NCCL group; ``/get_world_size`` counts its ranks) →
  ``/finish_weight_update {weight_version}`` → resume. With our ``slipstream`` engine the buckets travel in
  band (no call each) and stage while vLLM generates, and the pause moves to the end:
  ``/start_weight_update`` → the buckets → pause → ``/update_weights {SWITCH_UPDATE}`` →
  ``/finish_weight_update`` → resume.
"""

from __future__ import annotations

from slipstream.serverapi.sglang import get, post
from slipstream.serverapi.spec import Call, GenerateRoute, PauseMode, ServerAPI, WeightUpdate

# The ``update_info`` of the call that switches our weight-transfer engine (``rollouter/vllm_weights.py``) to
# the version it staged while vLLM generated: sent with generation paused, between the buckets and
# ``/finish_weight_update``.
SWITCH_UPDATE = {"slipstream_switch": True}
# Set by the launcher for ``rollout.vllm.double_buffer``; read by our engine in vLLM's worker.
DOUBLE_BUFFER_ENV = "SLIPSTREAM_VLLM_DOUBLE_BUFFER"

# Paused in abort or wait mode, 0.33 answers new requests 503 until resume (the client retries them); 0.32,
# the CPU build, holds them instead (docs/contracts.md). In keep mode both hold them. Every mode clears the
# prefix cache (module docstring), which makes vLLM's keep a retract.
_FRESH = {"clear_cache": "true"}
_ABORT = PauseMode("abort", in_flight="abort", new_requests="rejected", extra=_FRESH)
_KEEP = PauseMode("keep", in_flight="retract", new_requests="held", extra=_FRESH)
_WAIT = PauseMode("wait", in_flight="finish", new_requests="rejected", extra=_FRESH)


class VLLMAPI(ServerAPI):
    """vLLM's dev-mode pause, resume and abort requests."""

    def pause_call(self, mode: str) -> Call:
        m = self.pause_mode(mode)
        return Call(self.pause.method, self.pause.path, params={"mode": m.server, **m.extra})

    def resume_call(self) -> Call:
        return Call(self.resume.method, self.resume.path)

    def abort_call(self, rid: str, route: str | None = None) -> Call:
        r = self.route(route)
        return Call(r.abort.method, r.abort.path, json={"request_ids": [r.engine_request_id(rid)]})

    def abort_all_call(self) -> Call:
        abort = self.route().abort
        return Call(abort.method, abort.path, json={"request_ids": []})


VLLM = VLLMAPI(
    kind="vllm",
    dist="vllm",
    version="0.33.0",
    routes={
        "completions": GenerateRoute(post("/v1/completions"), post("/abort_requests"), "cmpl-{rid}-0"),
        "generate": GenerateRoute(
            post("/inference/v1/generate"), post("/inference/v1/abort_requests"), "generate-tokens-{rid}"
        ),
    },
    pause=post("/pause"),
    resume=post("/resume"),
    health=get("/health"),
    model_info=get("/v1/models"),
    weight_version=get("/weight_info"),
    pause_modes={"abort": _ABORT, "in_place": _KEEP, "retract": _ABORT, "wait": _WAIT},
    weights=WeightUpdate(
        init_group=post("/init_weight_transfer_engine"),
        destroy_group=post("/shutdown_weight_transfer_engine"),
        begin=post("/start_weight_update"),
        update=post("/update_weights"),
        end=post("/finish_weight_update"),
        pause="before",
        ranks=get("/get_world_size"),
        engine=get("/server_info"),  # ?config_format=json: vllm_config.weight_transfer_config.backend
    ),
)
