"""Our side of the contracts, taken from the real code rather than from a list kept by hand.

* HTTP: the clients (``rollouter/clients``) and the weight-sync adapters (``weightsync/adapters.py``)
  are driven through every call they offer, in every mode their configs allow, against an
  ``httpx.MockTransport`` that records each request (method, path, query, JSON body) and answers
  with a small well-formed reply whose reads are noted (which reply fields our parsers use).
* Launch: ``rollouter.launch.launch_server`` builds its command for each recipe in ``configs/`` and
  for the default config, with ``subprocess.Popen`` replaced by a recorder (nothing is started).
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

    @property
    def endpoint(self) -> str:
        return f"{self.method} {self.path}"


@dataclass
class LaunchArgv:
    kind: str
    source: str  # the config the command was built for
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------ HTTP
def _reply(request: httpx.Request) -> httpx.Response:
    """A minimal valid answer for each route our code reads a reply from."""
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
                }
            ],
            "usage": {"prompt_tokens": 3},
        }
    elif path in ("/weight_info", "/model_info"):
        body = {"weight_version": "1", "model_path": "m"}
    elif path == "/v1/models":
        body = {"data": [{"id": "m", "root": "m", "max_model_len": 64}]}
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
        self._by_request: dict[int, HttpCall] = {}

    def handler(self, request: httpx.Request) -> httpx.Response:
        raw = request.content
        body = json.loads(raw) if raw else None
        params = dict(request.url.params.multi_items())
        call = HttpCall(self.kind, request.method, request.url.path, params, body, self.origin)
        self.calls.append(call)
        self._by_request[id(request)] = call
        return _reply(request)

    def tracking_json(self, response: httpx.Response, **kwargs) -> Any:
        """``httpx.Response.json`` while recording: the reply, noting which of its fields are read."""
        data = json.loads(response.content, **kwargs)
        call = self._by_request.get(id(response.request))
        return _track(data, "", call.reads) if call is not None else data

    def client(self, base_url: str = "http://upstream") -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=base_url, transport=httpx.MockTransport(self.handler))

    async def run(
        self, kind: str, origin: str, step: Callable[[], Awaitable[Any]], errors: list[str]
    ) -> None:
        self.kind, self.origin = kind, origin
        try:
            await step()
        except Exception as err:  # a step that cannot run is reported, the others still are recorded
            errors.append(f"{origin}: {type(err).__name__}: {err}")


async def _record_clients(rec: _Recorder, errors: list[str]) -> None:
    from slipstream.agents.protocol import SamplingParams
    from slipstream.rollouter.clients.sglang import SGLangClient
    from slipstream.rollouter.clients.vllm import VLLMClient
    from slipstream.serverapi import SGLANG, VLLM

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
    from slipstream.weightsync.adapters import ADAPTERS, GroupSpec
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
    for kind in ("sglang", "vllm"):
        cls = ADAPTERS[kind]
        for backend in ("torch_dist", "naive"):
            for pause_mode in ("in_place", "abort", "retract"):
                cfg = WeightSyncConfig(backend=backend, pause_mode=pause_mode)
                http = rec.client()
                adapter = cls("http://upstream", cfg, http)
                label = f"{cls.__name__}(backend={backend}, pause_mode={pause_mode})"
                steps = [
                    ("ranks", adapter.ranks),
                    ("init_group", lambda a=adapter: a.init_group(spec)),
                    ("before", lambda a=adapter: a.before(3)),
                ]
                steps += [(f"update(bucket {m.index})", lambda a=adapter, m=m: a.update(m)) for m in metas]
                steps += [
                    ("after", lambda a=adapter: a.after(3)),
                    ("recover", lambda a=adapter: a.recover(3)),
                    ("destroy_group", lambda a=adapter: a.destroy_group(spec.group_name)),
                    ("healthy", adapter.healthy),
                ]
                for name, step in steps:
                    await rec.run(kind, f"{label}.{name}", step, errors)
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
    from slipstream.config import load_config
    from slipstream.rollouter.config import RolloutConfig

    out: list[tuple[str, Any]] = []
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        cfg = load_config(path).rollout
        if cfg.backend in ("vllm", "sglang"):
            out.append((path.relative_to(REPO).as_posix(), cfg))
    for kind in ("vllm", "sglang"):
        out.append((f"RolloutConfig(backend={kind})", RolloutConfig(backend=kind)))
    return out


def record_launch_argv() -> list[LaunchArgv]:
    """The command ``launch_server`` builds for each vLLM/SGLang config we ship, nothing started."""
    from slipstream.rollouter import launch

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
    with (
        mock.patch.object(launch.subprocess, "Popen", _FakePopen),
        mock.patch.object(launch.shutil, "which", lambda *a, **k: "/usr/bin/vllm"),
    ):
        for source, cfg in _sample_configs():
            server = launch.launch_server(
                cfg.backend, "/models/sample", cfg=cfg, port=30123, log_path=Path("/dev/null")
            )
            server.stop()
            rec = seen.pop()
            out.append(
                LaunchArgv(
                    cfg.backend,
                    source,
                    rec.argv,
                    {k: v for k, v in rec.env.items() if k.startswith(("VLLM_", "SGLANG_"))},
                )
            )
    return out
