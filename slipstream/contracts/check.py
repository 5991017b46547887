"""Run every contract check against the pinned releases in the cache and gather one report.

A project pinned at several releases (vLLM: 0.33.0 for GPUs, the CPU build 0.32.0 that the tests run;
``pins.RELEASES``) has every check run against each; each problem names the release it was found against.
A difference between the releases that Slipstream copes with is listed in ``known.py`` (and in
``docs/contracts.md``): found, it is reported as known rather than as a problem; listed but no longer
found, it is a problem (the list must say what is true).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from slipstream.contracts import cache
from slipstream.contracts.descriptions import check_descriptions, count_described
from slipstream.contracts.flags import check_launch, parse_argv
from slipstream.contracts.http import check_http
from slipstream.contracts.known import KNOWN, Known, split_known
from slipstream.contracts.ours import HttpCall, LaunchArgv, record_http_calls, record_launch_argv
from slipstream.contracts.pins import PINS, RELEASES, release_label
from slipstream.contracts.problems import Problem, dedupe
from slipstream.contracts.pyapi import check_python_api
from slipstream.contracts.responses import check_replies
from slipstream.contracts.upstream import SourceTree


@dataclass
class Report:
    problems: list[Problem] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    unparsable: list[str] = field(default_factory=list)  # upstream files this Python could not parse
    known: list[tuple[Known, Problem]] = field(default_factory=list)  # differences we cope with, as found

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        counts = ", ".join(f"{v} {k}" for k, v in self.counts.items())
        head = f"contracts against {', '.join(p.requirement for p in PINS.values())}: checked {counts}"
        if self.unparsable:
            head += f" (read as empty, syntax too new for this Python: {', '.join(self.unparsable)})"
        known = ""
        if self.known:
            entries = list(dict.fromkeys(k for k, _ in self.known))
            lines = [
                "\n".join(f"  {p}" for kk, p in self.known if kk is k)
                + f"\n    how Slipstream copes: {k.copes}"
                for k in entries
            ]
            known = f"\n{len(entries)} known difference(s) between releases (known.py):\n" + "\n".join(lines)
        if self.ok:
            return head + "; no problems" + known
        body = "\n".join(f"  {p}" for p in self.problems)
        return head + f"; {len(self.problems)} problem(s):\n" + body + known


def release_trees(root: Path | None = None) -> list[tuple[dict[str, str], dict[str, SourceTree]]]:
    """(project -> release label, project -> source tree) for each release variant, from the cache (fetched
    first if cold). The first variant is every project's first release; each further one is the first with
    one project swapped for another of its releases (``pins.RELEASES``). Trees are shared, so a file is
    parsed once however many variants read it."""
    d = {name: cache.ensure(pin, root) for name, pin in PINS.items()}
    built: dict[tuple[str, ...], SourceTree] = {}

    def tree(pins: tuple[str, ...]) -> SourceTree:
        if pins not in built:
            built[pins] = SourceTree([d[name] for name in pins])
        return built[pins]

    first = (
        {k: release_label(r[0]) for k, r in RELEASES.items()},
        {k: tree(r[0]) for k, r in RELEASES.items()},
    )
    out = [first]
    for project, releases in RELEASES.items():
        for pins in releases[1:]:
            out.append(({**first[0], project: release_label(pins)}, {**first[1], project: tree(pins)}))
    return out


def trees(root: Path | None = None) -> dict[str, SourceTree]:
    """One source tree per upstream project, each at its first release (the one a description pins)."""
    return release_trees(root)[0][1]


def _field_paths(value, prefix: str = "") -> set[str]:
    out: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            out.add(prefix + k)
            out |= _field_paths(v, f"{prefix}{k}.")
    return out


def count_http(calls: list[HttpCall]) -> dict[str, int]:
    endpoints = {(c.kind, c.method, c.path) for c in calls}
    fields = {(c.kind, c.path, f) for c in calls for f in _field_paths(c.body) | {f"?{k}" for k in c.params}}
    reads = {(c.kind, c.path, r) for c in calls for r in c.reads}
    return {"endpoints": len(endpoints), "request fields": len(fields), "reply fields read": len(reads)}


def count_flags(argvs: list[LaunchArgv]) -> int:
    from slipstream.contracts.flags import LAUNCH

    return len({(a.kind, f) for a in argvs for f, _ in parse_argv(a.argv, LAUNCH[a.kind].skip)})


# Our Python-API use checked with ``ast``: the upstream package (a project of RELEASES) -> our modules that
# import it (vLLM: our weight-transfer plug-in, which runs inside the server).
PYTHON_APIS = ("nixl", "megatron", "vllm")


def check_variant(
    t: dict[str, SourceTree],
    labels: dict[str, str],
    calls: list[HttpCall],
    argvs: list[LaunchArgv],
    projects: set[str] | None = None,
) -> tuple[list[Problem], dict[str, int]]:
    """Every check of ``projects`` (default: all) against one release variant; problems tagged with the
    release they were found against, and what was checked."""
    from slipstream.contracts.descriptions import pinned_apis

    only = projects if projects is not None else set(t)
    calls = [c for c in calls if c.kind in only]
    argvs = [a for a in argvs if a.kind in only]
    apis = {k: api for k, api in pinned_apis().items() if k in only}
    problems = check_http(t, calls) + check_replies(t, calls) + check_descriptions(t, calls, apis)
    problems += check_launch(t, argvs)
    counts = {f"{root} uses": 0 for root in PYTHON_APIS if root in only}
    for root in PYTHON_APIS:
        if root in only:
            found, checked = check_python_api(t[root], root)
            problems += found
            counts[f"{root} uses"] = checked
    tagged = [replace(p, release=labels.get(p.project, "")) for p in problems]
    return tagged, counts


def run(variants: list[tuple[dict[str, str], dict[str, SourceTree]]] | None = None) -> Report:
    """All checks against every release (``variants`` defaults to the pinned ones: :func:`release_trees`)."""
    variants = variants or release_trees()
    report = Report()
    errors: list[str] = []
    calls = record_http_calls(errors)
    report.problems += [Problem("our side", "", f"recording failed: {e}") for e in errors]
    report.counts.update(count_http(calls))
    report.counts["described endpoints"] = count_described()
    argvs = record_launch_argv()
    report.counts["launch flags"] = count_flags(argvs)
    first = variants[0][1]
    found: list[Problem] = []
    for i, (labels, t) in enumerate(variants):
        projects = None if i == 0 else {k for k in t if t[k] is not first[k]}
        problems, counts = check_variant(t, labels, calls, argvs, projects)
        found += problems
        if i == 0:
            report.counts.update(counts)
    report.counts["releases"] = len({label for labels, _ in variants for label in labels.values()})
    rest, report.known, stale = split_known(dedupe(found), KNOWN)
    report.problems += rest + stale
    trees_read = {id(tree): tree for _, t in variants for tree in t.values()}.values()
    report.unparsable = sorted({f for tree in trees_read for f in tree.unparsable})
    return report
