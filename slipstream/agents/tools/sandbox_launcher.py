"""The python tool's sandbox, child side: builds the boundary, then runs the model's code inside it.

``sandbox.py`` starts this file as ``python -I sandbox_launcher.py key=value...`` (integers: the limits,
``report_fd``, ``parent``, ``isolate``) with the code on stdin, the program's output on stdout/stderr and
one more pipe, the *report* fd, on which exactly one line comes back: ``exit N``, ``signal N`` or
``error MESSAGE`` (the boundary could not be built; nothing ran). The program never holds the report fd,
so it cannot forge a report. It starts once per call, so it imports only small standard modules.

Process tree; each level waits for the one below it::

    launcher   host uid, host namespaces; writes the uid/gid maps of the new user namespace
     └ keeper  unshare(user, mount, pid, net, ipc, uts, cgroup); on SIGTERM kills the init below
        └ init     pid 1 of the new pid namespace: builds a read-only root, drops to uid 65534 with no
           │       capabilities and no_new_privs, loads the seccomp filter; reports the program's status
           └ program  rlimits (CPU, address space, file size, processes), cwd /tmp, runs the code

Every process gets SIGKILL when its parent dies (``PR_SET_PDEATHSIG``; the init, which changes uid and
so loses that setting once, checks a lifeline pipe from the keeper after setting it again). When the
init exits, the kernel kills everything left in its pid namespace before the keeper can reap it, so a
launcher that has exited leaves no process behind: not on time-out (the keeper kills the init), and not
after a normal end (a ``setsid`` grandchild dies with its namespace).

The file system is a fresh tmpfs made read-only, holding read-only binds of ``/usr``, ``/lib*``,
``/bin``, ``/sbin``, the Python prefixes (the interpreter, its standard library and site-packages), a few
files of ``/etc`` the dynamic loader needs, ``/dev/{null,zero,full,random,urandom}``, a new ``/proc``
(only the sandbox's processes) and a size-limited tmpfs at ``/tmp``, the only writable place. In the
new network namespace the only interface is a loopback that is down. Host root runs the program as
host uid 65534; anyone else runs it as their own uid (mapped to 65534 inside), which cannot be helped
without a setuid helper: the read-only, mostly empty file system is then what protects their files.

Why by hand: bubblewrap and minijail do this, but neither is on PyPI and hosts may not have them.
util-linux ``unshare`` cannot map a root caller to an unprivileged host uid without ``newuidmap`` (a
separate package) and cannot build a root file system, so the launcher makes the same system calls
itself through ctypes. Seccomp uses the system's libseccomp (present wherever apt or systemd is): the
PyPI wrapper ``pyseccomp`` looks the library up by spawning ``ldconfig`` at import, 20-50 ms a call.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import resource
import select
import signal
import sys
import types

SANDBOX_ID = 65534  # uid and gid of the program inside the user namespace ("nobody")
EXIT_SETUP = 125  # exit status of a process that reported {"error": ...}

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x08000000, 0x10000000, 0x20000000, 0x40000000
# Every namespace the keeper creates, user first (the others are then owned by it), by name for errors.
NAMESPACES = {
    CLONE_NEWUSER: "CLONE_NEWUSER", CLONE_NEWNS: "CLONE_NEWNS", CLONE_NEWPID: "CLONE_NEWPID",
    CLONE_NEWNET: "CLONE_NEWNET", CLONE_NEWIPC: "CLONE_NEWIPC", CLONE_NEWUTS: "CLONE_NEWUTS",
    CLONE_NEWCGROUP: "CLONE_NEWCGROUP",
}  # fmt: skip
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_REC, MS_PRIVATE, MNT_DETACH = 16384, 1 << 18, 2
# Flags a bind remount must repeat: the kernel locks them on mounts inherited from a more privileged
# namespace, and a remount that would clear one fails with EPERM.
LOCKED_FLAGS = os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC | os.ST_NOATIME | os.ST_NODIRATIME | os.ST_RELATIME
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 1, 24, 38, 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # syscall numbers; glibc has no wrapper

TOP_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "alternatives")
DEVICES = ("null", "zero", "full", "random", "urandom")
ETC_WRITTEN = {
    "passwd": f"sandbox:x:{SANDBOX_ID}:{SANDBOX_ID}:sandbox:/tmp:/bin/sh\n",
    "group": f"sandbox:x:{SANDBOX_ID}:\n",
    "hosts": "127.0.0.1 localhost\n::1 localhost\n",
    "hostname": "sandbox\n",
}

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """The boundary could not be built; the message names what is missing and how to enable it."""


def _call(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _prctl(option: int, arg: int = 0) -> None:
    _call(libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})")


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if s is None else s.encode() for s in (src, target, fstype, data)]
    _call(libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def report(fd: int, kind: str, value: object) -> None:
    """One report line: ``exit N``, ``signal N`` or ``error MESSAGE`` (one line)."""
    os.write(fd, f"{kind} {value}".replace("\n", " ").encode() + b"\n")


def fail(fd: int, message: str) -> None:
    """Report a setup failure and end this process (and so, by the parent-death signals, those below)."""
    report(fd, "error", message)
    os._exit(EXIT_SETUP)


# --- launcher -------------------------------------------------------------------------------------------


def main() -> None:
    spec = {key: int(value) for key, value in (arg.split("=") for arg in sys.argv[1:])}
    fd = spec["report_fd"]
    _die_with(spec["parent"])
    code = sys.stdin.buffer.read()
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if not spec["isolate"]:
        _run_unisolated(spec, code)
    sync_r, sync_w = os.pipe()  # keeper -> launcher: namespaces made
    go_r, go_w = os.pipe()  # launcher -> keeper: maps written
    launcher = os.getpid()
    _hold_sigterm()
    pid = os.fork()
    if pid == 0:
        os.close(sync_r)
        os.close(go_w)
        _keeper(spec, code, launcher, sync_w, go_r)
    os.close(sync_w)
    os.close(go_r)
    _on_sigterm(lambda *_: _kill(pid, signal.SIGTERM))
    if os.read(sync_r, 1) == b"u":  # else the keeper failed and reported why
        try:
            _write_id_maps(pid)
        except OSError as err:
            _kill(pid, signal.SIGKILL)
            fail(fd, f"cannot map the sandbox's user ids ({err}); the user namespace cannot be used")
        os.write(go_w, b"g")
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def _die_with(parent: int) -> None:
    """SIGKILL this process when its parent dies (and end now if it already has)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(EXIT_SETUP)


def _hold_sigterm() -> None:
    """Hold SIGTERM (the parent's request to stop) across a fork until :func:`_on_sigterm` is ready for it,
    so a request that comes in between is forwarded, not lost with a half-started child."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def _on_sigterm(handler) -> None:
    signal.signal(signal.SIGTERM, handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _write_id_maps(pid: int) -> None:
    """Map the sandbox's uid/gid 65534 to host 65534 (root) or to the caller's own ids (anyone else: the
    only mapping the kernel lets them write). Nothing else is mapped: host root's files appear owned by
    nobody, and a process that gains uid 0 inside is still unmapped outside."""
    root = os.geteuid() == 0
    outer_uid = SANDBOX_ID if root else os.geteuid()
    outer_gid = SANDBOX_ID if root else os.getegid()
    for name, text in (
        ("setgroups", "deny"),
        ("uid_map", f"{SANDBOX_ID} {outer_uid} 1"),
        ("gid_map", f"{SANDBOX_ID} {outer_gid} 1"),
    ):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(text)


def _run_unisolated(spec: dict, code: bytes) -> None:
    """UNSAFE opt-out for trusted code: only the limits and a temporary directory, no boundary."""
    import shutil
    import tempfile

    workdir = tempfile.mkdtemp(prefix="slipstream-sandbox-")
    _hold_sigterm()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        _program(spec, code, workdir, new_main=True)
    _on_sigterm(lambda *_: _kill(-pid, signal.SIGKILL))
    _, status = os.waitpid(pid, 0)
    _kill(-pid, signal.SIGKILL)  # what it left in its session
    shutil.rmtree(workdir, ignore_errors=True)
    _report_status(spec["report_fd"], status)
    os._exit(0)


def _report_status(fd: int, status: int) -> None:
    if os.WIFSIGNALED(status):
        report(fd, "signal", os.WTERMSIG(status))
    else:
        report(fd, "exit", os.waitstatus_to_exitcode(status))


# --- keeper ---------------------------------------------------------------------------------------------


def _keeper(spec: dict, code: bytes, launcher: int, sync_w: int, go_r: int) -> None:
    fd = spec["report_fd"]
    _die_with(launcher)
    if os.geteuid() == 0:
        os.setgroups([])  # inside a user namespace supplementary groups can no longer be dropped
    err = libc.unshare(sum(NAMESPACES)) and ctypes.get_errno()
    if err:
        failing = _missing_namespace()
        fail(fd, f"cannot create the sandbox's namespaces: unshare({failing}) failed: {os.strerror(err)}. "
             + NAMESPACE_HINTS.get(failing, OTHER_NAMESPACE_HINT))  # fmt: skip
    os.write(sync_w, b"u")
    os.close(sync_w)
    if os.read(go_r, 1) != b"g":
        os._exit(EXIT_SETUP)
    os.close(go_r)
    life_r, life_w = os.pipe()
    _hold_sigterm()  # (still held since the launcher's fork; kept so for the init, which never wants it)
    pid = os.fork()
    if pid == 0:
        os.close(life_w)
        _init(spec, code, life_r)
    os.close(life_r)
    # The init is this process's unreaped child until waitpid below returns, so its pid cannot be reused.
    _on_sigterm(lambda *_: _kill(pid, signal.SIGKILL))
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


NAMESPACE_HINTS = {
    "CLONE_NEWUSER": (
        "User namespaces are disabled or forbidden here. Allow them: `sysctl -w user.max_user_namespaces=15000`; "
        "on Debian/Ubuntu also `sysctl -w kernel.unprivileged_userns_clone=1`, on Ubuntu 23.10+ "
        "`sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`; in a container, a seccomp profile that "
        "permits unshare with CLONE_NEWUSER (e.g. docker run --security-opt seccomp=unconfined)."
    ),
}


OTHER_NAMESPACE_HINT = (
    "The kernel lacks this namespace type (CONFIG_*_NS) or a security policy (seccomp profile, LSM) "
    "forbids creating it."
)


def _missing_namespace() -> str:
    """Which namespace type the kernel refuses (asked in a throwaway child, so this process is unchanged)."""
    for flag, name in NAMESPACES.items():
        extra = CLONE_NEWUSER if flag != CLONE_NEWUSER else 0
        pid = os.fork()
        if pid == 0:
            os._exit(0 if libc.unshare(flag | extra) == 0 else 1)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            return name
    return "|".join(NAMESPACES.values())


# --- init (pid 1 of the sandbox) ---------------------------------------------------------------------------


def _init(spec: dict, code: bytes, life_r: int) -> None:
    fd = spec["report_fd"]
    try:
        sources = _open_sources()  # while still able to reach them as the launcher's host user
        os.setresgid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)
        os.setresuid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)
        # A uid change clears the parent-death signal: set it again, then make sure the keeper did not
        # die in between (its end of the lifeline pipe closes with it).
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if _closed(life_r):
            os._exit(EXIT_SETUP)
        _build_root(sources, spec, code)
        _drop_privileges()
        problem = load_seccomp(sandbox_rules())
        if problem:
            raise SetupError(problem)
        _verify()
    except SetupError as err:
        fail(fd, str(err))
    except Exception as err:
        fail(fd, f"cannot build the sandbox: {type(err).__name__}: {err}")
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # pid 1 ignores default-action signals from inside
    # A session of its own: the launcher's process group is not the program's to signal (kill(0, ...)).
    os.setsid()
    pid = os.fork()
    if pid == 0:
        _program(spec, code, "/tmp", new_main=False)
    while True:  # reap orphans until the program ends; exiting then kills whatever is left
        child, status = os.waitpid(-1, 0)
        if child == pid:
            break
    _report_status(fd, status)
    os._exit(0)


def _closed(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])  # never written to: readable only at EOF


def _open_sources() -> list[tuple[str, int | str]]:
    """(path, O_PATH fd) for every host path bound into the sandbox, (path, target) for symlinks.
    Opened before the uid change: host root's own files (a Python under /root) stay reachable."""
    top = [f"/{name}" for name in TOP_DIRS]
    paths = list(top)
    for prefix in sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, sys.exec_prefix)}):
        if not any(prefix == p or prefix.startswith(p + "/") for p in paths):  # not inside one bound already
            paths.append(prefix)
    paths += [f"/etc/{name}" for name in ETC_FILES] + [f"/dev/{name}" for name in DEVICES]
    sources: list[tuple[str, int | str]] = []
    for path in paths:
        if path in top and os.path.islink(path):
            sources.append((path, os.readlink(path)))
        elif os.path.exists(path):
            sources.append((path, os.open(path, os.O_PATH | os.O_CLOEXEC)))
    return sources


def _build_root(sources: list[tuple[str, int | str]], spec: dict, code: bytes) -> None:
    root = "/tmp"  # any existing directory: the new root's tmpfs covers it in this mount namespace only
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("sandbox", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    for name in ("etc", "dev", "proc", "tmp"):
        os.mkdir(f"{root}/{name}", 0o755)
    scratch = f"size={spec['scratch_bytes']},nr_inodes=65536,mode=0700,uid={SANDBOX_ID},gid={SANDBOX_ID}"
    _mount("scratch", f"{root}/tmp", "tmpfs", MS_NOSUID | MS_NODEV, scratch)
    with open(f"{root}/tmp/main.py", "wb") as f:
        f.write(code)
    for path, source in sources:
        target = root + path
        if isinstance(source, str):
            os.symlink(source, target)
            continue
        is_dir = os.path.isdir(f"/proc/self/fd/{source}")
        os.makedirs(target if is_dir else os.path.dirname(target), 0o755, exist_ok=True)
        if not is_dir:
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
        _mount(f"/proc/self/fd/{source}", target, None, MS_BIND)
        os.close(source)
        if not path.startswith("/dev/"):  # device nodes stay writable (/dev/null), as the host's are
            locked = os.statvfs(target).f_flag & LOCKED_FLAGS
            _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | locked)
    for name, text in ETC_WRITTEN.items():
        with open(f"{root}/etc/{name}", "w") as f:
            f.write(text)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2"), ("shm", "/tmp")):  # fmt: skip
        os.symlink(target, f"{root}/dev/{name}")
    try:
        _mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError as err:
        raise SetupError(
            f"cannot mount /proc for the sandbox's pid namespace ({err}). This happens in a container "
            "that masks parts of /proc: give it an unmasked /proc (docker run --security-opt "
            "systempaths=unconfined) or run on the host."
        ) from err
    _pivot_into(root)
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    name = b"sandbox"
    _call(libc.sethostname(name, len(name)), "sethostname")


def _pivot_into(root: str) -> None:
    """Make ``root`` the root of this mount namespace and detach the host's tree beneath it."""
    machine = os.uname().machine
    number = PIVOT_ROOT.get(machine)
    if number is None:
        raise SetupError(f"unsupported architecture {machine} (known: {', '.join(PIVOT_ROOT)})")
    os.chdir(root)
    _call(libc.syscall(number, b".", b"."), "pivot_root")
    _call(libc.umount2(b".", MNT_DETACH), "umount the host's root")
    os.chdir("/")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _drop_privileges() -> None:
    """Empty every capability set (bounding and ambient included) and set no_new_privs, so that neither
    this process nor anything it executes (setuid files, file capabilities) can gain privileges."""
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0) == 0:
        cap += 1
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words per set
    _call(libc.capset(ctypes.byref(header), (_CapData * 2)()), "capset")
    _prctl(PR_SET_NO_NEW_PRIVS, 1)


def _verify() -> None:
    """Read back from the kernel what the program will run with; refuse to run it otherwise."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    want = {"CapInh": "0" * 16, "CapPrm": "0" * 16, "CapEff": "0" * 16, "CapBnd": "0" * 16,
            "CapAmb": "0" * 16, "NoNewPrivs": "1", "Seccomp": "2"}  # fmt: skip
    wrong = {k: fields.get(k, "?").strip() for k, v in want.items() if fields.get(k, "?").strip() != v}
    ids = {fields["Uid"].split()[0], fields["Gid"].split()[0]}
    if wrong or ids != {str(SANDBOX_ID)}:
        raise SetupError(f"the sandbox's process kept privileges: {wrong or ids}")


# --- seccomp ---------------------------------------------------------------------------------------------

# Refused with EPERM: kernel interfaces a program has no use for and that are the usual ways into the
# kernel from an unprivileged namespace (namespaces and mounts, tracing, keyrings, eBPF, io_uring, ...).
DENIED_SYSCALLS = (
    "unshare", "setns", "mount", "umount", "umount2", "pivot_root", "chroot", "mount_setattr", "move_mount",
    "open_tree", "fsopen", "fsconfig", "fsmount", "fspick", "ptrace", "process_vm_readv",
    "process_vm_writev", "kcmp", "pidfd_getfd", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup",
    "io_uring_enter", "io_uring_register", "keyctl", "add_key", "request_key", "kexec_load",
    "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff", "acct",
    "syslog", "quotactl", "quotactl_fd", "lookup_dcookie", "nfsservctl", "vhangup", "iopl", "ioperm",
    "uselib", "open_by_handle_at", "name_to_handle_at", "sethostname", "setdomainname", "settimeofday",
    "clock_settime", "clock_adjtime", "adjtimex", "fanotify_init",
)  # fmt: skip
SCMP_ACT_ALLOW, SCMP_ACT_ERRNO = 0x7FFF0000, 0x00050000
SCMP_CMP_NE, SCMP_CMP_MASKED_EQ = 1, 7
AF_UNIX, EPERM, ENOSYS = 1, 1, 38


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]


Rule = tuple[str, int, list[tuple[int, int, int, int]]]  # system call, action, (arg, op, a, b) tests


def sandbox_rules() -> list[Rule]:
    rules: list[Rule] = [(name, SCMP_ACT_ERRNO | EPERM, []) for name in DENIED_SYSCALLS]
    # New namespaces through clone are refused flag by flag; clone3 passes its flags in memory, out of a
    # filter's reach, so it reports ENOSYS and the C library falls back to clone.
    for flag in NAMESPACES:
        rules.append(("clone", SCMP_ACT_ERRNO | EPERM, [(0, SCMP_CMP_MASKED_EQ, flag, flag)]))
    rules.append(("clone3", SCMP_ACT_ERRNO | ENOSYS, []))
    rules.append(("socket", SCMP_ACT_ERRNO | EPERM, [(0, SCMP_CMP_NE, AF_UNIX, 0)]))  # Unix sockets only
    return rules


def load_seccomp(rules: list[Rule]) -> str | None:
    """Install a filter allowing every system call but ``rules`` (libseccomp also kills on other
    architectures' system calls, e.g. int 0x80). Returns an error message, or None once loaded."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        return "libseccomp (libseccomp.so.2) is not installed: apt-get install libseccomp2 (or dnf install libseccomp)"
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]  # fmt: skip
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        return "seccomp_init failed"
    try:
        for name, action, args in rules:
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number < 0:
                continue  # not a system call on this architecture
            array = (_ArgCmp * max(1, len(args)))(*[_ArgCmp(*a) for a in args])
            if lib.seccomp_rule_add_array(ctx, action, number, len(args), array) < 0:
                return f"libseccomp refused the rule for {name}"
        ret = lib.seccomp_load(ctx)
    finally:
        lib.seccomp_release(ctx)
    if ret < 0:
        return f"the kernel refused the seccomp filter ({os.strerror(-ret)}); it needs CONFIG_SECCOMP_FILTER"
    return None


# --- program ---------------------------------------------------------------------------------------------


def _program(spec: dict, code: bytes, workdir: str, *, new_main: bool) -> None:
    """Run the code as ``__main__`` under the limits; never returns."""
    os.closerange(3, 1 << 16)  # the report fd above all: the program must not be able to forge a report
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    os.chdir(workdir)
    if new_main:
        with open("main.py", "wb") as f:
            f.write(code)
    os.environ["HOME"] = os.environ["TMPDIR"] = workdir
    cpu = spec["cpu_s"]
    for limit, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)), (resource.RLIMIT_AS, spec["memory_bytes"]),
                         (resource.RLIMIT_FSIZE, spec["file_bytes"]), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_NPROC, spec["processes"])):  # fmt: skip
        resource.setrlimit(limit, value if isinstance(value, tuple) else (value, value))
    module = types.ModuleType("__main__")
    module.__file__ = os.path.join(workdir, "main.py")
    sys.modules["__main__"] = module
    sys.argv = ["main.py"]
    try:
        exec(compile(code, "main.py", "exec"), module.__dict__)
        status = 0
    except SystemExit as exc:
        status = _exit_status(exc.code)
    except BaseException as err:  # print it as python would, without this file's frame
        tb = err.__traceback__.tb_next if err.__traceback__ else None
        sys.excepthook(type(err), err.with_traceback(tb), tb)
        status = 1
    _exit(status)


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _exit(status: int) -> None:
    """End the program as the interpreter would, less its object-by-object teardown: in a forked child that
    teardown writes to every inherited page (reference counts) and costs ~8 ms a call. Same order as
    ``Py_FinalizeEx``: wait for non-daemon threads, run atexit callbacks, flush the standard streams."""
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)


if __name__ == "__main__":
    main()
