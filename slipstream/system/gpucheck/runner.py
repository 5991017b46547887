"""Run the checks: each in a process group of its own under a time limit, its result written the moment it ends.

A check is a function ``fn(ctx) -> dict`` registered with :func:`check` under a stage and a time limit. The
runner starts ``python -m slipstream.system.gpucheck --child NAME`` in a new session (its own process group) with a
tag in its environment; when the check ends, or its limit passes, the group is killed and so is every
process still carrying the tag, servers started in sessions of their own included (they inherit the
environment), so nothing a check started holds GPU memory into the next one. After each check the runner
rewrites ``OUT/results.json`` (atomically), so a call cut short still brings back every finished check.

The limits of a stage add up to less than its budget (``STAGE_BUDGET_S``); a check never gets more than
what is left of the budget, so the stage ends inside one call even if every check runs to its limit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

TAG_ENV = "SLIPSTREAM_GPUCHECK_TAG"
# Stage 1 fits one device call of <= 420 s with the wheels' install and Python's start-up beside it.
STAGE_BUDGET_S = {1: 390, 2: 540}


@dataclass
class Check:
    name: str
    fn: Callable[[Context], dict]
    limit_s: int
    stage: int


@dataclass
class Context:
    """What a check gets: the device, whether to run at small (CPU rehearsal) shapes, a work folder shared
    by the checks of one run (models built once), and the output folder (files that come back)."""

    device: str
    small: bool
    work: Path
    out: Path
    limit_s: float
    extra: dict = field(default_factory=dict)


CHECKS: dict[str, Check] = {}


def check(name: str, limit_s: int, stage: int = 1):
    def deco(fn):
        CHECKS[name] = Check(name, fn, limit_s, stage)
        return fn

    return deco


# Truth first: what every later figure depends on runs first; the longest and least certain runs last.
ORDER = ["preflight", "gpu_tests", "weightsync_ipc", "push", "train_16k", "train_32k", "rollout",
         "nixl_weightsync", "one_gpu_train"]  # fmt: skip


def stage_checks(stage: int) -> list[str]:
    names = [c.name for c in CHECKS.values() if c.stage == stage]
    return sorted(names, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER))


# ------------------------------------------------------------------------------------------ processes
def tagged_pids(tag: str) -> list[int]:
    """Every process whose environment carries ``TAG_ENV=tag`` (this one excepted)."""
    needle = f"{TAG_ENV}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def kill_tagged(tag: str, pgid: int | None = None) -> int:
    """Kill the group ``pgid`` and every process carrying ``tag``; return how many tagged processes other
    than the group's leader were still running (strays: a check's own process is no stray)."""
    left = tagged_pids(tag)
    if pgid is not None:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len([pid for pid in left if pid != pgid])


def run_one(name: str, ctx: Context, limit_s: float | None = None) -> dict:
    """Run check ``name`` in a child process group; return its result (``ok``: True, False, or None when
    it did not apply), with ``seconds`` and, on failure, the tail of what it printed."""
    limit = float(CHECKS[name].limit_s if limit_s is None else limit_s)
    tag = uuid.uuid4().hex
    result_path = ctx.work / f"{name}.result.json"
    log_path = ctx.work / f"{name}.log"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "slipstream.system.gpucheck", "--child", name, "--device", ctx.device,
           "--work", str(ctx.work), "--out", str(ctx.out), "--limit-s", str(limit)]  # fmt: skip
    if ctx.small:
        cmd.append("--small")
    env = {**os.environ, TAG_ENV: tag, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
            timed_out = False
        except subprocess.TimeoutExpired:
            rc, timed_out = None, True
        strays = kill_tagged(tag, proc.pid)
        proc.wait()
    seconds = round(time.monotonic() - start, 1)
    tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
    if timed_out:
        result = {"ok": False, "detail": f"did not finish within {limit:.0f} s (killed with its group)"}
        if result_path.exists():  # what it measured before the limit
            result = {**json.loads(result_path.read_text()), **result}
    elif result_path.exists():
        result = json.loads(result_path.read_text())
    else:
        result = {"ok": False, "detail": f"exited {rc} without a result"}
    if result.get("ok") is False:
        result["tail"] = tail
    result["seconds"] = seconds
    result["limit_s"] = round(limit)
    if strays:
        result["killed_after"] = strays  # processes it left running, killed before the next check
    return result


def child(name: str, ctx: Context) -> int:
    """In the child: run the check, write its result file (also partial figures, via ``ctx.extra``)."""
    path = ctx.work / f"{name}.result.json"
    try:
        result = CHECKS[name].fn(ctx)
    except Exception as err:  # recorded as this check's failure, with the traceback in the log tail
        import traceback

        traceback.print_exc()
        result = {"ok": False, "detail": f"{type(err).__name__}: {err}"[-2000:],
                  "figures": ctx.extra.get("figures", {})}  # fmt: skip
    write_json(path, result)
    return 0


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def partial(ctx: Context, name: str, figures: dict) -> None:
    """Record figures measured so far: a check killed at its limit still reports them."""
    ctx.extra.setdefault("figures", {}).update(figures)
    write_json(ctx.work / f"{name}.result.json", {"ok": False, "figures": ctx.extra["figures"],
                                                  "detail": "unfinished"})  # fmt: skip


# ------------------------------------------------------------------------------------------ the run
def run(names: list[str], ctx: Context, budget_s: float, report: dict, scale: float = 1.0) -> dict:
    """Run ``names`` in order inside ``budget_s``; ``report`` (the results file's content) is updated and
    rewritten after each check. ``scale`` stretches every limit (a loaded CPU rehearsing the GPU run)."""
    deadline = time.monotonic() + budget_s * scale
    report.setdefault("checks", {})
    report.setdefault("figures", {})
    for name in names:
        left = deadline - time.monotonic()
        limit = min(CHECKS[name].limit_s * scale, left)
        if left < 5:
            result = {"ok": False, "detail": f"no time left in the budget of {budget_s * scale:.0f} s"}
        else:
            print(f"[gpu check] {name} (limit {limit:.0f} s) ...", file=sys.stderr, flush=True)
            result = run_one(name, ctx, limit)
        report["checks"][name] = result
        report["figures"].update(result.get("figures") or {})
        report["passed"] = all(r.get("ok") is not False for r in report["checks"].values())
        report["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        write_json(ctx.out / "results.json", report)
        print(f"[gpu check] {name}: {_verdict(result.get('ok'))} ({result.get('seconds', 0)} s)",
              file=sys.stderr, flush=True)  # fmt: skip
    return report


def _verdict(ok: bool | None) -> str:
    return {True: "pass", False: "FAIL", None: "skipped"}[ok]


PLUGINS_ENV = "SLIPSTREAM_GPUCHECK_PLUGINS"  # comma-separated modules that register more checks


def load_checks() -> None:
    import importlib

    from slipstream.system import gpucheck  # noqa: F401  (registers the built-in checks)

    for module in filter(None, os.environ.get(PLUGINS_ENV, "").split(",")):
        importlib.import_module(module)


def main(argv: list[str] | None = None) -> int:
    load_checks()

    parser = argparse.ArgumentParser(
        prog="python -m slipstream.system.gpucheck", description=__doc__.split("\n")[0]
    )
    # Hand-written: which checks run where and for how long, no config key.
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--stage", type=int, choices=[1, 2], default=1)
    parser.add_argument("--only", default="", help="comma-separated checks (default: the stage's)")
    parser.add_argument("--small", action="store_true", help="small shapes (the CPU rehearsal)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "docs/gpu", help="folder of results.json")
    parser.add_argument("--work", help="work folder (default: a new one under /tmp)")
    parser.add_argument("--budget-s", type=float, help="seconds for all the checks (default: the stage's)")
    parser.add_argument("--limit-scale", type=float, default=1.0, help="stretch every limit (CPU rehearsal)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--limit-s", type=float, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(f"/tmp/slipstream-gpucheck-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    ctx = Context(args.device, args.small or args.device == "cpu", work, out, args.limit_s)
    if args.child:
        return child(args.child, ctx)
    names = [n for n in args.only.split(",") if n] or stage_checks(args.stage)
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        parser.error(f"unknown checks {unknown}; known: {list(CHECKS)}")
    results_path = out / "results.json"
    report = json.loads(results_path.read_text()) if results_path.exists() else {}
    report.update(date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), device=args.device,
                  small=ctx.small, stage=args.stage)  # fmt: skip
    budget = args.budget_s or STAGE_BUDGET_S[args.stage]
    report = run(names, ctx, budget, report, args.limit_scale)
    print(json.dumps({"passed": report.get("passed"), "figures": report.get("figures")}, default=str))
    return 0 if report.get("passed") else 1
