"""An index of upstream Python sources read with :mod:`ast`, never imported.

vLLM and SGLang do not import on a CPU machine without their CUDA dependencies, and even where they
would, importing would only tell us about the installed version, not the pinned one. So the checker
parses the pinned release's files (``cache.py``) and reads what it needs from the syntax tree:

* classes (pydantic models, dataclasses, msgspec Structs, plain classes): their fields or ``__init__``
  parameters, inherited ones included, and whether a pydantic model lets unknown fields through;
* functions: their parameters (positional, keyword-only, ``*args``/``**kwargs``);
* FastAPI routes: ``@app.post("/x")``, ``@router.api_route("/x", methods=[...])`` and
  ``router.add_api_route("/x", handler, methods=[...])``, with the handler's definition;
* names across modules: ``from a.b import C`` followed to where ``C`` is defined, so re-exports in
  ``__init__.py`` files resolve.

Files are parsed lazily and cached; a class is looked up by a plain text search first, so a lookup
parses only the few files that mention it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

HTTP_METHODS = ("get", "post", "put", "delete", "patch")


@dataclass
class FieldInfo:
    name: str
    annotation: ast.expr | None
    required: bool
    module: str  # the file the annotation is written in (names resolve there)


@dataclass
class ClassInfo:
    name: str
    file: str
    node: ast.ClassDef
    kind: str  # pydantic | dataclass | msgspec | enum | plain
    fields: dict[str, FieldInfo]
    open: bool  # unknown keys are accepted (pydantic extra="allow", or **kwargs in __init__)


@dataclass
class Signature:
    name: str
    file: str
    positional: list[str]  # positional-or-keyword parameters, in order (self/cls dropped)
    keyword_only: list[str]
    required: set[str]
    varargs: bool
    varkw: bool

    def accepts(self, n_positional: int, keywords: list[str]) -> list[str]:
        """Why a call with ``n_positional`` arguments and these keywords would fail ('' list: fine)."""
        errors = []
        if n_positional > len(self.positional) and not self.varargs:
            errors.append(f"takes at most {len(self.positional)} positional arguments, got {n_positional}")
        names = set(self.positional) | set(self.keyword_only)
        for kw in keywords:
            if kw not in names and not self.varkw:
                errors.append(f"has no parameter `{kw}`")
        given = set(self.positional[:n_positional]) | set(keywords)
        for req in sorted(self.required - given):
            errors.append(f"requires `{req}`, which the call does not pass")
        return errors


@dataclass
class Route:
    path: str
    methods: set[str]
    file: str
    handler: ast.FunctionDef | ast.AsyncFunctionDef


@dataclass
class Resolved:
    """What a name means in a module: a class, a function, a module-level value (type alias), a module."""

    kind: str  # class | function | value | module
    file: str
    node: ast.AST | None = None
    module: str = ""


@dataclass
class _Module:
    tree: ast.Module
    defs: dict[str, ast.AST] = field(default_factory=dict)  # top-level classes, functions, assignments
    # alias -> [(module, name)]: several when imports are alternatives (try/except ImportError)
    imports: dict[str, list[tuple[str, str | None]]] = field(default_factory=dict)


class SourceTree:
    """Python sources under one or more roots (each holding top-level packages), keyed by relative path."""

    def __init__(self, roots: list[Path] | Path) -> None:
        self.roots = [Path(r) for r in (roots if isinstance(roots, list) else [roots])]
        self._modules: dict[str, _Module] = {}
        self.unparsable: dict[str, str] = {}  # file -> syntax error (such files are read as empty)

    # ------------------------------------------------------------------ files
    @cached_property
    def files(self) -> dict[str, Path]:
        out: dict[str, Path] = {}
        for root in self.roots:
            for path in sorted(root.rglob("*.py")):
                out.setdefault(path.relative_to(root).as_posix(), path)
        return out

    @cached_property
    def _texts(self) -> dict[str, str]:
        return {rel: p.read_text(encoding="utf-8", errors="replace") for rel, p in self.files.items()}

    def text(self, rel: str) -> str:
        return self._texts[rel]

    def grep(self, pattern: str) -> list[str]:
        rx = re.compile(pattern, re.M)
        return [rel for rel, text in self._texts.items() if rx.search(text)]

    def module(self, rel: str) -> _Module:
        mod = self._modules.get(rel)
        if mod is None:
            try:
                tree = ast.parse(self.text(rel), filename=rel)
            except SyntaxError as err:  # syntax newer than this interpreter's: the file reads as empty
                self.unparsable[rel] = str(err)
                tree = ast.Module(body=[], type_ignores=[])
            mod = _Module(tree)
            package = rel[: -len("/__init__.py")] if rel.endswith("/__init__.py") else rel.rsplit("/", 1)[0]
            for node in tree.body:
                self._index_top(node, mod, package.replace("/", "."))
            self._modules[rel] = mod
        return mod

    def _index_top(self, node: ast.AST, mod: _Module, package: str) -> None:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            mod.defs[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    mod.defs[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            mod.defs[node.target.id] = node
        elif isinstance(node, ast.Import):
            for a in node.names:
                target = (a.name if a.asname else a.name.split(".")[0], None)
                mod.imports.setdefault(a.asname or a.name.split(".")[0], []).append(target)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            for a in node.names:
                if a.name != "*":
                    mod.imports.setdefault(a.asname or a.name, []).append((base, a.name))
        elif isinstance(node, (ast.If, ast.Try)):  # TYPE_CHECKING blocks, optional imports
            for child in (
                node.body
                + getattr(node, "orelse", [])
                + [s for h in getattr(node, "handlers", []) for s in h.body]
            ):
                self._index_top(child, mod, package)

    def module_file(self, dotted: str) -> str | None:
        base = dotted.replace(".", "/")
        for rel in (f"{base}.py", f"{base}/__init__.py"):
            if rel in self.files:
                return rel
        return None

    # ------------------------------------------------------------------ names
    def resolve(self, rel: str, name: str, _depth: int = 0) -> Resolved | None:
        """What ``name`` (possibly dotted, ``mod.Name``) means inside file ``rel``."""
        if _depth > 12:
            return None
        head, _, rest = name.partition(".")
        mod = self.module(rel)
        found: Resolved | None = None
        if head in mod.defs:
            node = mod.defs[head]
            kind = (
                "class"
                if isinstance(node, ast.ClassDef)
                else ("function" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else "value")
            )
            found = Resolved(kind, rel, node)
        else:
            for modname, attr in mod.imports.get(head, []):
                found = self._resolve_import(modname, attr, _depth)
                if found is not None:
                    break
        if found is None or not rest:
            return found
        if found.kind == "module":
            return self.resolve(found.file, rest, _depth + 1)
        return None

    def _resolve_import(self, modname: str, attr: str | None, depth: int) -> Resolved | None:
        if attr is None:
            target = self.module_file(modname)
            return Resolved("module", target, module=modname) if target else None
        sub = self.module_file(f"{modname}.{attr}")
        target = self.module_file(modname)
        if target is not None and (attr in self.module(target).defs or attr in self.module(target).imports):
            return self.resolve(target, attr, depth + 1)
        if sub is not None:
            return Resolved("module", sub, module=f"{modname}.{attr}")
        return None

    def resolve_module_attr(self, dotted_module: str, attr: str) -> Resolved | None:
        rel = self.module_file(dotted_module)
        if rel is None:
            return None
        res = self.resolve(rel, attr)
        if res is None:
            sub = self.module_file(f"{dotted_module}.{attr}")
            if sub is not None:
                return Resolved("module", sub, module=f"{dotted_module}.{attr}")
        return res

    def find_class(self, name: str, near: str | None = None) -> ClassInfo | None:
        """The class ``name``: resolved from file ``near`` if given, else the first definition found."""
        if near is not None:
            res = self.resolve(near, name)
            if res is not None and res.kind == "class":
                return self.class_info(res.file, res.node)  # type: ignore[arg-type]
        for rel in self.grep(rf"^\s*class\s+{re.escape(name)}\b"):
            node = self.module(rel).defs.get(name)
            if isinstance(node, ast.ClassDef):
                return self.class_info(rel, node)
        return None

    # ------------------------------------------------------------------ classes
    def class_info(self, rel: str, node: ast.ClassDef, _depth: int = 0) -> ClassInfo:
        bases = [self._base(rel, b) for b in node.bases] if _depth < 10 else []
        base_infos = [self.class_info(b.file, b.node, _depth + 1) for b in bases if b is not None]  # type: ignore[arg-type]
        base_names = {ast.unparse(b).split(".")[-1] for b in node.bases}
        kind = _class_kind(node, base_names, base_infos)
        fields: dict[str, FieldInfo] = {}
        open_ = any(b.open for b in base_infos if b.kind == kind or b.kind == "pydantic")
        for b in reversed(base_infos):
            if b.kind in ("pydantic", "dataclass", "msgspec"):
                fields.update(b.fields)
        init = next(
            (
                s
                for s in node.body
                if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == "__init__"
            ),
            None,
        )
        if kind in ("pydantic", "dataclass", "msgspec"):
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    name = stmt.target.id
                    if name.startswith("_") or _is_classvar(stmt.annotation):
                        continue
                    fields[name] = FieldInfo(name, stmt.annotation, _field_required(stmt), rel)
                elif _is_extra_allow(stmt):
                    open_ = True
        elif init is not None or kind == "plain":
            sig = self.signature(rel, init) if init is not None else None
            if sig is None:
                inherited = next((b for b in base_infos if b.fields or b.open), None)
                if inherited is not None:
                    fields, open_ = dict(inherited.fields), inherited.open
            else:
                args = init.args
                anns = {a.arg: a.annotation for a in args.posonlyargs + args.args + args.kwonlyargs}
                fields = {
                    p: FieldInfo(p, anns.get(p), p in sig.required, rel)
                    for p in sig.positional + sig.keyword_only
                }
                open_ = sig.varkw
        return ClassInfo(node.name, rel, node, kind, fields, open_)

    def _base(self, rel: str, base: ast.expr) -> Resolved | None:
        if isinstance(base, ast.Subscript):  # Generic[T], BaseModel subclasses with params
            base = base.value
        res = self.resolve(rel, ast.unparse(base))
        return res if res is not None and res.kind == "class" else None

    def method(self, cls: ClassInfo, name: str, _depth: int = 0) -> Signature | None:
        """The signature of ``cls.name``, looked up along the bases."""
        for stmt in cls.node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                return self.signature(cls.file, stmt)
        if _depth > 10:
            return None
        for b in cls.node.bases:
            res = self._base(cls.file, b)
            if res is not None:
                found = self.method(self.class_info(res.file, res.node), name, _depth + 1)  # type: ignore[arg-type]
                if found is not None:
                    return found
        return None

    def signature(self, rel: str, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Signature:
        a = fn.args
        positional = [x.arg for x in a.posonlyargs + a.args]
        is_method = bool(positional) and positional[0] in ("self", "cls") and not _is_staticmethod(fn)
        defaults_start = len(positional) - len(a.defaults)
        required = {p for i, p in enumerate(positional) if i < defaults_start}
        required |= {x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is None}
        if is_method:
            required.discard(positional[0])
            positional = positional[1:]
        return Signature(
            fn.name,
            rel,
            positional,
            [x.arg for x in a.kwonlyargs],
            required,
            a.vararg is not None,
            a.kwarg is not None,
        )

    # ------------------------------------------------------------------ routes
    @cached_property
    def routes(self) -> list[Route]:
        out: list[Route] = []
        for rel in self.grep(r"^\s*@\w+\.(get|post|put|delete|patch|api_route)\(|\.add_api_route\("):
            mod = self.module(rel)
            for node in ast.walk(mod.tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for deco in node.decorator_list:
                        route = _decorator_route(deco, rel, node)
                        if route is not None:
                            out.append(route)
                elif isinstance(node, ast.Call) and _attr_name(node.func) == "add_api_route":
                    route = self._added_route(node, rel, mod)
                    if route is not None:
                        out.append(route)
        return out

    def _added_route(self, call: ast.Call, rel: str, mod: _Module) -> Route | None:
        if len(call.args) < 2 or not _is_str(call.args[0]) or not isinstance(call.args[1], ast.Name):
            return None
        handler = mod.defs.get(call.args[1].id)
        if not isinstance(handler, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return None
        methods = _methods_kw(call) or {"GET"}
        return Route(call.args[0].value, methods, rel, handler)  # type: ignore[union-attr]

    def find_routes(self, path: str, method: str) -> list[Route]:
        return [r for r in self.routes if _path_matches(r.path, path) and method.upper() in r.methods]


# ---------------------------------------------------------------------------------------- helpers
def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    base = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
    return ".".join(base + ([node.module] if node.module else []))


def _attr_name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else (node.id if isinstance(node, ast.Name) else "")


def _is_str(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _methods_kw(call: ast.Call) -> set[str] | None:
    for kw in call.keywords:
        if kw.arg == "methods" and isinstance(kw.value, (ast.List, ast.Tuple, ast.Set)):
            return {e.value.upper() for e in kw.value.elts if _is_str(e)}  # type: ignore[union-attr]
    return None


def _decorator_route(deco: ast.expr, rel: str, fn) -> Route | None:
    if not isinstance(deco, ast.Call) or not isinstance(deco.func, ast.Attribute):
        return None
    verb = deco.func.attr
    if verb not in HTTP_METHODS and verb != "api_route":
        return None
    if not deco.args or not _is_str(deco.args[0]):
        return None
    path = deco.args[0].value  # type: ignore[union-attr]
    if not path.startswith("/"):
        return None
    methods = {verb.upper()} if verb in HTTP_METHODS else (_methods_kw(deco) or {"GET"})
    return Route(path, methods, rel, fn)


def _path_matches(template: str, path: str) -> bool:
    if "{" not in template:
        return template == path
    rx = re.sub(r"\\\{[^}]*\\\}", "[^/]+", re.escape(template))
    rx = rx.replace("[^/]+", ".+") if ":path" in template else rx
    return re.fullmatch(rx, path) is not None


def _class_kind(node: ast.ClassDef, base_names: set[str], bases: list[ClassInfo]) -> str:
    decos = {ast.unparse(d).split("(")[0].split(".")[-1] for d in node.decorator_list}
    if "dataclass" in decos or "config" in decos:
        return "dataclass"
    if "BaseModel" in base_names or any(b.kind == "pydantic" for b in bases):
        return "pydantic"
    if "Struct" in base_names or any(b.kind == "msgspec" for b in bases):
        return "msgspec"
    if base_names & {"Enum", "IntEnum", "StrEnum"} or any(b.kind == "enum" for b in bases):
        return "enum"
    if any(b.kind == "dataclass" for b in bases):
        return "dataclass"
    return "plain"


def _is_classvar(ann: ast.expr) -> bool:
    return ast.unparse(ann).startswith(("ClassVar", "typing.ClassVar"))


def _field_required(stmt: ast.AnnAssign) -> bool:
    value = stmt.value
    if value is None:
        return True
    if isinstance(value, ast.Call) and _attr_name(value.func) in ("Field", "field"):
        kws = {k.arg for k in value.keywords}
        if kws & {"default", "default_factory"}:
            return False
        if value.args and not (isinstance(value.args[0], ast.Constant) and value.args[0].value is Ellipsis):
            return False
        return True
    return False


def _is_extra_allow(stmt: ast.stmt) -> bool:
    if not (
        isinstance(stmt, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "model_config" for t in stmt.targets)
    ):
        return False
    text = ast.unparse(stmt.value)
    return bool(re.search(r"extra\s*=\s*['\"]allow['\"]", text)) or "Extra.allow" in text


def _is_staticmethod(fn) -> bool:
    return any(ast.unparse(d) == "staticmethod" for d in fn.decorator_list)
