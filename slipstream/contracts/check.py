"""Run every contract check against the pinned releases in the cache and gather one report."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from slipstream.contracts import cache
from slipstream.contracts.descriptions import check_descriptions, count_described
from slipstream.contracts.flags import check_launch, parse_argv
from slipstream.contracts.http import check_http
from slipstream.contracts.ours import HttpCall, LaunchArgv, record_http_calls, record_launch_argv
from slipstream.contracts.pins import PINS
from slipstream.contracts.problems import Problem, dedupe
from slipstream.contracts.pyapi import check_python_api
from slipstream.contracts.responses import check_replies
from slipstream.contracts.upstream import SourceTree


@dataclass
class Report:
    problems: list[Problem] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    unparsable: list[str] = field(default_factory=list)  # upstream files this Python could not parse

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        counts = ", ".join(f"{v} {k}" for k, v in self.counts.items())
        head = f"contracts against {', '.join(p.requirement for p in PINS.values())}: checked {counts}"
        if self.unparsable:
            head += f" (read as empty, syntax too new for this Python: {', '.join(self.unparsable)})"
        if self.ok:
            return head + "; no problems"
        return head + f"; {len(self.problems)} problem(s):\n" + "\n".join(f"  {p}" for p in self.problems)


def trees(root: Path | None = None) -> dict[str, SourceTree]:
    """One source tree per upstream project, from the cache (fetched first if cold)."""
    d = {name: cache.ensure(pin, root) for name, pin in PINS.items()}
    return {
        "vllm": SourceTree([d["vllm"]]),
        "sglang": SourceTree([d["sglang"]]),
        "nixl": SourceTree([d["nixl"], d["nixl-cu12"]]),
        "megatron": SourceTree([d["megatron-core"]]),
    }


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


def run(source_trees: dict[str, SourceTree] | None = None) -> Report:
    """All checks; ``source_trees`` defaults to the pinned releases (see :func:`trees`)."""
    t = source_trees or trees()
    report = Report()
    errors: list[str] = []
    calls = record_http_calls(errors)
    report.problems += [Problem("our side", "", f"recording failed: {e}") for e in errors]
    report.problems += check_http(t, calls)
    report.problems += check_replies(t, calls)
    report.counts.update(count_http(calls))
    report.problems += check_descriptions(t, calls)
    report.counts["described endpoints"] = count_described()
    argvs = record_launch_argv()
    report.problems += check_launch(t, argvs)
    report.counts["launch flags"] = count_flags(argvs)
    for root in ("nixl", "megatron"):
        problems, checked = check_python_api(t[root], root)
        report.problems += problems
        report.counts[f"{root} uses"] = checked
    report.problems = dedupe(report.problems)
    report.unparsable = sorted(f for tree in t.values() for f in tree.unparsable)
    return report
