"""What an inference-server kind must provide (``slipstream.serverkinds``; the steps are in
docs/architecture.md, "Adding a server kind"): every registered kind's record is complete and consistent and
satisfies what the launcher, the clients and weight sync take from it, and a kind added as one module plus its
entry reaches them through its record, handed down (nothing below ``serverkinds`` looks a kind up by name:
tests/test_import_graph.py)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
import tomllib
import typing
from pathlib import Path

import msgspec
import pytest

from slipstream.agents.config import RewardServerLaunchConfig
from slipstream.rollouter.clients import ServerClient, client_for, make_client
from slipstream.rollouter.config import RolloutConfig
from slipstream.serverapi import EMBEDDED, ServerAPI
from slipstream.serverkinds import KINDS, KindName, ServerKind, server_kind
from slipstream.serverkinds import vllm as kind_vllm
from slipstream.weightsync.adapters import ServerAdapter
from slipstream.weightsync.base import TRANSPORTS
from slipstream.weightsync.config import WeightSyncConfig

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


@pytest.fixture(params=list(KINDS))
def kind(request, monkeypatch) -> ServerKind:
    # A kind with builds (vLLM) reads the installed one in its own module; any build will do here.
    monkeypatch.setattr(kind_vllm, "vllm_build", lambda: "gpu")
    return server_kind(request.param)


def test_every_kind_is_its_own_modules_record(kind: ServerKind):
    assert isinstance(kind, ServerKind)
    assert KINDS[kind.name] == f"slipstream.serverkinds.{kind.name}"
    assert isinstance(kind.api, ServerAPI) and kind.api.kind == kind.name
    assert kind.title


def test_the_client_speaks_the_kinds_description(kind: ServerKind):
    assert issubclass(kind.client, ServerClient)
    client = make_client(kind, "http://127.0.0.1:9")
    assert type(client) is kind.client
    assert client.server_api is kind.api and client.control.api is kind.api
    assert isinstance(kind.client.options_from(RolloutConfig(backend=kind.name)), dict)


def test_the_adapter_speaks_the_kinds_description(kind: ServerKind):
    assert issubclass(kind.adapter, ServerAdapter)
    assert kind.adapter.kind == kind.name and kind.adapter.api is kind.api
    adapter = kind.adapter("http://127.0.0.1:9", WeightSyncConfig(), http=None)  # type: ignore[arg-type]
    assert adapter.control.api is kind.api


def test_the_command_and_environment_build_for_a_default_config(kind: ServerKind):
    cfg = RolloutConfig(backend=kind.name)
    argv = kind.argv("/models/m", "127.0.0.1", 8000, cfg)
    assert argv[0] == sys.executable and all(isinstance(a, str) for a in argv)
    assert "/models/m" in argv and "8000" in argv
    env = kind.env(cfg)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())


def test_the_position_override_is_the_kinds_flag(kind: ServerKind):
    cfg = RolloutConfig(backend=kind.name, max_position_embeddings=4096)
    argv = kind.argv("/models/m", "127.0.0.1", 8000, cfg)
    if kind.position_flag is None:
        assert kind.position_override(cfg) == []
    else:
        i = argv.index(kind.position_flag)
        assert argv[i + 1] == '{"max_position_embeddings": 4096}'


def test_the_flags_are_complete(kind: ServerKind):
    for flag in (kind.context_flag, kind.position_flag, kind.open_flag):
        assert flag is None or flag.startswith("--")
    # A third-party server is installed by its extra and needs its module; ours is always there.
    assert (kind.module is None) == (kind.extra is None)
    if kind.extra is not None:
        assert kind.extra in EXTRAS, f"pyproject.toml has no `{kind.extra}` extra"
    if kind.cpu_extra is not None:
        assert kind.cpu_extra in EXTRAS and kind.cpu_build is not None
    assert all(s in TRANSPORTS and TRANSPORTS.get(s).joins == "stream" for s in kind.streams)
    backends = typing.get_args(
        typing.get_args(typing.get_type_hints(WeightSyncConfig, include_extras=True)["backend"])[0]
    )
    assert set(kind.colocated_transports) <= set(backends)
    assert bool(kind.colocated_transports) != bool(
        kind.colocated_missing
    )  # a way to share a GPU, or what is missing
    cfg = RolloutConfig(backend=kind.name)
    assert isinstance(kind.takes_send_less(cfg), bool) and isinstance(kind.transfer_setting(cfg), str)
    assert isinstance(kind.runs_without_gpus(), bool)
    # send-less versions: a kind rebuilds them under some setting, or says why not (LoRA goes merged there)
    assert kind.rebuilds_send_less != bool(kind.send_less_missing)
    assert kind.rebuilds_send_less or not kind.takes_send_less(cfg)
    assert kind.served_dtype(cfg, "/nonexistent", "float32") in ("float32", "bfloat16", "float16")
    assert kind.kv_cache_tokens is None or kind.kv_cache_tokens(cfg) > 0
    assert isinstance(kind.on_gpu(cfg), bool)


def test_the_config_offers_exactly_the_registered_kinds():
    assert sorted(typing.get_args(KindName)) == sorted(KINDS)  # one name per entry
    for struct in (RolloutConfig, RewardServerLaunchConfig):
        annotated = typing.get_type_hints(struct, include_extras=True)["backend"]
        assert typing.get_args(annotated)[0] is KindName, struct.__name__
    with pytest.raises(msgspec.ValidationError, match="rollout.backend|backend"):
        msgspec.convert({"backend": "tgi"}, RolloutConfig)


def test_the_record_is_what_the_lower_layers_take(kind: ServerKind):
    """The launcher, the clients and weight sync each type the record by a protocol of their own."""
    from slipstream.rollouter.clients import ClientKind
    from slipstream.rollouter.launch import LaunchKind
    from slipstream.weightsync.adapters import AdapterKind

    for protocol in (ClientKind, LaunchKind, AdapterKind):
        for name in (n for n in vars(protocol) if not n.startswith("_")):
            assert hasattr(kind, name), f"{kind.name}: {protocol.__name__}.{name}"
    cfg = RolloutConfig(backend=kind.name)
    assert type(client_for(kind, cfg, "http://127.0.0.1:9")) is kind.client


def test_an_unknown_kind_names_the_key_and_the_known_kinds():
    with pytest.raises(
        ValueError, match="^rollout.backend: unknown inference server kind `tgi`; known kinds: "
    ):
        server_kind("tgi")
    with pytest.raises(ValueError, match="^reward.service.launch.backend: unknown"):
        server_kind("tgi", key="reward.service.launch.backend")


def test_each_kinds_classes_live_in_its_module():
    from slipstream.serverapi import EMBEDDED, SGLANG, VLLM
    from slipstream.serverkinds.embedded import EmbeddedAdapter
    from slipstream.serverkinds.sglang import SGLangAdapter, SGLangClient
    from slipstream.serverkinds.vllm import (
        VLLMAdapter,
        VLLMClient,
        build_completions_payload,  # noqa: F401
    )

    assert (SGLangClient, VLLMClient) == (server_kind("sglang").client, server_kind("vllm").client)
    assert server_kind("embedded").client is SGLangClient
    assert [EmbeddedAdapter, SGLangAdapter, VLLMAdapter] == [server_kind(k).adapter for k in KINDS]
    assert [EMBEDDED, SGLANG, VLLM] == [server_kind(k).api for k in KINDS]
    # No shims: a role's package offers no kind's class.
    assert not hasattr(importlib.import_module("slipstream.rollouter.clients"), "SGLangClient")
    assert not hasattr(importlib.import_module("slipstream.weightsync.adapters"), "VLLMAdapter")


def test_no_kind_is_imported_until_asked_for():
    code = (
        "import sys\n"
        "import slipstream.rollouter.launch, slipstream.rollouter.clients, slipstream.weightsync.adapters\n"
        "import slipstream.serverapi, slipstream.pipeline.modes\n"
        "print(sorted(m for m in sys.modules if m.startswith('slipstream.serverkinds.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


# A kind outside the package: one module, registered by one entry in KINDS.
TOY_KIND = """
import sys

from slipstream.serverapi import EMBEDDED
from slipstream.serverkinds import ServerKind
from slipstream.serverkinds.embedded import EmbeddedAdapter
from slipstream.serverkinds.sglang import SGLangClient


class ToyClient(SGLangClient):
    pass


class ToyAdapter(EmbeddedAdapter):
    kind = "toy"


def toy_command(model, host, port, cfg):
    return [sys.executable, "-m", "toy_server", "--model", model, "--host", host, "--port", str(port)]


KIND = ServerKind(
    name="toy", api=EMBEDDED, client=ToyClient, adapter=ToyAdapter, command=toy_command, title="toy",
    position_flag="--toy-overrides",
)
"""


def test_a_kind_is_one_module_plus_its_entry(tmp_path, monkeypatch):
    (tmp_path / "toy_kind.py").write_text(textwrap.dedent(TOY_KIND))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(KINDS, "toy", "toy_kind")
    kind = server_kind("toy")
    assert type(make_client(kind, "http://127.0.0.1:9")).__name__ == "ToyClient"
    assert kind.adapter.__name__ == "ToyAdapter" and kind.api is EMBEDDED
    argv = kind.argv("/m", "127.0.0.1", 1, RolloutConfig(max_position_embeddings=64))
    assert argv[2] == "toy_server" and argv[-2] == "--toy-overrides"
    assert list(KINDS)[-1] == "toy"
