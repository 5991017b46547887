"""The python tool's sandbox: limits hold, hostile programs do not get out, and where the boundary cannot be
built nothing runs.

Each escape test runs a program that tries an escape seen in practice and then checks the host: no file
written, no process killed, no connection on a loopback listener, no secret printed, no process left. Host
paths the programs aim at are world-writable and world-readable on purpose, so that only the sandbox can
be what stops them. They skip (saying why) only where this machine cannot build the boundary; the
fail-closed tests always run.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from slipstream.agents.config import AgentConfig
from slipstream.agents.tools import sandbox
from slipstream.agents.tools.python import PythonTool
from slipstream.agents.tools.sandbox import SandboxLimits, SandboxUnavailable, run_python, sandbox_problem

LIMITS = SandboxLimits(cpu_s=2.0, wall_s=20.0, memory_mb=256, max_output_chars=20000)


@pytest.fixture
def isolated():
    problem = sandbox_problem()
    if problem is not None:
        pytest.skip(f"the sandbox's isolation is unavailable on this machine: {problem}")


@pytest.fixture
def host_dir():
    """A host directory anyone may write: only the sandbox keeps a program from writing in it."""
    path = Path(tempfile.mkdtemp(prefix="slipstream-sandbox-test-", dir="/tmp"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run(code: str, limits: SandboxLimits = LIMITS, **kwargs) -> sandbox.SandboxResult:
    return asyncio.run(run_python(textwrap.dedent(code), limits, **kwargs))


def processes_with(marker: str) -> list[int]:
    """Host pids whose command line contains ``marker``."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                    found.append(int(name))
            except OSError:
                pass
    return found


def wait_until(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# --- the limits and the ordinary program ----------------------------------------------------------------


def test_runs_code_in_its_own_scratch_directory(isolated):
    result = run("""
        import os
        open('out.txt', 'w').write('hi')
        print(os.getcwd(), sorted(os.listdir('.')), 6 * 7)
    """)
    assert result.status == "ok", result.output
    # A Python installed under /tmp is bound at its own path, so it shows there (read-only).
    under_tmp = {
        Path(p).resolve().parts[2]
        for p in (sys.base_prefix, sys.prefix)
        if Path(p).resolve().parts[1] == "tmp"
    }
    expected = sorted({"main.py", "out.txt"} | under_tmp)
    assert result.output.strip() == f"/tmp {expected} 42"


def test_exit_status_tracebacks_threads_and_atexit(isolated):
    result = run("""
        import atexit, sys, threading
        atexit.register(lambda: print('atexit'))
        threading.Thread(target=lambda: print('thread')).start()
        sys.exit(3)
    """)
    assert result.status == "error" and result.returncode == 3
    assert result.output.splitlines() == ["thread", "atexit"]
    failed = run("def f():\n    return 1 / 0\nf()\n")
    assert failed.returncode == 1 and failed.output.startswith(
        'Traceback (most recent call last):\n  File "main.py"'
    )
    assert "ZeroDivisionError" in failed.output and "sandbox_launcher" not in failed.output


def test_runaway_loop_is_stopped_by_cpu_limit(isolated):
    assert run("while True:\n    pass\n", SandboxLimits(cpu_s=1.0)).status == "cpu_limit"


def test_sleeping_code_is_stopped_by_wall_time(isolated):
    result = run("import time\ntime.sleep(60)\n", SandboxLimits(cpu_s=5, wall_s=1.0))
    assert result.status == "timeout" and result.returncode == -9


def test_memory_and_output_limits(isolated):
    limits = SandboxLimits(memory_mb=256, max_output_chars=500)
    assert "MemoryError" in run("x = bytearray(2 << 30)", limits).output
    flood = run("while True:\n    print('x' * 1000)\n", limits)
    assert flood.status == "output_limit" and flood.truncated
    assert len(flood.output) < 700
    long = run("print('y' * 2000)", limits)
    assert long.status == "ok" and long.truncated and "[1501 characters cut]" in long.output


def test_only_scratch_is_writable_and_it_is_bounded(isolated):
    result = run(f"""
        import os, sys
        for path in ['/x', '/usr/x', '/etc/passwd', '/proc/x', {sys.prefix + "/x"!r}]:
            try:
                open(path, 'a').write('x')
                print('WROTE', path)
            except OSError as err:
                print(path, type(err).__name__, err.errno)
        try:
            with open('big', 'wb') as f:
                for _ in range(8):
                    f.write(b'x' * (1 << 20))
        except OSError as err:
            print('scratch', err.strerror)
    """, SandboxLimits(scratch_mb=2, max_file_mb=16))  # fmt: skip
    assert result.status == "ok", result.output
    assert "WROTE" not in result.output
    assert "scratch No space left on device" in result.output


def test_process_count_is_bounded(isolated):
    result = run("""
        import os, time
        children = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                children += 1
        except OSError as err:
            print('stopped after', children, type(err).__name__)
    """, SandboxLimits(max_processes=16, wall_s=20))  # fmt: skip
    assert result.status == "ok", result.output
    stopped = result.output.split()
    assert stopped[-1] == "BlockingIOError" and int(stopped[-2]) < 16


def test_runs_as_nobody_without_privileges(isolated):
    result = run("""
        import ctypes, os, socket
        status = dict(line.split(':', 1) for line in open('/proc/self/status'))
        for key in ('Uid', 'Gid', 'CapEff', 'CapPrm', 'CapBnd', 'NoNewPrivs', 'Seccomp'):
            print(key, status[key].split()[0])
        libc = ctypes.CDLL(None, use_errno=True)
        print('unshare', libc.unshare(0x10000000), ctypes.get_errno())   # CLONE_NEWUSER
        print('mount', libc.mount(b'none', b'/tmp', b'tmpfs', 0, None), ctypes.get_errno())
        try:
            socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        except OSError as err:
            print('inet', err.errno)
        socket.socketpair()
        print('hostname', socket.gethostname(), 'pid', os.getpid(), 'init', os.getppid())
    """)
    assert result.status == "ok", result.output
    lines = result.output.splitlines()
    assert lines[:7] == ["Uid 65534", "Gid 65534", "CapEff 0000000000000000", "CapPrm 0000000000000000",
                         "CapBnd 0000000000000000", "NoNewPrivs 1", "Seccomp 2"]  # fmt: skip
    assert lines[7:] == ["unshare -1 1", "mount -1 1", "inet 1", "hostname sandbox pid 2 init 1"]


# --- escapes ----------------------------------------------------------------------------------------------


def test_libc_system_through_a_ctypes_pointer_cannot_write_on_the_host(isolated, host_dir):
    target = host_dir / "pwned"
    result = run(f"""
        import ctypes
        libc = ctypes.CDLL(None)
        system = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p)(ctypes.cast(libc.system, ctypes.c_void_p).value)
        print('system returned', system(b"echo pwned > {target}; echo pwned > /tmp/local"))
        print('local', open('/tmp/local').read().strip())
    """)
    assert "local pwned" in result.output, result.output  # the shell ran, inside
    assert not target.exists()


def test_fork_exec_cannot_write_on_the_host(isolated, host_dir):
    target = host_dir / "pwned"
    result = run(f"""
        import os, subprocess, sys
        import _posixsubprocess
        command = [b'/bin/sh', b'-c', b'echo pwned > {target}; echo ran > /tmp/ran']
        if sys.version_info[:2] == (3, 11):  # the raw call the subprocess module makes
            r, w = os.pipe()
            pid = _posixsubprocess.fork_exec(command, [command[0]], True, (w,), None, None, -1, -1, -1, -1,
                                             -1, -1, r, w, True, False, -1, None, None, None, -1, None, False)
            os.waitpid(pid, 0)
        else:
            subprocess.run(command)
        print('child', open('/tmp/ran').read().strip())
    """)
    assert "child ran" in result.output, result.output
    assert not target.exists()


def test_nsenter_cannot_reach_a_host_loopback_listener(isolated):
    # The kernel completes a connection to a listening socket even before accept().
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    port = server.getsockname()[1]
    connect = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3); print('CONNECTED')"
    try:
        result = run(f"""
            import ctypes, os, subprocess, sys
            pids = sorted({{'1', str(os.getppid())}} | {{p for p in os.listdir('/proc') if p.isdigit()}})
            for pid in pids:
                out = subprocess.run(['nsenter', '-t', pid, '-n', sys.executable, '-c', {connect!r}],
                                     capture_output=True, text=True)
                print('nsenter', pid, out.returncode, out.stdout.strip(), out.stderr.strip()[-80:])
            libc = ctypes.CDLL(None, use_errno=True)
            for pid in pids:
                try:
                    fd = os.open(f'/proc/{{pid}}/ns/net', os.O_RDONLY)
                    print('setns', pid, libc.setns(fd, 0), ctypes.get_errno())
                except OSError as err:
                    print('setns', pid, err)
            try:
                exec({connect!r})
            except OSError as err:
                print('direct', err)
        """)
        assert "nsenter" in result.output and "setns" in result.output and "direct" in result.output, (
            result.output
        )
        assert "CONNECTED" not in result.output
        with pytest.raises(BlockingIOError):  # nobody connected
            server.accept()
    finally:
        server.close()


def test_proc_root_of_other_processes_cannot_write_on_the_host(isolated, host_dir):
    target = host_dir / "pwned"
    result = run(f"""
        import os
        pids = {{str(os.getppid()), '1', {str(os.getpid())!r}}} | {{p for p in os.listdir('/proc') if p.isdigit()}}
        for pid in sorted(pids):
            for link in ('root', 'cwd'):
                try:
                    open(f'/proc/{{pid}}/{{link}}{target}', 'w').write('pwned')
                    print('WROTE', pid, link)
                except OSError as err:
                    print(pid, link, type(err).__name__)
    """)
    assert "root" in result.output and "WROTE" not in result.output, result.output
    assert not target.exists()


def test_host_processes_cannot_be_killed(isolated):
    victims = [subprocess.Popen(["sleep", "600"])]
    if os.geteuid() == 0:  # same host uid as the sandbox's program: only the pid namespace stands between
        victims.append(subprocess.Popen(["sleep", "600"], user=65534, group=65534, extra_groups=[]))
    try:
        pids = [v.pid for v in victims]
        result = run(f"""
            import os, signal
            for pid in {pids} + [1, -1]:
                try:
                    os.kill(pid, signal.SIGKILL)
                    print('sent', pid)
                except OSError as err:
                    print(pid, type(err).__name__)
            print('still here')
        """)
        assert "still here" in result.output, result.output
        assert all(v.poll() is None for v in victims)
    finally:
        for v in victims:
            v.kill()
            v.wait()


def test_signalling_its_own_process_group_only_ends_the_program(isolated):
    result = run("""
        import os, signal
        print('pgid is own session', os.getpgid(0) == os.getsid(0), flush=True)
        os.kill(0, signal.SIGKILL)
    """)
    assert result.status == "killed" and result.returncode == -9
    assert result.output == "pgid is own session True\n"


def test_host_secrets_are_not_visible(isolated, host_dir, monkeypatch):
    secret = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("SLIPSTREAM_TEST_SECRET", secret)
    (host_dir / "secret.txt").write_text(secret)
    (host_dir / "secret.txt").chmod(0o644)
    result = run(f"""
        import os
        print('env', dict(os.environ))
        for pid in [p for p in os.listdir('/proc') if p.isdigit()]:
            try:
                print('environ', pid, open(f'/proc/{{pid}}/environ', 'rb').read())
            except OSError as err:
                print('environ', pid, type(err).__name__)
        for path in ('/etc/shadow', {str(host_dir / "secret.txt")!r}, '/root/.bash_history'):
            try:
                print('LEAKED', path, open(path).read())
            except OSError as err:
                print(path, type(err).__name__)
        print('root', sorted(os.listdir('/root')))
        print('etc', sorted(os.listdir('/etc')))
        print('top', sorted(os.listdir('/')))
    """)
    assert result.status == "ok", result.output
    assert secret not in result.output and "LEAKED" not in result.output
    assert "/etc/shadow FileNotFoundError" in result.output
    listed = {line.split(" ", 1)[0]: eval(line.split(" ", 1)[1]) for line in result.output.splitlines()
              if line.split(" ", 1)[0] in ("root", "etc", "top")}  # fmt: skip
    # /root holds at most the path down to the interpreter (bound read-only), none of the host's files
    assert set(listed["root"]) <= {Path(p).relative_to("/root").parts[0] for p in (sys.base_prefix, sys.prefix)
                                   if Path(p).is_relative_to("/root")}  # fmt: skip
    assert set(listed["etc"]) <= {"ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "alternatives",
                                  "passwd", "group", "hosts", "hostname"}  # fmt: skip
    prefixes = {Path(p).parts[1] for p in (sys.base_prefix, sys.prefix)}
    system = {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "dev", "proc", "tmp"}
    assert set(listed["top"]) <= system | prefixes


def test_no_process_outlives_a_timeout(isolated):
    marker = f"slipstream-test-{uuid.uuid4().hex}"
    code = textwrap.dedent(f"""
        import os, subprocess, sys, time
        subprocess.Popen(['/bin/sh', '-c', 'sleep 1000', {marker!r}], start_new_session=True)
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(1000)', {marker!r}])
            os._exit(0)
        def running():
            return sum(1 for p in os.listdir('/proc') if p.isdigit() and
                       {marker!r}.encode() in open(f'/proc/{{p}}/cmdline', 'rb').read())
        while running() < 2:
            time.sleep(0.01)
        print('started', flush=True)
        time.sleep(1000)
    """)

    async def main():
        task = asyncio.create_task(run_python(code, SandboxLimits(wall_s=15.0)))
        while len(processes_with(marker)) < 2 and not task.done():  # wait for the children to exist
            await asyncio.sleep(0.02)
        seen = processes_with(marker)
        uids = {Path(f"/proc/{pid}/status").read_text().split("Uid:")[1].split()[1] for pid in seen}
        return await task, seen, uids

    result, seen, uids = asyncio.run(main())
    assert result.status == "timeout" and "started" in result.output, result.output
    assert len(seen) == 2
    assert uids == {"65534" if os.geteuid() == 0 else str(os.geteuid())}  # host uid of the program's children
    assert wait_until(lambda: not processes_with(marker)), processes_with(marker)


def test_no_process_outlives_a_normal_exit(isolated):
    marker = f"slipstream-test-{uuid.uuid4().hex}"
    result = run(f"""
        import os, subprocess, sys
        p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1000)', {marker!r}],
                             start_new_session=True)
        print('child', p.pid)
    """)
    assert result.status == "ok" and "child" in result.output, result.output
    assert wait_until(lambda: not processes_with(marker)), processes_with(marker)


def test_no_process_outlives_a_cancelled_call(isolated):
    marker = f"slipstream-test-{uuid.uuid4().hex}"
    code = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'import time; time.sleep(1000)', {marker!r}])\n"

    async def main():
        task = asyncio.create_task(run_python(code, SandboxLimits(wall_s=60.0)))
        while not processes_with(marker) and not task.done():
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert wait_until(lambda: not processes_with(marker)), processes_with(marker)


# --- failing closed ---------------------------------------------------------------------------------------


@pytest.fixture
def fresh_check():
    sandbox_problem.cache_clear()
    yield
    sandbox_problem.cache_clear()


def test_missing_user_namespaces_fail_closed(tmp_path, monkeypatch, fresh_check):
    disabled = tmp_path / "max_user_namespaces"
    disabled.write_text("0\n")
    monkeypatch.setattr(sandbox, "MAX_USER_NAMESPACES", disabled)
    with pytest.raises(
        SandboxUnavailable, match=r"user\.max_user_namespaces = 0.*sandbox_unsafe_no_isolation"
    ):
        asyncio.run(run_python("print('ran')", LIMITS))
    with pytest.raises(SandboxUnavailable, match="user namespaces are disabled"):
        PythonTool(AgentConfig(tools=["python"]))
    # The named opt-out runs the code with the limits only.
    tool = PythonTool(AgentConfig(tools=["python"], sandbox_unsafe_no_isolation=True))
    assert (
        asyncio.run(
            tool.call({"code": "import os; print(os.getcwd().startswith('/tmp/slipstream-sandbox-'))"})
        )
        == "True\n"
    )


def test_missing_libseccomp_fails_closed(monkeypatch, fresh_check):
    real_cdll = sandbox.ctypes.CDLL

    def cdll(name, *args, **kwargs):
        if "seccomp" in str(name):
            raise OSError(f"{name}: cannot open shared object file")
        return real_cdll(name, *args, **kwargs)

    monkeypatch.setattr(sandbox.ctypes, "CDLL", cdll)
    monkeypatch.setattr(
        sandbox, "_sysctl", lambda path: 1000
    )  # user namespaces allowed: libseccomp is what lacks
    with pytest.raises(SandboxUnavailable, match="libseccomp.*apt-get install libseccomp2"):
        asyncio.run(run_python("print('ran')", LIMITS))


def test_a_kernel_refusing_user_namespaces_fails_closed():
    """As in a container whose seccomp profile refuses unshare: the launcher itself finds out and says so."""
    if sandbox.host_problem() is not None:
        pytest.skip(f"cannot simulate here: {sandbox.host_problem()}")
    script = textwrap.dedent(f"""
        import asyncio, importlib.util
        spec = importlib.util.spec_from_file_location('launcher', {str(sandbox.LAUNCHER)!r})
        launcher = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(launcher)
        assert launcher.load_seccomp([('unshare', launcher.SCMP_ACT_ERRNO | launcher.EPERM, [])]) is None
        from slipstream.agents.tools.sandbox import SandboxLimits, SandboxUnavailable, run_python, sandbox_problem
        print('problem:', sandbox_problem())
        try:
            asyncio.run(run_python('print("RAN")', SandboxLimits()))
        except SandboxUnavailable as err:
            print('raised:', err)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "problem: cannot create the sandbox's namespaces: unshare(CLONE_NEWUSER) failed" in out.stdout
    assert "raised: python tool sandbox unavailable" in out.stdout and "RAN" not in out.stdout
    assert "sysctl -w user.max_user_namespaces" in out.stdout
