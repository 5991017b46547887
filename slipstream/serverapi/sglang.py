"""SGLang's native API (pinned: sglang 0.5.23), the RL subset we use (research/inference_apis.md §A).

* Generate: ``POST /generate`` with ``input_ids`` and ``rid``; abort: ``POST /abort_request {rid}`` (the
  pending generate returns its partial output with ``finish_reason.type == "abort"``), or
  ``{rid: "", abort_all: true}`` for every request.
* Pause: ``POST /pause_generation {mode}``, resume ``POST /continue_generation {}``. ``abort`` returns
  every running request with its partial output; ``retract`` puts them back in the waiting queue (cache
  freed, recomputed after continue: the client sees nothing); ``in_place`` freezes them with their cache
  (so ``flush_cache`` fails until they end). New requests are held until continue in every mode.
* A version: pause → ``/begin_weight_update {}`` → N × ``/update_weights_from_distributed`` (after the
  group is joined with ``/init_weights_update_group``; worker ranks ``rank_offset + tp_rank``, so a
  server takes ``/server_info``'s ``tp_size`` ranks) → ``/end_weight_update {}`` → continue.
"""

from __future__ import annotations

from slipstream.serverapi.spec import Call, Endpoint, GenerateRoute, PauseMode, ServerAPI, WeightUpdate


def post(path: str) -> Endpoint:
    return Endpoint("POST", path)


def get(path: str) -> Endpoint:
    return Endpoint("GET", path)


_ABORT = PauseMode("abort", in_flight="abort", new_requests="held")
_RETRACT = PauseMode("retract", in_flight="retract", new_requests="held")
_IN_PLACE = PauseMode("in_place", in_flight="keep", new_requests="held")


class SGLangAPI(ServerAPI):
    """SGLang's pause, continue and abort requests (shared by our embedded server, which speaks them)."""

    def pause_call(self, mode: str) -> Call:
        return Call(self.pause.method, self.pause.path, json={"mode": self.pause_mode(mode).server})

    def resume_call(self) -> Call:
        return Call(self.resume.method, self.resume.path, json={})

    def abort_call(self, rid: str, route: str | None = None) -> Call:
        r = self.route(route)
        return Call(r.abort.method, r.abort.path, json={"rid": r.engine_request_id(rid)})

    def abort_all_call(self) -> Call:
        abort = self.route().abort
        return Call(abort.method, abort.path, json={"rid": "", "abort_all": True})


SGLANG = SGLangAPI(
    kind="sglang",
    dist="sglang",
    version="0.5.23",
    routes={"generate": GenerateRoute(post("/generate"), post("/abort_request"))},
    pause=post("/pause_generation"),
    resume=post("/continue_generation"),
    health=get("/health"),
    model_info=get("/model_info"),
    weight_version=get("/model_info"),
    # SGLang has no ``wait`` (a pause that lets running requests finish).
    pause_modes={"abort": _ABORT, "in_place": _IN_PLACE, "retract": _RETRACT},
    weights=WeightUpdate(
        init_group=post("/init_weights_update_group"),
        destroy_group=post("/destroy_weights_update_group"),
        begin=post("/begin_weight_update"),
        update=post("/update_weights_from_distributed"),
        end=post("/end_weight_update"),
        pause="before",
        ranks=get("/server_info"),
    ),
)
