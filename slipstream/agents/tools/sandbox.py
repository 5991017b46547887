"""Run model-written Python behind a kernel-enforced boundary, with bounded CPU, memory, time and output.

Agentic RL runs code a policy wrote, by the million; some of it is hostile by accident or by search
(``os.system``, ctypes, ``/proc/<pid>/root``, ``nsenter``, ``setsid`` children, fork bombs). So each call
runs in a fresh interpreter inside namespaces, built by ``sandbox_launcher.py`` (its docstring has the
process tree), and the program runs with:

- **its own user, pid, mount, network, IPC, UTS and cgroup namespaces**: it sees only its own processes
  (so it can neither signal nor enter a host process), has only a loopback that is down (no network at
  all) and cannot reach host IPC objects;
- **uid and gid 65534 with no capabilities and no_new_privs**: host uid 65534 when the caller is root;
  setuid files and file capabilities grant nothing;
- **a read-only file system** of system directories and the Python prefixes only; no ``/root``,
  ``/home``, project or host ``/etc`` files (a synthetic ``passwd``); ``/tmp`` is its working directory
  and the one writable place, a tmpfs of ``scratch_mb``;
- **a seccomp filter** refusing namespace, mount, tracing, keyring, eBPF, io_uring and module system
  calls, other architectures' system calls and every socket family but ``AF_UNIX``;
- **an environment of constants** (``PATH``, ``HOME``, ``LANG``, thread counts): no host variable;
- **limits**: ``RLIMIT_CPU`` (SIGXCPU ends it), ``RLIMIT_AS`` (MemoryError), ``RLIMIT_FSIZE``,
  ``RLIMIT_NPROC``, no core files; the parent enforces wall time and output size.

On time-out (or too much output) the whole process tree is killed: the pid namespace's init is killed,
which makes the kernel kill every process in it, and :func:`run_python` returns only once the launcher,
which outlives all of them, has exited. A program that ends normally leaves nothing behind either.

Fail closed: where the boundary cannot be built (no user namespaces, a masked ``/proc``, no libseccomp,
not Linux) nothing runs and :class:`SandboxUnavailable` says what is missing and how to enable it.
:func:`sandbox_problem` asks once per process; the python tool asks at construction, so a run stops
at start rather than feeding the model errors. ``unsafe_no_isolation=True`` (config
``agent.sandbox_unsafe_no_isolation``, off by default) runs only the limits, for trusted code only.

Worked example::

    result = await run_python("print(sum(range(10)))", SandboxLimits())
    result.output        # "45\\n"
    result.status        # "ok"
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from slipstream.agents.tools.base import truncate_middle

LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
# Bytes read from the child before it is killed for printing too much (the tool shows fewer characters).
OUTPUT_HARD_CAP = 1 << 20
# How long a stopped sandbox may take to tear down before its process group is SIGKILLed.
STOP_GRACE_S = 10.0
MAX_USER_NAMESPACES = Path("/proc/sys/user/max_user_namespaces")
UNPRIVILEGED_USERNS_CLONE = Path("/proc/sys/kernel/unprivileged_userns_clone")
OPT_OUT = (
    "The python tool never runs code without its boundary; for trusted code only, "
    "agent.sandbox_unsafe_no_isolation=true turns it off."
)


class SandboxUnavailable(RuntimeError):
    """The sandbox's isolation cannot be had on this machine; the message says what is missing."""


class SandboxLimits(msgspec.Struct, kw_only=True, frozen=True):
    cpu_s: float = 5.0
    wall_s: float = 10.0
    memory_mb: int = 512
    # Output (stdout and stderr merged) beyond this many characters is cut in the middle, with a note.
    max_output_chars: int = 2048
    # Largest file the code may write.
    max_file_mb: int = 16
    # Size of the writable /tmp (a tmpfs, so it is memory).
    scratch_mb: int = 64
    # Processes (and threads) the program may have at once, the sandbox's init included.
    max_processes: int = 64


class SandboxResult(msgspec.Struct, kw_only=True):
    output: str
    # ok | error (non-zero exit) | timeout (wall time) | cpu_limit | output_limit | killed (other signal)
    status: str
    returncode: int | None
    wall_s: float
    truncated: bool = False


def _spec(limits: SandboxLimits, report_fd: int, isolate: bool) -> list[str]:
    """The launcher's arguments (``key=value``, all integers)."""
    values = {
        "report_fd": report_fd, "parent": os.getpid(), "isolate": int(isolate),
        "cpu_s": max(1, int(round(limits.cpu_s))), "memory_bytes": limits.memory_mb << 20,
        "file_bytes": limits.max_file_mb << 20, "scratch_bytes": limits.scratch_mb << 20,
        "processes": limits.max_processes,
    }  # fmt: skip
    return [f"{key}={value}" for key, value in values.items()]


def _child_env() -> dict[str, str]:
    """The program's whole environment: constants only (the launcher sets HOME and TMPDIR)."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def host_problem() -> str | None:
    """What this host lacks for the boundary, as far as can be told without starting it (cheap)."""
    if not sys.platform.startswith("linux"):
        return f"the sandbox needs Linux namespaces; this is {sys.platform}"
    if _sysctl(MAX_USER_NAMESPACES) == 0:
        return "user namespaces are disabled (user.max_user_namespaces = 0): sysctl -w user.max_user_namespaces=15000"
    if os.geteuid() != 0 and _sysctl(UNPRIVILEGED_USERNS_CLONE) == 0:
        return (
            "unprivileged user namespaces are disabled (kernel.unprivileged_userns_clone = 0): "
            "sysctl -w kernel.unprivileged_userns_clone=1"
        )
    try:
        ctypes.CDLL("libseccomp.so.2")
    except OSError:
        return "libseccomp (libseccomp.so.2) is not installed: apt-get install libseccomp2 (or dnf install libseccomp)"
    return None


def _sysctl(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


@functools.cache
def sandbox_problem() -> str | None:
    """None when the boundary can be built here, else what is missing and how to enable it. Starts one
    empty sandbox the first time (tens of milliseconds), then answers from memory."""
    problem = host_problem()
    if problem is not None:
        return problem
    read_fd, write_fd = os.pipe()
    try:
        proc = subprocess.run(
            [sys.executable, "-I", str(LAUNCHER), *_spec(SandboxLimits(), write_fd, True)],
            input=b"", stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_child_env(),
            pass_fds=(write_fd,), start_new_session=True, timeout=60,
        )  # fmt: skip
    finally:
        os.close(write_fd)
    report = _read_report(read_fd)
    if "error" in report:
        return report["error"]
    if report.get("exit") != "0":
        return f"an empty program failed in the sandbox (status {proc.returncode}): {proc.stdout.decode()[-2000:]}"
    return None


def require_sandbox() -> None:
    """Raise :class:`SandboxUnavailable` unless the boundary can be built on this machine."""
    problem = sandbox_problem()
    if problem is not None:
        raise SandboxUnavailable(f"python tool sandbox unavailable: {problem}. {OPT_OUT}")


async def run_python(code: str, limits: SandboxLimits, *, unsafe_no_isolation: bool = False) -> SandboxResult:
    """Run ``code`` in the sandbox and return its (truncated) output and how it ended. Never raises for
    anything the code does; raises :class:`SandboxUnavailable` when the boundary cannot be built.
    ``unsafe_no_isolation`` runs the code with the limits only: for trusted code, never a model's."""
    if not unsafe_no_isolation and (problem := host_problem()) is not None:
        raise SandboxUnavailable(f"python tool sandbox unavailable: {problem}. {OPT_OUT}")
    read_fd, write_fd = os.pipe()
    try:
        start = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", str(LAUNCHER), *_spec(limits, write_fd, not unsafe_no_isolation),
                env=_child_env(), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True, pass_fds=(write_fd,),
            )  # fmt: skip
        finally:
            os.close(write_fd)
        try:
            await _send_code(proc, code)
            data, reason = await _collect(proc, limits.wall_s)
            returncode = await _reap(proc)
        except BaseException:  # cancelled mid-call (e.g. the caller's own time-out): stop it all the same
            _stop(proc)
            await _reap(proc)
            raise
        wall = time.monotonic() - start
        report = _read_report(read_fd)
    finally:
        os.close(read_fd)
    if "error" in report:
        raise SandboxUnavailable(f"python tool sandbox unavailable: {report['error']}. {OPT_OUT}")
    if reason is None and not report:
        raise SandboxUnavailable(
            f"the sandbox ended without reporting the program's status (launcher exit {returncode}): "
            f"{data.decode(errors='replace')[-2000:]}"
        )
    if report:
        returncode = -int(report["signal"]) if "signal" in report else int(report["exit"])
    else:  # stopped by us: the program was SIGKILLed with its namespace
        returncode = -signal.SIGKILL
    return _result(data, reason, returncode, wall, limits)


async def _send_code(proc: asyncio.subprocess.Process, code: str) -> None:
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # it died at start: reported below
        proc.stdin.write(code.encode("utf-8", errors="surrogatepass"))
        await proc.stdin.drain()
        proc.stdin.close()


def _read_report(fd: int) -> dict[str, str]:
    """The launcher's one line as ``{kind: value}``, if any (every writer has exited or is being killed:
    never block)."""
    os.set_blocking(fd, False)
    chunks = []
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    lines = b"".join(chunks).decode(errors="replace").splitlines()
    if not lines:
        return {}
    kind, _, value = lines[0].partition(" ")
    return {kind: value}


async def _collect(proc: asyncio.subprocess.Process, wall_s: float) -> tuple[bytes, str | None]:
    """Read the child's output until it closes, the wall time passes or the output cap is hit."""
    chunks: list[bytes] = []
    size = 0
    deadline = time.monotonic() + wall_s
    assert proc.stdout is not None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            _stop(proc)
            return b"".join(chunks), "timeout"
        try:
            chunk = await asyncio.wait_for(proc.stdout.read(65536), remaining)
        except TimeoutError:
            _stop(proc)
            return b"".join(chunks), "timeout"
        if not chunk:
            return b"".join(chunks), None
        chunks.append(chunk)
        size += len(chunk)
        if size > OUTPUT_HARD_CAP:
            _stop(proc)
            return b"".join(chunks), "output_limit"


def _stop(proc: asyncio.subprocess.Process) -> None:
    """Ask the launcher to tear the sandbox down: it has the keeper kill the pid namespace's init."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # the rest follows by parent-death signals


async def _reap(proc: asyncio.subprocess.Process) -> int | None:
    """Wait for the (possibly stopped) launcher, which exits after everything below it. asyncio reports
    the exit only once its pipe is closed, so whatever is left in the pipe is read and discarded."""

    async def drain_and_wait() -> int:
        assert proc.stdout is not None
        while await proc.stdout.read(65536):
            pass
        return await proc.wait()

    try:
        return await asyncio.wait_for(drain_and_wait(), STOP_GRACE_S)
    except TimeoutError:
        _kill_group(proc)
        return None


def _result(
    data: bytes, reason: str | None, returncode: int | None, wall: float, limits: SandboxLimits
) -> SandboxResult:
    text = data.decode("utf-8", errors="replace")
    truncated = len(text) > limits.max_output_chars
    text = truncate_middle(text, limits.max_output_chars)
    if reason is None:
        if returncode == 0:
            reason = "ok"
        elif returncode == -signal.SIGXCPU:
            reason = "cpu_limit"
        elif returncode is not None and returncode < 0:
            reason = "killed"
        else:
            reason = "error"
    return SandboxResult(output=text, status=reason, returncode=returncode, wall_s=wall, truncated=truncated)
