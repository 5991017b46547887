"""HTTP contracts: every request our clients and adapters send, checked against the pinned server's routes.

For each recorded request the checker finds the FastAPI route with that path and method in the
upstream sources, reads how its handler takes input, and checks what we send:

* a body model (``obj: GenerateReqInput``, ``Annotated[AbortReq, Body()]``, pydantic or dataclass):
  every key we send must be a field, its value must fit the field's annotation, required fields must
  be there; a model that accepts unknown fields (vLLM's ``extra="allow"``) still gets unknown keys
  reported, since upstream would silently drop them;
* embedded body parameters (``Annotated[T, Body(embed=True)]``) and query parameters
  (``Annotated[T, Query()]`` or plain scalars): by name and type (query values are strings on the wire);
* a handler that reads the raw JSON (``body = await raw_request.json(); body.get("k")``): only keys it
  reads.

Some fields are typed ``dict`` upstream and parsed later into a class (SGLang's ``sampling_params``,
vLLM's weight-transfer ``init_info``); :data:`NESTED` names those classes. Which class parses vLLM's
``init_info``/``update_info`` depends on the server's weight-transfer engine (each call notes the engine
it was recorded for): vLLM's own for ``nccl``, and for ``slipstream`` the msgspec structs of OUR plug-in
(:data:`PLUGIN_NESTED`: the classes its ``parse_init_info``/``parse_update_info`` convert with, read from
the plug-in's source and imported), checked the way the plug-in parses: ``msgspec.convert``, plus every key
we send, nested ones included, must be a field (msgspec drops unknown keys silently). A body field that
one engine's class parses, sent for an engine no class is named for, is a problem too: nothing goes
unchecked. :data:`VALIDATORS` names upstream functions that are pure Python (msgspec only) and are run on
our bodies as they are.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from typing import Any

import msgspec

from slipstream.contracts.ours import HttpCall
from slipstream.contracts.problems import Problem
from slipstream.contracts.upstream import ClassInfo, FieldInfo, Route, SourceTree
from slipstream.contracts.values import check_object, check_value

# (server kind, path, body key, engine) -> (class name, file to resolve it from): dicts parsed by upstream
# later; engine "" for any call, else only calls recorded for that vLLM weight-transfer engine.
NESTED: dict[tuple[str, str, str, str], tuple[str, str]] = {
    ("sglang", "/generate", "sampling_params", ""): (
        "SamplingParams",
        "sglang/srt/sampling/sampling_params.py",
    ),
    ("vllm", "/init_weight_transfer_engine", "init_info", "nccl"): (
        "NCCLWeightTransferInitInfo",
        "vllm/distributed/weight_transfer/nccl_common.py",
    ),
    ("vllm", "/update_weights", "update_info", "nccl"): (
        "NCCLWeightTransferUpdateInfo",
        "vllm/distributed/weight_transfer/nccl_engine.py",
    ),
}

# (server kind, path, body key, engine) -> (our plug-in's file, its engine class, the method that parses
# the key): dicts our own plug-in parses inside the server (``rollouter/vllm_weights.py``).
PLUGIN_NESTED: dict[tuple[str, str, str, str], tuple[str, str, str]] = {
    ("vllm", "/init_weight_transfer_engine", "init_info", "slipstream"): (
        "slipstream/rollouter/vllm_weights.py",
        "SlipstreamWeightEngine",
        "parse_init_info",
    ),
    ("vllm", "/update_weights", "update_info", "slipstream"): (
        "slipstream/rollouter/vllm_weights.py",
        "SlipstreamWeightEngine",
        "parse_update_info",
    ),
}
# (server kind, path) -> (file, class, classmethod): upstream's own schema check, run on our body.
VALIDATORS: dict[tuple[str, str], tuple[str, str, str]] = {
    ("sglang", "/generate"): ("sglang/api/v1/api_types.py", "GenerateRequest", "from_json_value"),
}

_RAW_TYPES = {"Request", "Response", "BackgroundTasks", "WebSocket", "HTTPConnection"}
_SKIP_MARKERS = {"Depends", "Header", "Path", "Cookie", "Security", "File", "Form"}


@dataclass
class HandlerSpec:
    route: Route
    query: dict[str, FieldInfo] = field(default_factory=dict)
    body_params: dict[str, tuple[FieldInfo, ClassInfo | None]] = field(default_factory=dict)
    raw_keys: set[str] | None = None

    @property
    def single_model(self) -> ClassInfo | None:
        """The body is one model's fields (FastAPI's rule: one non-embedded body parameter)."""
        if len(self.body_params) == 1:
            f, model = next(iter(self.body_params.values()))
            if model is not None and not getattr(f, "embed", False):
                return model
        return None


def handler_spec(tree: SourceTree, route: Route) -> HandlerSpec:
    spec = HandlerSpec(route)
    fn, rel = route.handler, route.file
    a = fn.args
    params = a.posonlyargs + a.args + a.kwonlyargs
    defaults: dict[str, ast.expr | None] = {p.arg: None for p in params}
    pos = a.posonlyargs + a.args
    for p, d in zip(pos[len(pos) - len(a.defaults) :], a.defaults, strict=True):
        defaults[p.arg] = d
    for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        defaults[p.arg] = d
    raw_names: list[str] = []
    for p in params:
        if p.arg in ("self", "cls"):
            continue
        inner, marker, embed = _unwrap(p.annotation, defaults[p.arg])
        required = defaults[p.arg] is None or _marker_required(defaults[p.arg])
        info = FieldInfo(p.arg, inner, required, rel)
        text = ast.unparse(inner).split(".")[-1] if inner is not None else ""
        if marker in _SKIP_MARKERS:
            continue
        if text in _RAW_TYPES:
            raw_names.append(p.arg)
            continue
        if marker == "Query":
            spec.query[p.arg] = info
            continue
        model = _model(tree, rel, inner)
        if marker == "Body" or model is not None:
            info.embed = embed  # type: ignore[attr-defined]
            spec.body_params[p.arg] = (info, model)
        else:
            spec.query[p.arg] = info
    if not spec.body_params:
        spec.raw_keys = _raw_keys(fn, raw_names)
    return spec


def _unwrap(ann: ast.expr | None, default: ast.expr | None) -> tuple[ast.expr | None, str, bool]:
    """(inner annotation, FastAPI marker name or '', Body(embed=True))."""
    marker, embed, inner = "", False, ann
    calls: list[ast.Call] = []
    if isinstance(ann, ast.Subscript) and ast.unparse(ann.value).split(".")[-1] == "Annotated":
        elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
        inner = elts[0]
        calls += [e for e in elts[1:] if isinstance(e, ast.Call)]
    if isinstance(default, ast.Call):
        calls.append(default)
    for c in calls:
        name = ast.unparse(c.func).split(".")[-1]
        marker = marker or name
        embed = embed or any(
            k.arg == "embed" and isinstance(k.value, ast.Constant) and k.value.value is True
            for k in c.keywords
        )
    return inner, marker, embed


def _marker_required(default: ast.expr) -> bool:
    if not isinstance(default, ast.Call):
        return False
    if any(k.arg in ("default", "default_factory") for k in default.keywords):
        return False
    if default.args:
        return isinstance(default.args[0], ast.Constant) and default.args[0].value is Ellipsis
    return ast.unparse(default.func).split(".")[-1] in ("Query", "Body")


def _model(tree: SourceTree, rel: str, ann: ast.expr | None) -> ClassInfo | None:
    if not isinstance(ann, (ast.Name, ast.Attribute)):
        return None
    res = tree.resolve(rel, ast.unparse(ann))
    if res is None or res.kind != "class":
        return None
    info = tree.class_info(res.file, res.node)  # type: ignore[arg-type]
    return info if info.kind in ("pydantic", "dataclass", "msgspec") else None


def _raw_keys(fn: ast.AST, request_names: list[str]) -> set[str] | None:
    """Keys read from ``x = await request.json()`` in the handler; None when it never reads the body."""
    body_vars: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Await):
            call = node.value.value
            if (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and call.func.attr == "json"
                and ast.unparse(call.func.value) in request_names
            ):
                body_vars |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    if not body_vars:
        return None
    keys: set[str] = set()
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and ast.unparse(node.func.value) in body_vars
            and node.args
        ):
            if isinstance(node.args[0], ast.Constant):
                keys.add(node.args[0].value)
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) in body_vars:
            if isinstance(node.slice, ast.Constant):
                keys.add(node.slice.value)
    return keys


# -------------------------------------------------------------------------------------- checking
def check_against(tree: SourceTree, spec: HandlerSpec, call: HttpCall) -> list[tuple[str, str, str]]:
    """(field, message, upstream file) for each mismatch of ``call`` against one handler."""
    out: list[tuple[str, str, str]] = []
    rfile = spec.route.file
    for key, value in call.params.items():
        q = spec.query.get(key)
        if q is None:
            out.append(
                (
                    key,
                    f"is not a query parameter of the handler (it takes: {sorted(spec.query) or 'none'})",
                    rfile,
                )
            )
        elif _query_errors(tree, value, q):
            out.append((key, f"query value {value!r} does not fit `{ast.unparse(q.annotation)}`", rfile))  # type: ignore[arg-type]
    for key, q in spec.query.items():
        if q.required and key not in call.params:
            out.append((key, "is a required query parameter, not sent", rfile))
    body = call.body if call.body is not None else {}
    model = spec.single_model
    if model is not None:
        if not isinstance(body, dict):
            return out + [("", f"body must be a JSON object ({model.name})", model.file)]
        out += [(f, m, model.file) for f, m in check_object(tree, model, body, "")]
    elif spec.body_params:
        if not isinstance(body, dict):
            return out + [("", "body must be a JSON object", rfile)]
        for key, value in body.items():
            if key not in spec.body_params:
                out.append(
                    (
                        key,
                        f"is not a body parameter of the handler (it takes: {sorted(spec.body_params)})",
                        rfile,
                    )
                )
                continue
            info, cls = spec.body_params[key]
            if cls is not None:
                errs = (
                    check_object(tree, cls, value, key)
                    if isinstance(value, dict)
                    else [(key, f"must be an object ({cls.name})")]
                )
                out += [(f, m, cls.file) for f, m in errs]
            else:
                out += [(f, m, rfile) for f, m in check_value(tree, value, info.annotation, rfile, key)]
        for key, (info, _) in spec.body_params.items():
            if info.required and key not in body:
                out.append((key, "is a required body field, not sent", rfile))
    elif body:
        if not isinstance(body, dict):
            out.append(("", "the handler reads no JSON object here", rfile))
        elif spec.raw_keys is None:
            out += [(k, "is sent in a body the handler never reads", rfile) for k in body]
        else:
            out += [
                (k, f"is never read by the handler (it reads: {sorted(spec.raw_keys)})", rfile)
                for k in body
                if k not in spec.raw_keys
            ]
    return out


def _query_errors(tree: SourceTree, raw: str, q: FieldInfo) -> bool:
    candidates: list[Any] = [raw]
    if raw.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        candidates.append(raw.lower() in ("true", "1", "yes", "on"))
    try:
        candidates.append(int(raw))
    except ValueError:
        pass
    try:
        candidates.append(float(raw))
    except ValueError:
        pass
    return all(check_value(tree, c, q.annotation, q.module, q.name) for c in candidates)


def _nested(tree: SourceTree, kind: str, call: HttpCall, where: str) -> list[Problem]:
    out: list[Problem] = []
    if not isinstance(call.body, dict):
        return out
    by_engine = {(k, p, key) for k, p, key, e in [*NESTED, *PLUGIN_NESTED] if e}
    for k, path, key in sorted(by_engine):
        covered = (k, path, key, call.engine)
        if k == kind and path == call.path and key in call.body and covered not in NESTED | PLUGIN_NESTED:
            engines = sorted(
                e for kk, pp, kkey, e in [*NESTED, *PLUGIN_NESTED] if (kk, pp, kkey) == (k, path, key)
            )
            msg = (
                f"is parsed by the server's weight-transfer engine, and no class is known for engine "
                f"{call.engine or '(none recorded)'} (known: {', '.join(engines)})"
            )
            out.append(Problem(where, key, msg, "", call.origin))
    for (k, path, key, engine), (rel, cls_name, method) in PLUGIN_NESTED.items():
        if k != kind or path != call.path or key not in call.body or engine != call.engine:
            continue
        try:
            cls = plugin_parser_class(rel, cls_name, method)
        except LookupError as err:
            out.append(Problem(where, key, str(err), rel, call.origin))
            continue
        values = call.body[key] if isinstance(call.body[key], list) else [call.body[key]]
        for v in values:
            where_ours = f"{where} (engine {engine}: our plug-in parses it)"
            out += [
                Problem(where_ours, f, m, _module_file(cls), call.origin)
                for f, m in check_struct(cls, v, key)
            ]
    for (k, path, key, engine), (cls_name, near) in NESTED.items():
        if k != kind or path != call.path or key not in call.body or (engine and engine != call.engine):
            continue
        cls = tree.find_class(cls_name, near=near if near in tree.files else None)
        if cls is None:
            out.append(
                Problem(where, key, f"upstream class {cls_name} (which parses it) is gone", near, call.origin)
            )
            continue
        values = call.body[key] if isinstance(call.body[key], list) else [call.body[key]]
        for v in values:
            if isinstance(v, dict):
                out += [
                    Problem(where, f, m, cls.file, call.origin) for f, m in check_object(tree, cls, v, key)
                ]
    return out


def plugin_parser_class(rel: str, cls_name: str, method: str) -> type:
    """The class our plug-in's ``cls_name.method`` converts its input with: the name, imported in the method
    or its module, that the method passes to a call (``_convert(data, InitWeightsUpdateGroupReq, ...)``).
    Raises LookupError naming what is missing."""
    from slipstream.contracts.ours import REPO

    path = REPO / rel
    if not path.exists():
        raise LookupError(f"our plug-in {rel} is gone")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name), None)
    fn = next(
        (n for n in (cls.body if cls else []) if isinstance(n, ast.FunctionDef) and n.name == method), None
    )
    if fn is None:
        raise LookupError(f"our plug-in has no {cls_name}.{method}")
    imported: dict[str, str] = {}
    for scope in (tree, fn):
        for node in ast.walk(scope):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.update({a.asname or a.name: f"{node.module}:{a.name}" for a in node.names})
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            for arg in node.args:
                if isinstance(arg, ast.Name) and arg.id in imported:
                    module, _, name = imported[arg.id].partition(":")
                    found = getattr(importlib.import_module(module), name, None)
                    if isinstance(found, type) and issubclass(found, msgspec.Struct):
                        return found
    raise LookupError(f"our plug-in's {cls_name}.{method} converts with no msgspec Struct found")


def _module_file(cls: type) -> str:
    """Our file that defines ``cls``, relative to the repository."""
    from pathlib import Path

    from slipstream.contracts.ours import REPO

    path = Path(sys.modules[cls.__module__].__file__ or "").resolve()
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name


def check_struct(cls: type, value: Any, path: str) -> list[tuple[str, str]]:
    """Errors of ``value`` as input to ``msgspec.convert(value, cls)`` (what our plug-in runs), plus every
    key that no field takes, at any depth (msgspec ignores unknown keys)."""
    errs = _unknown_keys(msgspec.inspect.type_info(cls), value, path, 0)
    try:
        msgspec.convert(value, cls)
    except msgspec.ValidationError as err:
        errs.append((path, f"{cls.__name__} rejects it: {err}"))
    return errs


def _unknown_keys(t: Any, value: Any, path: str, depth: int) -> list[tuple[str, str]]:
    mi = msgspec.inspect
    if depth > 8:
        return []
    if isinstance(t, mi.Metadata):
        return _unknown_keys(t.type, value, path, depth + 1)
    if isinstance(t, mi.UnionType):
        shaped = [x for x in t.types if isinstance(x, mi.StructType) and isinstance(value, dict)]
        return _unknown_keys(shaped[0], value, path, depth + 1) if len(shaped) == 1 else []
    if isinstance(t, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)) and isinstance(
        value, list
    ):
        return [
            e for i, v in enumerate(value) for e in _unknown_keys(t.item_type, v, f"{path}[{i}]", depth + 1)
        ]
    if isinstance(t, mi.DictType) and isinstance(value, dict):
        return [e for k, v in value.items() for e in _unknown_keys(t.value_type, v, f"{path}.{k}", depth + 1)]
    if not isinstance(t, mi.StructType):
        return []
    fields = {f.encode_name: f for f in t.fields}
    if t.array_like and isinstance(value, list):
        return [
            e
            for i, (f, v) in enumerate(zip(t.fields, value, strict=False))
            for e in _unknown_keys(f.type, v, f"{path}[{i}]", depth + 1)
        ]
    if not isinstance(value, dict):
        return []
    out: list[tuple[str, str]] = []
    for k, v in value.items():
        if k not in fields:
            out.append((f"{path}.{k}", f"is not a field of {t.cls.__name__} (msgspec drops unknown keys)"))
        else:
            out += _unknown_keys(fields[k].type, v, f"{path}.{k}", depth + 1)
    return out


_LOADED: dict[str, Any] = {}


def _validator(tree: SourceTree, kind: str, call: HttpCall, where: str) -> list[Problem]:
    entry = VALIDATORS.get((kind, call.path))
    if entry is None or call.body is None:
        return []
    rel, cls_name, method = entry
    if rel not in tree.files:
        return [Problem(where, "", f"upstream schema module {rel} is gone", rel, call.origin)]
    path = tree.files[rel]
    mod = _LOADED.get(str(path))
    if mod is None:
        name = f"_slipstream_contract_{len(_LOADED)}"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[name] = mod
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
        _LOADED[str(path)] = mod
    try:
        getattr(getattr(mod, cls_name), method)(call.body)
    except Exception as err:
        return [
            Problem(
                where,
                "",
                f"upstream's own schema check ({cls_name}.{method}) rejects our body: {err}",
                rel,
                call.origin,
            )
        ]
    return []


def check_http(trees: dict[str, SourceTree], calls: list[HttpCall]) -> list[Problem]:
    """Problems of every recorded call; ``trees`` maps a server kind (vllm, sglang) to its sources."""
    problems: list[Problem] = []
    specs: dict[tuple[str, str, str], list[HandlerSpec]] = {}
    for call in calls:
        tree = trees[call.kind]
        where = f"{call.kind} {call.endpoint}"
        key = (call.kind, call.method, call.path)
        if key not in specs:
            specs[key] = [handler_spec(tree, r) for r in tree.find_routes(call.path, call.method)]
        if not specs[key]:
            other = sorted({m for r in tree.routes if r.path == call.path for m in r.methods})
            why = f"only {', '.join(other)} is routed" if other else "no such route"
            problems.append(Problem(where, "", f"endpoint missing upstream: {why}", "", call.origin))
            continue
        results = [check_against(tree, s, call) for s in specs[key]]
        best = min(results, key=len)
        problems += [Problem(where, f, m, up, call.origin) for f, m, up in best]
        problems += _nested(tree, call.kind, call, where)
        problems += _validator(tree, call.kind, call, where)
    return problems
