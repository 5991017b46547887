"""Our side of the contracts, taken from the real code rather than from a list kept by hand.

* HTTP: the clients (``rollouter/clients``) and the weight-sync adapters (``weightsync/adapters.py``)
  are driven through every call they offer, in every mode their configs allow, against an
  ``httpx.MockTransport`` that records each request (method, path, query, JSON body) and answers
  with a small well-formed reply whose reads are noted (which reply fields our parsers use). The vLLM
  adapter is driven once per weight-transfer engine it pushes to (:data:`VLLM_ENGINES`), the engine
  named by the recorded ``/server_info`` reply as a real server's would, and each call notes its engine
  (the bodies of ``slipstream`` and ``nccl`` differ and are parsed by different classes).
* Launch: ``rollouter.launch.launch_server`` builds its command for each recipe in ``configs/`` and
  for the default config (vLLM: with each weight-transfer engine and route, for the GPU release and for
  the CPU build), with ``subprocess.Popen`` replaced by a recorder (nothing is started).
* Python APIs: :mod:`slipstream.contracts.pyapi` reads our modules' imports and calls with ``ast``.

Example::

    calls = record_http_calls()    # [HttpCall(kind="vllm", method="POST", path="/pause", ...), ...]
    argvs = record_launch_argv()   # [LaunchArgv(kind="sglang", source="configs/recipes/...", argv=[...])]
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import httpx

REPO = Path(__file__).resolve().parents[2]


@dataclass
class HttpCall:
    kind: str  # the upstream server: vllm | sglang
    method: str
    path: str
    params: dict[str, str]
    body: Any  # parsed JSON, or None when no body was sent
    origin: str  # which of our calls sent it, e.g. "VLLMAdapter.before(pause_mode=abort)"
    reads: set[str] = field(default_factory=set)  # reply fields our code read: "choices[].token_ids"
    engine: str = ""  # the vLLM weight-transfer engine the adapter pushed to (slipstream | nccl); "" else

    @property
    def endpoint(self) -> str:
        return f"{self.method} {self.path}"


@dataclass
class LaunchArgv:
    kind: str
    source: str  # the config the command was built for (and, for vLLM, the build: "(cpu build)")
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # what the launcher sets beyond its own environment


# ------------------------------------------------------------------------------------------ HTTP
# The vLLM weight-transfer engines our adapter pushes to (``VLLMAdapter.ENGINE_TRANSPORTS``); a test holds
# this to the adapter, so a new engine is recorded (and its bodies checked) as soon as the adapter takes it.
VLLM_ENGINES: tuple[str, ...] = ("slipstream", "nccl")


def _reply(request: httpx.Request, kind: str = "", engine: str = "") -> httpx.Response:
    """A minimal valid answer for each route our code reads a reply from (``engine``: the weight-transfer
    engine a vLLM server reports in ``/server_info``)."""
    path = request.url.path
    body: Any = {"success": True, "message": "ok"}
    if path == "/generate":
        body = {
            "output_ids": [5],
            "meta_info": {
                "id": "r",
                "finish_reason": {"type": "stop"},
                "prompt_tokens": 3,
                "weight_version": "1",
                "output_token_logprobs": [[-0.5, 5, None]],
                "weight_versions": [{"version": "1", "start": 0, "end": 1}],
            },
        }
    elif path == "/v1/completions":
        body = {
            "choices": [
                {
                    "token_ids": [5],
                    "logprobs": {"token_logprobs": [-0.5]},
                    "finish_reason": "stop",
                    "weight_versions": [{"version": "1", "start": 0, "end": 1}],
                }
            ],
            "usage": {"prompt_tokens": 3},
        }
    elif path == "/inference/v1/generate":
        body = {
            "choices": [
                {
                    "token_ids": [5],
                    "logprobs": {"content": [{"token_id": 5, "logprob": -0.5}]},
                    "finish_reason": "stop",
                    "weight_versions": [{"version": "1", "start": 0, "end": 1}],
                }
            ],
            "usage": {"prompt_tokens": 3},
        }
    elif path in ("/weight_info", "/model_info"):
        body = {"weight_version": "1", "model_path": "m"}
    elif path == "/v1/models":
        body = {"data": [{"id": "m", "root": "m", "max_model_len": 64}]}
    elif path == "/server_info" and kind == "vllm":  # ?config_format=json: the config as JSON
        config = {"weight_transfer_config": {"backend": engine or "nccl"}}
        body = {"vllm_config": config, "vllm_env": {}, "system_env": {}}
    elif path == "/server_info":
        body = {"tp_size": 1}
    elif path == "/get_world_size":
        body = {"world_size": 1}
    return httpx.Response(200, json=body)


class _ReadDict(dict):
    """A reply object that notes every key our code reads (``[k]``, ``.get(k)``, ``k in``)."""

    def __init__(self, data: dict, path: str, reads: set[str]) -> None:
        super().__init__({k: _track(v, f"{path}{k}", reads) for k, v in data.items()})
        self._path, self._reads = path, reads

    def __getitem__(self, key):
        self._reads.add(f"{self._path}{key}")
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._reads.add(f"{self._path}{key}")
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self._reads.add(f"{self._path}{key}")
        return super().__contains__(key)


def _track(value: Any, path: str, reads: set[str]) -> Any:
    if isinstance(value, dict):
        return _ReadDict(value, f"{path}." if path else "", reads)
    if isinstance(value, list):
        return [_track(v, f"{path}[]", reads) for v in value]
    return value


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[HttpCall] = []
        self.kind = ""
        self.origin = ""
        self.engine = ""
        self._by_request: dict[int, HttpCall] = {}

    def handler(self, request: httpx.Request) -> httpx.Response:
        raw = request.content
        body = json.loads(raw) if raw else None
        params = dict(request.url.params.multi_items())
        call = HttpCall(
            self.kind, request.method, request.url.path, params, body, self.origin, engine=self.engine
        )
        self.calls.append(call)
        self._by_request[id(request)] = call
        return _reply(request, self.kind, self.engine)

    def tracking_json(self, response: httpx.Response, **kwargs) -> Any:
        """``httpx.Response.json`` while recording: the reply, noting which of its fields are read."""
        data = json.loads(response.content, **kwargs)
        call = self._by_request.get(id(response.request))
        return _track(data, "", call.reads) if call is not None else data

    def client(self, base_url: str = "http://upstream") -> httpx.AsyncClient:
        return _RecordingClient(base_url=base_url, transport=httpx.MockTransport(self.handler))

    async def run(
        self, kind: str, origin: str, step: Callable[[], Awaitable[Any]], errors: list[str]
    ) -> None:
        self.kind, self.origin = kind, origin
        try:
            await step()
        except Exception as err:  # a step that cannot run is reported, the others still are recorded
            errors.append(f"{origin}: {type(err).__name__}: {err}")


class _RecordingClient(httpx.AsyncClient):
    """The recorder's stand-in for ``HTTPClient``: takes its ``repeatable`` (whether a call may be sent twice,
    nothing the server sees) and sends the rest as httpx does."""

    async def request(
        self, method: str, url: Any, *, repeatable: bool = False, **kwargs: Any
    ) -> httpx.Response:
        return await super().request(method, url, **kwargs)


async def _record_clients(rec: _Recorder, errors: list[str]) -> None:
    from slipstream.agents.protocol import SamplingParams
    from slipstream.serverapi import SGLANG, VLLM
    from slipstream.serverkinds.sglang import SGLangClient
    from slipstream.serverkinds.vllm import VLLMClient

    samplings = [
        SamplingParams(),
        SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=[2, 3]),
    ]
    variants: list[tuple[str, str, Any, tuple[str, ...]]] = [
        ("sglang", "SGLangClient", lambda: SGLangClient("http://upstream"), tuple(SGLANG.pause_modes)),
        (
            "vllm",
            "VLLMClient(api=completions)",
            lambda: VLLMClient("http://upstream"),
            tuple(VLLM.pause_modes),
        ),
        ("vllm", "VLLMClient(api=generate)", lambda: VLLMClient("http://upstream", api="generate"), ()),
    ]
    for kind, label, make, modes in variants:
        client = make()
        await client._http.aclose()
        client._http = rec.client(client.base_url)
        await _drive_client(rec, client, kind, label, samplings, modes, errors)
        await client.aclose()


async def _drive_client(
    rec: _Recorder, client: Any, kind: str, label: str, samplings: list, modes: tuple, errors: list[str]
) -> None:
    for i, sp in enumerate(samplings):
        await rec.run(
            kind, f"{label}.generate", lambda sp=sp, i=i: client.generate([1, 2, 3], sp, rid=f"r{i}"), errors
        )
    await rec.run(
        kind,
        f"{label}.generate(session_id)",
        lambda: client.generate([1, 2], samplings[0], rid="s", session_id="sess"),
        errors,
    )
    for name in ("abort_all", "resume", "weight_version", "model_info", "health"):
        await rec.run(kind, f"{label}.{name}", getattr(client, name), errors)
    await rec.run(kind, f"{label}.abort", lambda: client.abort("r0"), errors)
    for mode in modes:
        await rec.run(kind, f"{label}.pause({mode})", lambda mode=mode: client.pause(mode), errors)


async def _record_adapters(rec: _Recorder, errors: list[str]) -> None:
    from slipstream.serverkinds import server_kind
    from slipstream.weightsync.adapters import GroupSpec
    from slipstream.weightsync.config import WeightSyncConfig
    from slipstream.weightsync.types import BucketMeta, TensorEntry

    entries = [
        TensorEntry("model.embed_tokens.weight", "bfloat16", [8, 4], 0, 64),
        TensorEntry("lm_head.weight", "float32", [8, 4], 64, 128),
    ]
    metas = [
        BucketMeta(version=3, index=0, nbytes=192, entries=entries),
        BucketMeta(version=3, index=1, nbytes=192, entries=entries, last=True),
    ]
    spec = GroupSpec(
        master_address="127.0.0.1",
        master_port=29500,
        rank_offset=1,
        world_size=2,
        group_name="slipstream_weights",
        backend="nccl",
        nccl_unique_id_b64="QUJD",
    )
    variants = [("sglang", "")] + [("vllm", engine) for engine in VLLM_ENGINES]
    for kind, engine in variants:
        cls = server_kind(kind).adapter
        for backend in ("torch_dist", "naive"):
            for pause_mode in ("in_place", "abort", "retract"):
                cfg = WeightSyncConfig(backend=backend, pause_mode=pause_mode)
                http = rec.client()
                adapter = cls("http://upstream", cfg, http)
                on = f", engine={engine}" if engine else ""
                label = f"{cls.__name__}(backend={backend}, pause_mode={pause_mode}{on})"
                rec.engine = engine
                opening = [
                    ("data_plane", adapter.data_plane),  # vLLM: reads the engine from /server_info
                    ("ranks", adapter.ranks),
                    ("init_group", lambda a=adapter: a.init_group(spec)),
                    ("before", lambda a=adapter: a.before(3)),
                ]
                for name, step in opening:
                    await rec.run(kind, f"{label}.{name}", step, errors)
                steps = []
                if not adapter.in_band:  # an in-band member reads the buckets' metadata from the group
                    steps += [(f"update(bucket {m.index})", lambda a=adapter, m=m: a.update(m)) for m in metas]
                steps += [
                    ("after", lambda a=adapter: a.after(3)),
                    ("recover", lambda a=adapter: a.recover(3)),
                    ("destroy_group", lambda a=adapter: a.destroy_group(spec.group_name)),
                    ("healthy", adapter.healthy),
                ]
                for name, step in steps:
                    await rec.run(kind, f"{label}.{name}", step, errors)
                if engine and getattr(adapter, "engine", engine) != engine:
                    errors.append(f"{label}: the adapter took engine {adapter.engine!r} from /server_info")
                rec.engine = ""
                await http.aclose()


def record_http_calls(errors: list[str] | None = None) -> list[HttpCall]:
    """Every request our clients and adapters send to vLLM and SGLang servers (see the module docstring).

    Steps that raise are listed in ``errors`` (when given) instead of stopping the recording.
    """
    rec, errs = _Recorder(), errors if errors is not None else []

    async def main() -> None:
        await _record_clients(rec, errs)
        await _record_adapters(rec, errs)

    with mock.patch.object(httpx.Response, "json", lambda self, **kw: rec.tracking_json(self, **kw)):
        asyncio.run(main())
    return rec.calls


# ---------------------------------------------------------------------------------------- launch
def _sample_configs() -> list[tuple[str, Any]]:
    import msgspec

    from slipstream.config import load_config
    from slipstream.rollouter.config import RolloutConfig, VLLMServerConfig

    out: list[tuple[str, Any]] = []
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        cfg = load_config(path).rollout
        if cfg.backend in ("vllm", "sglang"):
            out.append((path.relative_to(REPO).as_posix(), cfg))
    for kind in ("vllm", "sglang"):
        out.append((f"RolloutConfig(backend={kind})", RolloutConfig(backend=kind)))
    # Every choice of the vLLM settings that change the command: each engine and route, and the
    # settings a CPU adds (threads, a length limit, compiled vs eager).
    info = msgspec.inspect.type_info(VLLMServerConfig)
    choices = {f.name: _literal_values(f.type) for f in info.fields}  # type: ignore[attr-defined]
    for transfer in choices["weight_transfer"]:
        for route in choices["route"]:
            v = VLLMServerConfig(weight_transfer=transfer, route=route, max_model_len=1024, cpu_threads=1)
            label = f"RolloutConfig(backend=vllm, vllm.weight_transfer={transfer}, vllm.route={route})"
            out.append((label, RolloutConfig(backend="vllm", vllm=v)))
    for eager in (True, False):
        v = VLLMServerConfig(enforce_eager=eager, dtype="float32", max_num_seqs=8, cpu_threads=0)
        out.append(
            (
                f"RolloutConfig(backend=vllm, vllm.enforce_eager={eager})",
                RolloutConfig(backend="vllm", vllm=v),
            )
        )
    return out


def _literal_values(t: Any) -> tuple:
    """The choices of a ``Literal`` field (looking through ``Annotated``/``Meta``), else ()."""
    import msgspec

    if isinstance(t, msgspec.inspect.Metadata):
        t = t.type
    if isinstance(t, msgspec.inspect.LiteralType):
        return tuple(t.values)
    return ()


# The vLLM builds the launcher tells apart (``serverkinds.vllm.vllm_build``): each config's command is recorded for both.
VLLM_BUILDS: tuple[str, ...] = ("gpu", "cpu")


def record_launch_argv() -> list[LaunchArgv]:
    """The command ``launch_server`` builds for each vLLM/SGLang config we ship, nothing started; a vLLM
    config's command once per build (:data:`VLLM_BUILDS`: the GPU release and the CPU build differ in
    environment and defaults)."""
    import os

    from slipstream.rollouter import launch
    from slipstream.serverkinds import server_kind
    from slipstream.serverkinds import vllm as kind_vllm

    seen: list[LaunchArgv] = []

    class _FakePopen:
        pid = 0
        returncode = 0

        def __init__(self, command, env=None, **_kw) -> None:
            seen.append(LaunchArgv("", "", list(command), dict(env or {})))

        def poll(self) -> int:
            return 0

        def wait(self, timeout=None) -> int:
            return 0

    out: list[LaunchArgv] = []
    build = {"name": ""}
    with (
        mock.patch.object(launch.subprocess, "Popen", _FakePopen),
        mock.patch.object(kind_vllm, "vllm_build", lambda: build["name"]),
        mock.patch.dict(os.environ, {"PATH": os.environ.get("PATH", "")}, clear=True),  # what it adds, only
    ):
        for source, cfg in _sample_configs():
            for name in VLLM_BUILDS if cfg.backend == "vllm" else ("",):
                build["name"] = name
                server = launch.launch_server(
                    server_kind(cfg.backend),
                    "/models/sample",
                    cfg=cfg,
                    port=30123,
                    log_path=Path("/dev/null"),
                )
                server.stop()
                rec = seen.pop()
                env = {k: v for k, v in rec.env.items() if k != "PATH"}
                label = f"{source} ({name} build)" if name else source
                out.append(LaunchArgv(cfg.backend, label, rec.argv, env))
    return out


# --------------------------------------------------------------------------------------- plug-ins
def plugin_entry_points(group: str) -> dict[str, str]:
    """Our ``pyproject.toml`` entry points of ``group`` (``vllm.general_plugins``): name -> ``module:function``."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return dict(project.get("entry-points", {}).get(group, {}))


def plugin_registrations(group: str, method: str) -> dict[str, str]:
    """Names our plug-ins of entry-point ``group`` register with ``<registry>.<method>("name", ...)``, read
    from the function each entry point names (the name a literal or a module constant): name -> our file."""
    import ast

    out: dict[str, str] = {}
    for target in plugin_entry_points(group).values():
        module, _, func = target.partition(":")
        path = REPO / (module.replace(".", "/") + ".py")
        if not path.exists():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        consts = {
            t.id: n.value.value
            for n in tree.body
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == func), None)
        for node in ast.walk(fn) if fn is not None else []:
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == method
            ):
                arg = node.args[0] if node.args else None
                name = arg.value if isinstance(arg, ast.Constant) else consts.get(getattr(arg, "id", ""))
                if isinstance(name, str):
                    out[name] = path.relative_to(REPO).as_posix()
    return out
