"""Launch contracts: every flag (and value) our launcher passes to ``vllm serve`` / ``sglang.launch_server``.

Where the flags come from upstream, per server (:data:`LAUNCH`):

* ``parsers``: files whose ``add_argument("--flag", ...)`` calls register flags (string literals);
* ``field_classes``: classes whose fields become ``--field-name`` flags (vLLM's ``FrontendArgs``),
  and ``field_dirs``: folders of such classes (SGLang's ``arg_groups/fields``, where a field's
  ``Arg(cli_name=..., aliases=[...])`` may rename it and ``no_cli=True`` hides it);
* ``value_classes`` (with the field classes): where a flag's type is read, to check its value
  (a ``Literal`` choice, an int, a JSON object against a config class such as ``WeightTransferConfig``).

A file or class may move between the releases a server is checked against (vLLM's ``FrontendArgs`` lives in
``entrypoints/launchers/cli_args.py`` in 0.32 and ``entrypoints/common/cli_args.py`` in 0.33): such an entry
lists its places as ``"a.py|b.py"``, and the first one the release has is read.

Environment variables we set for a server must be known to it: its own (``env_prefix``) in ``env_files``,
others (``OMP_NUM_THREADS``) anywhere in its sources. The module we run (``python -m MODULE``) must exist
and run as a script; a command that is not ``-m`` is checked against ``entry``. A flag value naming an
entry of an upstream registry (:data:`REGISTRIES`: vLLM's weight-transfer engines) must be registered
there, or by one of our plug-ins (``ours.plugin_registrations``). A list flag (``list[T]``) takes its items
one per value (argparse's ``nargs="+"``, or ``action="append"`` for vLLM's ``--middleware``): each value is
checked against ``T``.

A flag whose value upstream imports and wires into the server (:data:`MIDDLEWARE`: vLLM's ``--middleware``,
our token gate) must name a class of ours, and the release must still add such a class with
``app.add_middleware`` after its own middleware, so that it sees every request first; a release that drops
the flag, or applies it otherwise, fails the contract rather than serving its control routes open.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
from dataclasses import dataclass, field

from slipstream.contracts.ours import LaunchArgv
from slipstream.contracts.problems import Problem
from slipstream.contracts.upstream import FieldInfo, SourceTree
from slipstream.contracts.values import check_object, check_value


@dataclass(frozen=True)
class LaunchSpec:
    entry: str  # the module file a command that is not ``python -m MODULE`` runs
    parsers: tuple[str, ...]
    field_classes: tuple[tuple[str, str], ...] = ()  # (class, file)
    field_dirs: tuple[str, ...] = ()
    value_classes: tuple[tuple[str, str], ...] = ()
    env_files: tuple[str, ...] = ()
    env_prefix: str = ""  # the server's own environment variables, which must be read in env_files
    skip: int = 0  # leading argv items that are not flags (executable, subcommand, positional model)


LAUNCH: dict[str, LaunchSpec] = {
    "vllm": LaunchSpec(
        entry="vllm/entrypoints/cli/serve.py",
        parsers=(
            "vllm/engine/arg_utils.py",
            "vllm/entrypoints/common/cli_args.py|vllm/entrypoints/launchers/cli_args.py",
        ),
        field_classes=(
            ("FrontendArgs", "vllm/entrypoints/common/cli_args.py|vllm/entrypoints/launchers/cli_args.py"),
        ),
        value_classes=(("EngineArgs", "vllm/engine/arg_utils.py"),),
        env_files=("vllm/envs.py",),
        env_prefix="VLLM_",
        skip=3,  # python -m vllm.entrypoints.openai.api_server (vllm serve MODEL: also 3)
    ),
    "sglang": LaunchSpec(
        entry="sglang/launch_server.py",
        parsers=("sglang/srt/server_args.py",),
        field_dirs=("sglang/srt/arg_groups/fields/",),
        env_files=("sglang/srt/environ.py",),
        env_prefix="SGLANG_",
        skip=3,  # python -m sglang.launch_server
    ),
}


@dataclass(frozen=True)
class Registry:
    """Names registered upstream by calls ``<owner>.<method>("name", ...)`` (in any file), which a JSON
    flag's ``key`` must name; ``plugin_group``: the entry-point group through which our plug-ins add
    names with the same call."""

    owner: str
    method: str
    plugin_group: str = ""


# (server kind, flag, key of its JSON value) -> the registry its value must name.
REGISTRIES: dict[tuple[str, str, str], Registry] = {
    ("vllm", "--weight-transfer-config", "backend"): Registry(
        "WeightTransferEngineFactory", "register_engine", plugin_group="vllm.general_plugins"
    ),
}


def _first(tree: SourceTree, places: str) -> str | None:
    """The first of ``"a.py|b.py"`` that the release has."""
    return next((rel for rel in places.split("|") if rel in tree.files), None)


def registered_names(tree: SourceTree, reg: Registry) -> dict[str, str]:
    """name -> upstream file, for every ``Owner.method("name", ...)`` call in the release."""
    out: dict[str, str] = {}
    for rel in tree.grep(rf"{reg.owner}\.{reg.method}\("):
        for node in ast.walk(tree.module(rel).tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == reg.method
                and ast.unparse(node.func.value).split(".")[-1] == reg.owner
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                out.setdefault(node.args[0].value, rel)
    return out


def _entry_errors(tree: SourceTree, spec: LaunchSpec, argv: list[str]) -> list[tuple[str, str]]:
    """(field, message) when the module or file the command runs is missing or does not run as a script."""
    if len(argv) >= 3 and argv[1] == "-m":
        module = argv[2]
        rel = tree.module_file(module)
        if rel is None:
            return [(module, "is run with `python -m` but the module is gone")]
        main = tree.module_file(f"{module}.__main__") if rel.endswith("__init__.py") else rel
        if main is None or "__main__" not in tree.text(main):
            return [(module, 'is run with `python -m` but has no `if __name__ == "__main__"` block')]
        return []
    if spec.entry and spec.entry not in tree.files:
        return [("", f"entry point {spec.entry} is gone")]
    return []


@dataclass
class FlagIndex:
    flags: dict[str, str] = field(default_factory=dict)  # --flag -> file that registers it
    types: dict[str, FieldInfo] = field(default_factory=dict)  # --flag -> the field that types it


def _kebab(name: str) -> str:
    return "--" + name.replace("_", "-")


def flag_index(tree: SourceTree, spec: LaunchSpec) -> tuple[FlagIndex, list[str]]:
    """Upstream's flags for one server, and the source files of ``spec`` that are missing."""
    idx, gone = FlagIndex(), []
    for places in spec.parsers:
        rel = _first(tree, places)
        if rel is None:
            gone.append(places)
            continue
        for node in ast.walk(tree.module(rel).tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"
            ):
                for a in node.args:
                    if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--"):
                        idx.flags.setdefault(a.value, rel)
    for name, places in spec.field_classes + spec.value_classes:
        cls = tree.find_class(name, near=_first(tree, places))
        if cls is None:
            gone.append(f"{places} (class {name})")
            continue
        for f in cls.fields.values():
            idx.types.setdefault(_kebab(f.name), f)
            if (name, places) in spec.field_classes:
                idx.flags.setdefault(_kebab(f.name), cls.file)
    for folder in spec.field_dirs:
        files = [rel for rel in tree.files if rel.startswith(folder)]
        if not files:
            gone.append(folder)
        for rel in files:
            for node in tree.module(rel).tree.body:
                if isinstance(node, ast.ClassDef):
                    _arg_group_fields(node, rel, idx)
    return idx, gone


def _arg_group_fields(node: ast.ClassDef, rel: str, idx: FlagIndex) -> None:
    """Fields annotated ``A[T, "help"]`` or ``A[T, Arg(...)]``: a flag each, renamed or hidden by Arg."""
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        ann = stmt.annotation
        if not (
            isinstance(ann, ast.Subscript)
            and ast.unparse(ann.value) == "A"
            and isinstance(ann.slice, ast.Tuple)
        ):
            continue
        inner, meta = ann.slice.elts[0], ann.slice.elts[1]
        names, hidden = [_kebab(stmt.target.id)], False
        if isinstance(meta, ast.Call):
            for kw in meta.keywords:
                if kw.arg == "cli_name" and isinstance(kw.value, ast.Constant):
                    names[0] = kw.value.value
                elif kw.arg == "aliases" and isinstance(kw.value, (ast.List, ast.Tuple)):
                    names += [e.value for e in kw.value.elts if isinstance(e, ast.Constant)]
                elif kw.arg == "no_cli" and isinstance(kw.value, ast.Constant) and kw.value.value:
                    hidden = True
        if hidden:
            continue
        info = FieldInfo(stmt.target.id, inner, stmt.value is None, rel)
        for n in names:
            idx.flags.setdefault(n, rel)
            idx.types.setdefault(n, info)


def parse_argv(argv: list[str], skip: int) -> list[tuple[str, str | None]]:
    """(flag, value or None) pairs after the first ``skip`` items; ``--a=b`` and ``--a b`` both work."""
    out: list[tuple[str, str | None]] = []
    rest = argv[skip:]
    i = 0
    while i < len(rest):
        tok = rest[i]
        if tok.startswith("--"):
            if "=" in tok:
                flag, value = tok.split("=", 1)
                out.append((flag, value))
            elif i + 1 < len(rest) and not rest[i + 1].startswith("--"):
                out.append((tok, rest[i + 1]))
                i += 1
            else:
                out.append((tok, None))
        i += 1
    return out


def _value_errors(tree: SourceTree, value: str, f: FieldInfo) -> list[tuple[str, str]]:
    """Errors of a flag value against the field that types it; a JSON object is checked field by field."""
    if value.lstrip().startswith("{"):
        try:
            obj = json.loads(value)
        except ValueError:
            return [("", f"value {value!r} is not valid JSON")]
        return [(k, m) for k, m in _object_errors(tree, obj, f)]
    candidates: list = [value]
    for conv in (int, float):
        try:
            candidates.append(conv(value))
        except ValueError:
            pass
    if value.lower() in ("true", "false"):
        candidates.append(value.lower() == "true")
    ann = _item_annotation(f.annotation)
    results = [check_value(tree, c, ann, f.module, f.name) for c in candidates]
    if all(results):
        return [("", f"value {value!r} does not fit `{ast.unparse(f.annotation)}`")]  # type: ignore[arg-type]
    return []


def _item_annotation(ann: ast.expr | None) -> ast.expr | None:
    """``T`` of a ``list[T]`` flag (each value on the command line is one item); any other annotation as is."""
    if isinstance(ann, ast.Subscript) and ast.unparse(ann.value).split(".")[-1] in ("list", "List"):
        return ann.slice
    return ann


def _object_errors(tree: SourceTree, obj: dict, f: FieldInfo) -> list[tuple[str, str]]:
    errs = check_value(tree, obj, f.annotation, f.module, f.name)
    if errs:
        return errs
    # dict-typed flags parsed into a class later: check against the class named in the annotation
    for node in ast.walk(f.annotation) if f.annotation is not None else []:
        if isinstance(node, ast.Name) and node.id[:1].isupper():
            res = tree.resolve(f.module, node.id)
            if res is not None and res.kind == "class":
                cls = tree.class_info(res.file, res.node)  # type: ignore[arg-type]
                if cls.kind in ("pydantic", "dataclass", "msgspec"):
                    return check_object(tree, cls, obj, f.name)
    return []


def _registry_errors(
    tree: SourceTree, kind: str, flag: str, value: str, plugins: dict[tuple[str, str], dict[str, str]]
) -> list[tuple[str, str, str]]:
    """(field, message, upstream file) for a JSON flag value naming what no registry entry registers."""
    out: list[tuple[str, str, str]] = []
    for (k, f, key), reg in REGISTRIES.items():
        if k != kind or f != flag or not value.lstrip().startswith("{"):
            continue
        try:
            name = json.loads(value).get(key)
        except (ValueError, AttributeError):
            continue
        if not isinstance(name, str):
            continue
        upstream = registered_names(tree, reg)
        ours = plugins.get((reg.owner, reg.method), {})
        if name not in upstream and name not in ours:
            files = sorted(set(upstream.values())) or [""]
            known = sorted(upstream) + sorted(ours)
            msg = (
                f"`{name}` is registered neither upstream ({reg.owner}.{reg.method}) nor by our "
                f"{reg.plugin_group or ''} plug-ins (known: {', '.join(known)})"
            )
            out.append((f"{flag} {key}", msg, files[0]))
    return out


@dataclass(frozen=True)
class MiddlewareUse:
    """How a release applies the class a flag names: the file that loops over the flag's values (``loop``,
    a regex) must import each by its dotted path and pass a class to ``add``, and that call must be the file's
    last ``add_middleware`` (Starlette puts the last one added outermost)."""

    loop: str
    add: str


# (server kind, flag) -> how upstream applies its value.
MIDDLEWARE: dict[tuple[str, str], MiddlewareUse] = {
    ("vllm", "--middleware"): MiddlewareUse(
        loop=r"for (\w+) in args\.middleware:", add="add_middleware(imported)"
    ),
}


def _middleware_errors(tree: SourceTree, use: MiddlewareUse, value: str) -> list[tuple[str, str, str]]:
    """(field, message, upstream file) when our value names no class, or the release no longer adds it last."""
    out = [("", message, "") for message in _our_class_errors(value)]
    files = tree.grep(use.loop)
    if not files:
        return [*out, ("", f"no upstream code applies the flag's values any more (`{use.loop}`)", "")]
    text = tree.text(files[0])
    tail = text[re.search(use.loop, text).start() :]  # type: ignore[union-attr]
    if "import_module(" not in tail or use.add not in tail:
        out.append(("", f"upstream no longer imports each value and adds a class with `{use.add}`", files[0]))
    elif text.rfind("add_middleware(") != text.rfind(use.add):
        message = f"upstream adds middleware after `{use.add}`: ours would no longer see every request first"
        out.append(("", message, files[0]))
    return out


def _our_class_errors(value: str) -> list[str]:
    """What is wrong with ``value`` as the dotted path of one of our classes (imported here)."""
    module, _, name = value.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        return [f"names {value}, which does not import here: {err}"]
    if not inspect.isclass(found):
        return [f"names {value}, which is not a class (upstream adds a class as ASGI middleware)"]
    return []


def check_launch(trees: dict[str, SourceTree], argvs: list[LaunchArgv]) -> list[Problem]:
    from slipstream.contracts.ours import plugin_registrations

    problems: list[Problem] = []
    plugins = {
        (reg.owner, reg.method): plugin_registrations(reg.plugin_group, reg.method)
        for reg in REGISTRIES.values()
        if reg.plugin_group
    }
    cache: dict[str, tuple[FlagIndex, list[str]]] = {}
    for la in argvs:
        spec, tree = LAUNCH[la.kind], trees[la.kind]
        where = f"{la.kind} launch"
        if la.kind not in cache:
            cache[la.kind] = flag_index(tree, spec)
            problems += [
                Problem(where, "", f"upstream parser source {g} is gone", g) for g in cache[la.kind][1]
            ]
        idx, _ = cache[la.kind]
        for sub, msg in _entry_errors(tree, spec, la.argv):
            problems.append(Problem(where, sub, msg, tree.module_file(sub) or "", la.source))
        for flag, value in parse_argv(la.argv, spec.skip):
            known = idx.flags.get(flag)
            if known is None and flag.startswith("--no-"):
                known = idx.flags.get("--" + flag[5:])
            if known is None:
                problems.append(
                    Problem(
                        where,
                        flag,
                        "is not a flag of the upstream parser",
                        ", ".join(spec.parsers),
                        la.source,
                    )
                )
                continue
            f = idx.types.get(flag)
            if value is not None and f is not None and f.annotation is not None:
                for sub, msg in _value_errors(tree, value, f):
                    name = f"{flag} {sub}".strip()
                    problems.append(Problem(where, name, msg, f.module, la.source))
            if value is not None:
                for sub, msg, up in _registry_errors(tree, la.kind, flag, value, plugins):
                    problems.append(Problem(where, sub, msg, up, la.source))
            use = MIDDLEWARE.get((la.kind, flag))
            if use is not None and value is not None:
                for sub, msg, up in _middleware_errors(tree, use, value):
                    problems.append(Problem(where, f"{flag} {sub}".strip(), msg, up, la.source))
        for var in la.env:
            own = not spec.env_prefix or var.startswith(spec.env_prefix)
            files = [r for r in spec.env_files if r in tree.files] if own else []
            if own and files and not any(var in tree.text(r) for r in files):
                problems.append(
                    Problem(
                        where,
                        var,
                        "is not an environment variable upstream reads",
                        ", ".join(files),
                        la.source,
                    )
                )
            elif not own and not tree.grep(rf"[\"']{var}[\"']"):
                problems.append(
                    Problem(where, var, "is set for the server but appears nowhere upstream", "", la.source)
                )
    return problems
