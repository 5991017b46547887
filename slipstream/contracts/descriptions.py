"""The server descriptions (``slipstream.serverapi``) against the pinned releases and our own calls.

A description is the one place our code learns a server's paths, so the checker holds it to two rules:

* every endpoint a pinned server's description names exists upstream with that method, including the
  ones no recorded call reaches (another generate route's abort, say);
* every request our clients and adapters send goes to an endpoint named by its kind's description, so a
  path written anywhere else is reported.

The releases themselves are the descriptions' (``pins.py`` reads ``dist`` and ``version`` from them), so
a version bump is a change to one description.
"""

from __future__ import annotations

from collections.abc import Mapping

from slipstream.contracts.ours import HttpCall
from slipstream.contracts.problems import Problem
from slipstream.contracts.upstream import SourceTree
from slipstream.serverapi import ServerAPI
from slipstream.serverkinds import kind_names, server_kind


def pinned_apis() -> dict[str, ServerAPI]:
    """The descriptions of servers with a release on the package registry (not our embedded one)."""
    return {kind: server_kind(kind).api for kind in kind_names() if server_kind(kind).api.dist}


def check_descriptions(
    trees: Mapping[str, SourceTree],
    calls: list[HttpCall],
    apis: Mapping[str, ServerAPI] | None = None,
) -> list[Problem]:
    """Described endpoints missing upstream, and recorded calls to endpoints no description names."""
    apis = pinned_apis() if apis is None else apis
    problems: list[Problem] = []
    for kind, api in apis.items():
        tree = trees[kind]
        for ep in api.endpoints():
            if not tree.find_routes(ep.path, ep.method):
                other = sorted({m for r in tree.routes if r.path == ep.path for m in r.methods})
                why = f"only {', '.join(other)} is routed" if other else "no such route"
                problems.append(
                    Problem(f"{kind} {ep}", "", f"described endpoint missing upstream: {why}", "",
                            f"serverapi {api.requirement}")
                )  # fmt: skip
    for call in calls:
        api = apis.get(call.kind)
        if api is not None and (call.method, call.path) not in {(e.method, e.path) for e in api.endpoints()}:
            problems.append(
                Problem(f"{call.kind} {call.endpoint}", "",
                        "sent, but not an endpoint of the server's description (slipstream.serverapi)", "",
                        call.origin)
            )  # fmt: skip
    return problems


def count_described(apis: Mapping[str, ServerAPI] | None = None) -> int:
    apis = pinned_apis() if apis is None else apis
    return sum(len(api.endpoints()) for api in apis.values())
