"""Launch contracts: every flag (and value) our launcher passes to ``vllm serve`` / ``sglang.launch_server``.

Where the flags come from upstream, per server (:data:`LAUNCH`):

* ``parsers``: files whose ``add_argument("--flag", ...)`` calls register flags (string literals);
* ``field_classes``: classes whose fields become ``--field-name`` flags (vLLM's ``FrontendArgs``),
  and ``field_dirs``: folders of such classes (SGLang's ``arg_groups/fields``, where a field's
  ``Arg(cli_name=..., aliases=[...])`` may rename it and ``no_cli=True`` hides it);
* ``value_classes`` (with the field classes): where a flag's type is read, to check its value
  (a ``Literal`` choice, an int, a JSON object against a config class such as ``WeightTransferConfig``).

Environment variables we set for a server must be known to it (``env_files``), and the entry point we
run must exist (``entry``).
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field

from slipstream.contracts.ours import LaunchArgv
from slipstream.contracts.problems import Problem
from slipstream.contracts.upstream import FieldInfo, SourceTree
from slipstream.contracts.values import check_object, check_value


@dataclass(frozen=True)
class LaunchSpec:
    entry: str  # the module file the command runs
    parsers: tuple[str, ...]
    field_classes: tuple[tuple[str, str], ...] = ()  # (class, file)
    field_dirs: tuple[str, ...] = ()
    value_classes: tuple[tuple[str, str], ...] = ()
    env_files: tuple[str, ...] = ()
    skip: int = 0  # leading argv items that are not flags (executable, subcommand, positional model)


LAUNCH: dict[str, LaunchSpec] = {
    "vllm": LaunchSpec(
        entry="vllm/entrypoints/cli/serve.py",
        parsers=("vllm/engine/arg_utils.py", "vllm/entrypoints/common/cli_args.py"),
        field_classes=(("FrontendArgs", "vllm/entrypoints/common/cli_args.py"),),
        value_classes=(("EngineArgs", "vllm/engine/arg_utils.py"),),
        env_files=("vllm/envs.py",),
        skip=3,  # vllm serve MODEL
    ),
    "sglang": LaunchSpec(
        entry="sglang/launch_server.py",
        parsers=("sglang/srt/server_args.py",),
        field_dirs=("sglang/srt/arg_groups/fields/",),
        env_files=("sglang/srt/environ.py",),
        skip=3,  # python -m sglang.launch_server
    ),
}


@dataclass
class FlagIndex:
    flags: dict[str, str] = field(default_factory=dict)  # --flag -> file that registers it
    types: dict[str, FieldInfo] = field(default_factory=dict)  # --flag -> the field that types it


def _kebab(name: str) -> str:
    return "--" + name.replace("_", "-")


def flag_index(tree: SourceTree, spec: LaunchSpec) -> tuple[FlagIndex, list[str]]:
    """Upstream's flags for one server, and the source files of ``spec`` that are missing."""
    idx, gone = FlagIndex(), []
    for rel in spec.parsers:
        if rel not in tree.files:
            gone.append(rel)
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
    for name, rel in spec.field_classes + spec.value_classes:
        cls = tree.find_class(name, near=rel if rel in tree.files else None)
        if cls is None:
            gone.append(f"{rel} (class {name})")
            continue
        for f in cls.fields.values():
            idx.types.setdefault(_kebab(f.name), f)
            if (name, rel) in spec.field_classes:
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
    results = [check_value(tree, c, f.annotation, f.module, f.name) for c in candidates]
    if all(results):
        return [("", f"value {value!r} does not fit `{ast.unparse(f.annotation)}`")]  # type: ignore[arg-type]
    return []


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


def check_launch(trees: dict[str, SourceTree], argvs: list[LaunchArgv]) -> list[Problem]:
    problems: list[Problem] = []
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
        if spec.entry not in tree.files:
            problems.append(Problem(where, "", f"entry point {spec.entry} is gone", spec.entry, la.source))
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
        for var in la.env:
            files = [r for r in spec.env_files if r in tree.files]
            if files and not any(var in tree.text(r) for r in files):
                problems.append(
                    Problem(
                        where,
                        var,
                        "is not an environment variable upstream reads",
                        ", ".join(files),
                        la.source,
                    )
                )
    return problems
