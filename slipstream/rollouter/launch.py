"""Start inference servers as subprocesses, wait until they are healthy, stop them cleanly.

The command and environment of each kind (``rollout.backend``) come from its record in
``slipstream.serverkinds`` (``kind.argv`` / ``.env``: ``embedded`` is ``python -m slipstream.rollouter.serve``,
``vllm`` vLLM's OpenAI server in dev mode, ``sglang`` ``python -m sglang.launch_server``; each module's
docstring says why its flags). The caller resolves the record (``server_kind(name)``) and hands it in; this
module types it by :class:`LaunchKind` and never looks a kind up by name.

``cfg.server_args`` and ``extra_args`` are appended. Each server runs in its own process group (vLLM and
SGLang start workers of their own), writes stdout and stderr to a log file, and is stopped with SIGTERM to
the group, then SIGKILL after a grace period. When a server exits or never becomes healthy,
:meth:`ServerProcess.wait_healthy` (which polls the kind's described health route) raises
:class:`ServerLaunchError` carrying the end of its own output.

Example::

    kind = server_kind("embedded")                   # above the rollouter
    with launch_server(kind, model_path, cfg=rollout_cfg) as server:
        server.wait_healthy(120)
        client = make_client(kind, server.url)
"""

from __future__ import annotations

import atexit
import collections
import os
import signal
import subprocess
import tempfile
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx

from slipstream.rollouter.config import RolloutConfig
from slipstream.serverapi import Endpoint, ServerAPI
from slipstream.utils.http_auth import TOKEN_ENV
from slipstream.utils.logging import get_logger
from slipstream.utils.net import LOOPBACK, free_port, is_loopback

log = get_logger(__name__)


# Servers this process started and has not stopped; stopped at interpreter exit so none outlives us.
_RUNNING: weakref.WeakSet[ServerProcess] = weakref.WeakSet()


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_RUNNING):
        server.stop(timeout_s=10)


class ServerLaunchError(RuntimeError):
    """A launched server exited or did not become healthy; the message ends with its own output."""


class LaunchKind(Protocol):
    """What starting a server needs of its kind (``slipstream.serverkinds.ServerKind`` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def api(self) -> ServerAPI: ...
    @property
    def open_flag(self) -> str | None: ...
    def argv(self, model: str, host: str, port: int, cfg: RolloutConfig) -> list[str]: ...
    @property
    def env(self) -> Callable[[RolloutConfig], dict[str, str]]: ...


@dataclass(eq=False)
class ServerProcess:
    """A running server subprocess (see the module docstring for the lifecycle)."""

    kind: str
    url: str
    command: list[str]
    log_path: Path
    popen: subprocess.Popen
    _log_file: object = field(default=None, repr=False)
    health: Endpoint = Endpoint("GET", "/health")  # its kind's described health request

    @property
    def pid(self) -> int:
        return self.popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(collections.deque(f, maxlen=n))
        except OSError:
            return ""

    def wait_healthy(self, timeout_s: float = 600.0, poll_s: float = 0.25) -> None:
        """Block until the kind's health route (``GET /health``) answers 200; raise :class:`ServerLaunchError`
        (and stop the server) when it exits first or ``timeout_s`` passes."""
        health = self.health
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as http:
            while True:
                if not self.is_alive():
                    raise ServerLaunchError(
                        f"{self.kind} server ({' '.join(self.command[:6])} ...) exited with code "
                        f"{self.popen.returncode} before becoming healthy. Its log is {self.log_path}; its last "
                        f"output:\n{self.log_tail()}"
                    )
                try:
                    if http.request(health.method, f"{self.url}{health.path}").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    tail = self.log_tail()
                    self.stop()
                    raise ServerLaunchError(
                        f"{self.kind} server at {self.url} was not healthy after {timeout_s:.0f} s (stopped it). "
                        f"Its log is {self.log_path}; its last output:\n{tail}"
                    )
                time.sleep(poll_s)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``timeout_s``; return the exit code."""
        if self.is_alive():
            self._signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning(
                    "%s server pid %d ignored SIGTERM for %.0f s; killing it", self.kind, self.pid, timeout_s
                )
                self._signal(signal.SIGKILL)
                self.popen.wait(timeout=30)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        _RUNNING.discard(self)
        return self.popen.returncode

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)  # its own group: start_new_session=True
        except ProcessLookupError:
            pass

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch_server(
    kind: LaunchKind,
    model_path: str | Path,
    *,
    host: str = LOOPBACK,
    port: int = 0,
    cfg: RolloutConfig | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    log_path: str | Path | None = None,
) -> ServerProcess:
    """Start a ``kind`` server for ``model_path`` (``port=0`` picks a free one); returns at once.

    Call :meth:`ServerProcess.wait_healthy` before sending requests.
    """
    record, kind_name = kind, kind.name
    cfg = cfg or RolloutConfig()
    port = port or free_port(host)
    command = record.argv(str(model_path), host, port, cfg) + list(cfg.server_args) + list(extra_args)
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix=f"slipstream-{kind_name}-{port}-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **record.env(cfg), **(env or {})}
    if not is_loopback(host) and not full_env.get(TOKEN_ENV, "").strip():
        raise ServerLaunchError(
            f"{kind_name} server on {host}:{port}: it would be reachable from other machines and ${TOKEN_ENV} is "
            "not set, so its pause, abort and weight routes would answer anyone: set the token (the pipeline "
            "makes one per run) or bind 127.0.0.1 (cluster.server_host)"
        )
    if record.open_flag and not full_env.get(TOKEN_ENV, "").strip():
        # launched without a token: open, as the caller asked (the pipeline sets one)
        command.append(record.open_flag)
    log_file = open(log_path, "ab")  # noqa: SIM115 - closed by ServerProcess.stop
    popen = subprocess.Popen(
        command,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=full_env,
        start_new_session=True,
    )
    log.info("started %s server pid %d on %s:%d (log %s)", kind_name, popen.pid, host, port, log_path)
    url_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    url = f"http://{url_host}:{port}"
    server = ServerProcess(kind_name, url, command, log_path, popen, log_file, record.api.health)
    _RUNNING.add(server)
    return server


def launch_servers(
    kind: LaunchKind,
    cfg: RolloutConfig,
    model_path: str | Path,
    *,
    host: str = LOOPBACK,
    log_dir: str | Path | None = None,
    env_for: Callable[[int], Mapping[str, str]] | None = None,
) -> list[ServerProcess]:
    """Start ``cfg.num_servers`` servers of ``kind`` (``cfg.backend``'s record) and wait until all are healthy.

    They start together and load in parallel; ``env_for(i)`` adds environment for server ``i`` (for
    example ``CUDA_VISIBLE_DEVICES``). If one fails, all are stopped and its error is raised.
    """
    servers: list[ServerProcess] = []
    try:
        for i in range(cfg.num_servers):
            log_path = Path(log_dir) / f"{cfg.backend}-{i}.log" if log_dir is not None else None
            env = env_for(i) if env_for is not None else None
            servers.append(launch_server(kind, model_path, host=host, cfg=cfg, env=env, log_path=log_path))
        for server in servers:
            server.wait_healthy(cfg.launch_timeout_s)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers
