"""Run model-written Python in a separate, limited process: no network, bounded CPU, memory, time, output.

The code a policy writes during RL is adversarial by accident: infinite loops, huge allocations, endless
printing, and now and then ``import os; os.system(...)``. Each call runs in a fresh interpreter
(``python -I``, started with asyncio so the event loop never blocks) inside its own temporary directory,
through a small launcher that, before the code runs, applies in order:

1. **namespaces**, where the process may create them (root, or a kernel that lets users do so): a new
   network namespace (``unshare(CLONE_NEWNET)``: only a loopback that is down, so nothing is reachable)
   and a private mount table in which every mount is read-only except the code's own directory (so code
   running as root cannot change the machine's files);
2. **limits**: ``RLIMIT_CPU`` (SIGXCPU ends it), ``RLIMIT_AS`` (allocations fail with MemoryError),
   ``RLIMIT_FSIZE``, no core files;
3. **audit hook** (``sys.addaudithook``, which cannot be removed once added): creating a socket, starting
   a process (``subprocess``, ``os.system``, ``os.exec*``, ``fork``) and loading native libraries with
   ``ctypes`` raise PermissionError. This is the network barrier where namespaces are not permitted;
4. **user**: when started as root, and the interpreter is readable by ``nobody``, the code runs as
   ``nobody`` so it cannot write outside its directory.

The parent enforces wall time (the whole process group is killed) and output size (merged stdout and
stderr are read incrementally; past the cap the process is killed and the output truncated).
:func:`isolation_report` says which layers this machine permits.

What this is not: a security boundary against a determined attacker (the audit hook is in-process and a
determined C extension could get around it; where namespaces are available they are the real barrier).
Use a container or VM sandbox (gVisor, Firecracker) in front of untrusted production workloads.

Worked example::

    result = await run_python("print(sum(range(10)))", SandboxLimits())
    result.output        # "45\\n"
    result.status        # "ok"
"""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from slipstream.agents.tools.base import truncate_middle

# The launcher runs inside the child, before the user's code; argv: cpu_s memory_bytes fsize_bytes user.
_LAUNCHER = r"""
import ctypes, os, resource, sys
cpu_s, mem, fsize, drop_user = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
netns = readonly = False
try:
    libc = ctypes.CDLL(None, use_errno=True)
    netns = libc.unshare(0x40000000) == 0  # CLONE_NEWNET
    if libc.unshare(0x00020000) == 0:  # CLONE_NEWNS: a private mount table
        MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
        here = os.getcwd()
        ok = libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) == 0
        ok = ok and libc.mount(here.encode(), here.encode(), None, MS_BIND, None) == 0
        with open("/proc/self/mountinfo", "rb") as f:
            points = [line.split()[4].decode("unicode_escape").encode("latin-1") for line in f]
        for point in points:
            if ok and point != here.encode():
                ok = libc.mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY, None) == 0
        readonly = ok
        os.chdir(here)  # enter the writable bind mount (the old cwd is the directory beneath it)
    del libc
except Exception:
    pass
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if drop_user:
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
_BLOCKED = frozenset({
    "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto",
    "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "pty.spawn", "ctypes.dlopen", "ctypes.dlsym", "sys.addaudithook",
})
def _hook(event, args):
    if event in _BLOCKED:
        raise PermissionError(f"sandbox: {event} is not allowed")
sys.addaudithook(_hook)
if os.environ.get("SLIPSTREAM_SANDBOX_REPORT"):
    print(f"netns={int(netns)} readonly={int(readonly)} user={os.getuid()}")
del ctypes, resource, cpu_s, mem, fsize, drop_user, netns, readonly, _hook
sys.argv = ["main.py"]
with open("main.py", encoding="utf-8") as _f:
    _code = compile(_f.read(), "main.py", "exec")
del _f
exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
"""

# Bytes read from the child before it is killed for printing too much (the tool shows fewer characters).
OUTPUT_HARD_CAP = 1 << 20


class SandboxLimits(msgspec.Struct, kw_only=True, frozen=True):
    cpu_s: float = 5.0
    wall_s: float = 10.0
    memory_mb: int = 512
    # Output (stdout and stderr merged) beyond this many characters is cut in the middle, with a note.
    max_output_chars: int = 2048
    # Largest file the code may write in its directory.
    max_file_mb: int = 16


class SandboxResult(msgspec.Struct, kw_only=True):
    output: str
    # ok | error (non-zero exit) | timeout (wall time) | cpu_limit | output_limit | killed (other signal)
    status: str
    returncode: int | None
    wall_s: float
    truncated: bool = False


def _readable_by_others(path: Path) -> bool:
    """Whether user ``nobody`` could read ``path`` (every ancestor searchable, the path itself readable)."""
    try:
        parts = [path, *path.parents]
        if not all(p.stat().st_mode & stat.S_IXOTH for p in parts if p.is_dir()):
            return False
        return bool(path.stat().st_mode & stat.S_IROTH)
    except OSError:
        return False


def _should_drop_user() -> bool:
    if os.geteuid() != 0:
        return False
    stdlib = Path(os.__file__).resolve().parent
    return _readable_by_others(Path(sys.executable).resolve()) and _readable_by_others(stdlib)


def _child_env(workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


async def run_python(code: str, limits: SandboxLimits, *, report: bool = False) -> SandboxResult:
    """Run ``code`` in the sandbox and return its (truncated) output and how it ended. Never raises for
    anything the code does."""
    drop_user = _should_drop_user()
    with tempfile.TemporaryDirectory(prefix="slipstream-sandbox-") as workdir:
        Path(workdir, "main.py").write_text(code, encoding="utf-8")
        if drop_user:
            os.chown(workdir, 65534, 65534)
            os.chown(Path(workdir, "main.py"), 65534, 65534)
        env = _child_env(workdir)
        if report:
            env["SLIPSTREAM_SANDBOX_REPORT"] = "1"
        cpu = max(1, int(round(limits.cpu_s)))
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", _LAUNCHER, str(cpu), str(limits.memory_mb << 20),
            str(limits.max_file_mb << 20), "1" if drop_user else "0",
            cwd=workdir, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        data, reason = await _collect(proc, limits.wall_s)
        returncode = await _reap(proc)
        wall = time.monotonic() - start
    return _result(data, reason, returncode, wall, limits)


async def _collect(proc: asyncio.subprocess.Process, wall_s: float) -> tuple[bytes, str | None]:
    """Read the child's output until it closes, the wall time passes or the output cap is hit."""
    chunks: list[bytes] = []
    size = 0
    deadline = time.monotonic() + wall_s
    assert proc.stdout is not None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            _kill_group(proc)
            return b"".join(chunks), "timeout"
        try:
            chunk = await asyncio.wait_for(proc.stdout.read(65536), remaining)
        except TimeoutError:
            _kill_group(proc)
            return b"".join(chunks), "timeout"
        if not chunk:
            return b"".join(chunks), None
        chunks.append(chunk)
        size += len(chunk)
        if size > OUTPUT_HARD_CAP:
            _kill_group(proc)
            return b"".join(chunks), "output_limit"


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def _reap(proc: asyncio.subprocess.Process) -> int | None:
    """Wait for the (possibly killed) child. asyncio reports the exit only once its pipe is closed, so
    whatever a killed child left in the pipe is read and discarded first."""

    async def drain_and_wait() -> int:
        assert proc.stdout is not None
        while await proc.stdout.read(65536):
            pass
        return await proc.wait()

    try:
        return await asyncio.wait_for(drain_and_wait(), 10.0)
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


async def isolation_report() -> dict[str, bool]:
    """Which isolation layers this machine permits: ``netns``, ``readonly`` (file system) and ``nobody``
    (the audit hook and the limits always apply)."""
    result = await run_python("", SandboxLimits(), report=True)
    fields = dict(part.split("=") for part in result.output.split() if "=" in part)
    return {
        "netns": fields.get("netns") == "1",
        "readonly": fields.get("readonly") == "1",
        "nobody": fields.get("user") == "65534",
    }
