"""Our embedded server (``slipstream serve``): SGLang's native API, served by this package.

It speaks SGLang's routes and bodies (``rollouter/embedded/app.py``), so it shares
:class:`~slipstream.serverapi.sglang.SGLangAPI`'s requests. It differs in three ways:

* pause modes: ``abort`` and ``in_place`` only (``rollouter/embedded/engine.py``); our ``retract``
  maps to ``abort``, as for vLLM;
* a version is staged while generation goes on (``pause="at_end"``): no pause before
  ``/begin_weight_update``, and a pause only around ``/end_weight_update`` when running requests must
  be aborted at the switch, which ``/end_weight_update {abort_running: true}`` does itself
  (``end_aborts``: one call instead of pause, end and continue);
* the version may travel in-band instead of per-bucket calls: ``/weightsync/{nixl,ipc}/prepare`` then
  ``/connect``, after ``/begin_weight_update {stream}``.

Versioned with Slipstream itself, so there is no pin to check against a registry; a test checks these
paths against the server's own routes.
"""

from __future__ import annotations

import dataclasses

from slipstream.serverapi.sglang import SGLANG, SGLangAPI
from slipstream.serverapi.spec import PauseMode

_ABORT = PauseMode("abort", in_flight="abort", new_requests="held")
_IN_PLACE = PauseMode("in_place", in_flight="keep", new_requests="held")

EMBEDDED: SGLangAPI = dataclasses.replace(
    SGLANG,
    kind="embedded",
    dist="",
    version="",
    pause_modes={"abort": _ABORT, "in_place": _IN_PLACE, "retract": _ABORT},
    weights=dataclasses.replace(
        SGLANG.weights,
        pause="at_end",
        ranks=None,  # one receiver per server, whatever its devices
        stream_prepare="/weightsync/{stream}/prepare",
        stream_connect="/weightsync/{stream}/connect",
        end_aborts=True,
    ),
)
