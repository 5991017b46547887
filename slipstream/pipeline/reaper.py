"""A watcher process that removes what a run left behind when its driver dies without cleaning up (SIGKILL,
the OOM killer).

Why: Ray ties the processes it starts for a local instance (GCS, raylet) to the driver's life, but the
agents the raylet starts (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) wait on the dead GCS and stay
forever, and so can any worker or server whose parent went first, since orphans are adopted by init and no
longer look like part of the run. The watcher remembers every descendant of the driver (pid and start
time, so a reused pid is never touched), refreshed every ``POLL_S``; once the driver is gone it kills those
still alive, whole trees, then exits. On a normal exit the driver has already stopped everything, and the
watcher finds nothing left to kill.

Started by `slipstream train` only, and only when the run starts Ray itself (a cluster's processes belong
to its nodes; a library caller's process may have children of its own).

    python -m slipstream.pipeline.reaper DRIVER_PID
"""

from __future__ import annotations

import os
import subprocess
import sys

POLL_S = 1.0


def start_reaper(driver_pid: int | None = None) -> subprocess.Popen:
    """Start the watcher for ``driver_pid`` (this process by default), detached from its process group so
    that a Ctrl-C aimed at the driver does not stop it first."""
    pid = os.getpid() if driver_pid is None else driver_pid
    return subprocess.Popen(
        [sys.executable, "-m", "slipstream.pipeline.reaper", str(pid)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def descendants(pid: int) -> dict[int, float]:
    """{pid: start time} of every process below ``pid`` (empty when it is gone)."""
    import psutil

    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return {}
    out = {}
    for child in children:
        try:
            out[child.pid] = child.create_time()
        except psutil.Error:
            continue
    return out


def kill_remembered(seen: dict[int, float]) -> int:
    """SIGKILL every remembered process still alive (same pid and start time) and its descendants."""
    import psutil

    doomed = []
    for pid, started in seen.items():
        if pid == os.getpid():
            continue
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == started:
                doomed.append(proc)
                doomed.extend(proc.children(recursive=True))
        except psutil.Error:
            continue
    for proc in doomed:
        try:
            proc.kill()
        except psutil.Error:
            pass
    return len(doomed)


def watch(driver_pid: int, poll_s: float = POLL_S) -> int:
    import psutil

    seen: dict[int, float] = {}
    try:
        driver = psutil.Process(driver_pid)
    except psutil.Error:
        return 0
    while driver.is_running() and driver.status() != psutil.STATUS_ZOMBIE:
        seen.update(descendants(driver_pid))
        try:
            driver.wait(timeout=poll_s)
        except psutil.TimeoutExpired:
            continue
    return kill_remembered(seen)


def main(argv: list[str]) -> int:
    watch(int(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
