"""Python-API contracts: what our code imports from and calls on NIXL and megatron-core, checked with ``ast``.

From our source (every module under ``slipstream/`` that imports the package) the checker collects:

* ``from pkg.mod import Name`` / ``import pkg.mod as m``: the module must exist in the pinned wheel and
  define (or re-export) ``Name``;
* calls of imported names and module attributes (``GPTModel(config=...)``, ``ps.get_data_parallel_rank()``):
  the function or class must exist and accept the positional count and every keyword we pass (a
  dataclass or pydantic config class: its fields; another class: its ``__init__``);
* calls of what an upstream function returns (``get_forward_backward_func()(...)``): the upstream
  function's returned names are read from its body and the call is checked against each of them;
* method calls on objects of upstream classes (``self.agent.transfer(h)``, ``self.model.finish_grad_sync()``):
  a variable or attribute is typed when it is assigned the result of an upstream class, of an upstream
  function with a return annotation, or of one of our functions that returns such a call;
* class attributes and class methods of upstream classes (``WeightTransferEngineFactory.register_engine(
  name, module, cls)``, ``WeightTransferEngineFactory._registry``);
* our subclasses of upstream classes (our vLLM weight-transfer engine, whose base is imported inside a
  function so the module loads without vLLM): every abstract method upstream must be defined, an
  override must take the arguments upstream's callers pass, ``super().__init__(...)`` must fit, and every
  ``self.x`` our class reads but never sets must be set or declared upstream.

Only what can be resolved is checked; nothing is imported from either package.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from slipstream.contracts.problems import Problem
from slipstream.contracts.upstream import ClassInfo, Resolved, Signature, SourceTree

SRC = Path(__file__).resolve().parents[1]


@dataclass
class UseSite:
    file: str  # our file, relative to the repository
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


def our_files(root_package: str, src: Path = SRC) -> list[Path]:
    """Our modules that import ``root_package`` (e.g. ``nixl``, ``megatron``)."""
    out = []
    for path in sorted(src.rglob("*.py")):
        if "contracts" in path.relative_to(src).parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            mods = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else ([a.name for a in node.names] if isinstance(node, ast.Import) else [])
            )
            if any(m == root_package or m.startswith(root_package + ".") for m in mods):
                out.append(path)
                break
    return out


class _FileChecker:
    def __init__(self, tree: SourceTree, root: str, path: Path, label: str, where: str) -> None:
        self.tree, self.root, self.label, self.where = tree, root, label, where
        self.ast = ast.parse(path.read_text(encoding="utf-8"))
        self.bound: dict[str, Resolved] = {}  # local name -> upstream thing (imports, anywhere in the file)
        self.typed: dict[str, ClassInfo] = {}  # expression text ("self.agent") -> upstream class
        self.problems: list[Problem] = []
        self.checked = 0

    def site(self, node: ast.AST) -> str:
        return f"{self.label}:{getattr(node, 'lineno', 0)}"

    def problem(self, node: ast.AST, name: str, message: str, upstream: str = "") -> None:
        self.problems.append(Problem(self.where, name, message, upstream, self.site(node)))

    # ------------------------------------------------------------------ imports
    def bind_imports(self) -> None:
        for node in ast.walk(self.ast):
            if (
                isinstance(node, ast.ImportFrom)
                and not node.level
                and (node.module or "").split(".")[0] == self.root
            ):
                if self.tree.module_file(node.module) is None:  # type: ignore[arg-type]
                    self.problem(node, node.module, "module is gone upstream")  # type: ignore[arg-type]
                    continue
                for a in node.names:
                    self.checked += 1
                    res = self.tree.resolve_module_attr(node.module, a.name)  # type: ignore[arg-type]
                    if res is None:
                        self.problem(
                            node,
                            f"{node.module}.{a.name}",
                            "is not defined upstream",
                            self.tree.module_file(node.module) or "",
                        )  # type: ignore[arg-type]
                    else:
                        self.bound[a.asname or a.name] = res
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == self.root and a.asname:
                        rel = self.tree.module_file(a.name)
                        self.checked += 1
                        if rel is None:
                            self.problem(node, a.name, "module is gone upstream")
                        else:
                            self.bound[a.asname] = Resolved("module", rel, module=a.name)

    # ------------------------------------------------------------------ resolution
    def resolve_expr(self, expr: ast.expr) -> Resolved | None:
        if isinstance(expr, ast.Name):
            return self.bound.get(expr.id)
        if isinstance(expr, ast.Attribute):
            base = self.resolve_expr(expr.value)
            if base is not None and base.kind == "module":
                return self.tree.resolve_module_attr(base.module, expr.attr) or Resolved("missing", base.file)
        return None

    def class_of(self, res: Resolved) -> ClassInfo:
        return self.tree.class_info(res.file, res.node)  # type: ignore[arg-type]

    def returns_of(self, res: Resolved) -> list[Resolved]:
        """What calling ``res`` gives: a class instance, or the functions an upstream function returns."""
        if res.kind == "class":
            return [res]
        if res.kind != "function":
            return []
        fn = res.node
        if fn.returns is not None:  # type: ignore[union-attr]
            r = self.tree.resolve(res.file, ast.unparse(fn.returns).strip("'\""))  # type: ignore[union-attr]
            if r is not None and r.kind == "class":
                return [r]
        returned = {
            ast.unparse(n.value) for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None
        }  # type: ignore[arg-type]
        names = set(returned)
        for n in ast.walk(fn):  # type: ignore[arg-type]
            if isinstance(n, ast.Assign) and any(ast.unparse(t) in returned for t in n.targets):
                names.add(ast.unparse(n.value))
        out = []
        for name in sorted(names):
            r = self.tree.resolve(res.file, name)
            if r is not None and r.kind == "function":
                out.append(r)
        return out

    def signature(self, res: Resolved) -> Signature | None:
        if res.kind == "function":
            return self.tree.signature(res.file, res.node)  # type: ignore[arg-type]
        if res.kind == "class":
            cls = self.class_of(res)
            if cls.kind in ("dataclass", "pydantic", "msgspec"):
                names = list(cls.fields)
                required = {n for n, f in cls.fields.items() if f.required}
                positional = names if cls.kind == "dataclass" else []
                return Signature(
                    cls.name, cls.file, positional, [] if positional else names, required, False, cls.open
                )
            return self.tree.method(cls, "__init__")
        return None

    # ------------------------------------------------------------------ types of our variables
    def infer_types(self) -> None:
        local_returns: dict[str, list[Resolved]] = {}
        for fn in ast.walk(self.ast):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for r in ast.walk(fn):
                    if isinstance(r, ast.Return) and isinstance(r.value, ast.Call):
                        target = self.resolve_expr(r.value.func)
                        if target is not None and target.kind in ("class", "function"):
                            local_returns.setdefault(fn.name, []).extend(self.returns_of(target))
        for node in ast.walk(self.ast):
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
                continue
            func = node.value.func
            results: list[Resolved] = []
            target = self.resolve_expr(func)
            if target is not None and target.kind in ("class", "function"):
                results = self.returns_of(target)
            else:
                name = (
                    func.attr
                    if isinstance(func, ast.Attribute) and ast.unparse(func.value) == "self"
                    else (func.id if isinstance(func, ast.Name) else "")
                )
                results = local_returns.get(name, [])
            classes = [r for r in results if r.kind == "class"]
            if len(classes) == 1:
                for t in node.targets:
                    self.typed[ast.unparse(t)] = self.class_of(classes[0])

    # ------------------------------------------------------------------ calls
    def check_calls(self) -> None:
        for node in ast.walk(self.ast):
            if not isinstance(node, ast.Call):
                continue
            n_pos = None if any(isinstance(a, ast.Starred) for a in node.args) else len(node.args)
            kws = [k.arg for k in node.keywords if k.arg is not None]
            has_kwargs = any(k.arg is None for k in node.keywords)
            func = node.func
            if isinstance(func, ast.Call):  # get_forward_backward_func()(...)
                inner = self.resolve_expr(func.func)
                if inner is not None and inner.kind == "function":
                    for r in self.returns_of(inner):
                        self._check_sig(
                            node, ast.unparse(func) + "(...)", self.signature(r), n_pos, kws, has_kwargs
                        )
                continue
            res = self.resolve_expr(func)
            if res is not None:
                if res.kind == "missing":
                    self.problem(node, ast.unparse(func), "is not defined upstream", res.file)
                elif res.kind in ("class", "function"):
                    self._check_sig(node, ast.unparse(func), self.signature(res), n_pos, kws, has_kwargs)
                continue
            if isinstance(func, ast.Attribute):
                owner = self.typed.get(ast.unparse(func.value))
                if owner is not None:
                    sig = self.tree.method(owner, func.attr)
                    name = f"{owner.name}.{func.attr}"
                    if sig is None:
                        self.checked += 1
                        self.problem(node, name, "is not a method upstream", owner.file)
                    else:
                        self._check_sig(node, name, sig, n_pos, kws, has_kwargs)

    # ------------------------------------------------------------------ upstream classes used directly
    def upstream_class(self, expr: ast.expr) -> ClassInfo | None:
        res = self.resolve_expr(expr)
        return self.class_of(res) if res is not None and res.kind == "class" else None

    def check_class_members(self) -> None:
        """``UpstreamClass.attr`` (called or read): a method, or a class-level or instance attribute."""
        calls = {id(n.func): n for n in ast.walk(self.ast) if isinstance(n, ast.Call)}
        for node in ast.walk(self.ast):
            if not isinstance(node, ast.Attribute):
                continue
            cls = self.upstream_class(node.value)
            if cls is None:
                continue
            name = f"{cls.name}.{node.attr}"
            call = calls.get(id(node))
            sig = self.tree.method(cls, node.attr)
            if call is not None and sig is not None:
                n_pos = None if any(isinstance(a, ast.Starred) for a in call.args) else len(call.args)
                kws = [k.arg for k in call.keywords if k.arg is not None]
                self._check_sig(call, name, sig, n_pos, kws, any(k.arg is None for k in call.keywords))
                continue
            self.checked += 1
            if node.attr not in members(self.tree, cls):
                what = "a method" if call is not None else "an attribute"
                self.problem(node, name, f"is not {what} upstream", cls.file)

    # ------------------------------------------------------------------ our subclasses
    def base_class(self, base: ast.expr) -> ClassInfo | None:
        """The upstream class ``base`` names: imported, or a module-level name assigned the result of one of
        our functions that returns an imported upstream class (``_Base = _engine_base()``)."""
        direct = self.upstream_class(base)
        if direct is not None or not isinstance(base, ast.Name):
            return direct
        funcs = {n.name: n for n in self.ast.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for node in ast.walk(self.ast):
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == base.id for t in node.targets)
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name)
                and node.value.func.id in funcs
            ):
                for r in ast.walk(funcs[node.value.func.id]):
                    if isinstance(r, ast.Return) and r.value is not None:
                        found = self.upstream_class(r.value)
                        if found is not None:
                            return found
        return None

    def check_subclasses(self) -> None:
        for cls in (n for n in ast.walk(self.ast) if isinstance(n, ast.ClassDef)):
            for base in cls.bases:
                up = self.base_class(base)
                if up is not None:
                    self._check_subclass(cls, up)

    def _check_subclass(self, cls: ast.ClassDef, up: ClassInfo) -> None:
        ours = {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for name, (owner, fn) in upstream_methods(self.tree, up).items():
            self.checked += 1
            decos = {ast.unparse(d).split(".")[-1] for d in fn.decorator_list}
            mine = ours.get(name)
            if mine is None:
                if "abstractmethod" in decos:
                    self.problem(
                        cls, f"{cls.name}.{name}", f"is abstract in {owner.name} and not defined", owner.file
                    )
                continue
            if name.startswith("__") and name != "__init__":
                continue
            theirs, sig = self.tree.signature(owner.file, fn), self.tree.signature(self.label, mine)
            for err in sig.accepts(len(theirs.positional), []):  # upstream's callers pass its arity
                if not err.startswith("requires"):
                    self.problem(
                        mine,
                        f"{cls.name}.{name}",
                        f"overrides {owner.name}.{name}{_params(theirs)} but {err}",
                        owner.file,
                    )
            extra = sorted(sig.required - set(theirs.positional) - set(theirs.keyword_only))
            if extra:
                self.problem(
                    mine,
                    f"{cls.name}.{name}",
                    f"requires {extra}, which {owner.name}'s callers do not pass",
                    owner.file,
                )
        init = self.tree.method(up, "__init__")
        for node in ast.walk(cls):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "__init__"
                and isinstance(node.func.value, ast.Call)
                and ast.unparse(node.func.value.func) == "super"
                and init is not None
            ):
                kws = [k.arg for k in node.keywords if k.arg is not None]
                self._check_sig(node, f"{up.name}.__init__", init, len(node.args), kws, False)
        assigned = {
            t.attr
            for n in ast.walk(cls)
            if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"
        }
        defined = set(ours) | {
            t.id
            for n in cls.body
            if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Name)
        }
        known = members(self.tree, up)
        for node in ast.walk(cls):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Load)
                and ast.unparse(node.value) == "self"
                and node.attr not in assigned | defined
            ):
                self.checked += 1
                if node.attr not in known:
                    self.problem(
                        node,
                        f"self.{node.attr}",
                        f"is read by {cls.name} but neither it nor {up.name} sets it",
                        up.file,
                    )

    def _check_sig(self, node, name, sig: Signature | None, n_pos, kws, has_kwargs) -> None:
        self.checked += 1
        if sig is None:
            return
        errors = sig.accepts(n_pos if n_pos is not None else 0, kws)
        if n_pos is None or has_kwargs:
            errors = [e for e in errors if not e.startswith(("requires", "takes"))]
        for e in errors:
            self.problem(node, name, e, sig.file)


def _params(sig: Signature) -> str:
    return "(" + ", ".join(sig.positional + [f"*, {k}" for k in sig.keyword_only]) + ")"


def upstream_methods(
    tree: SourceTree, cls: ClassInfo, _depth: int = 0
) -> dict[str, tuple[ClassInfo, ast.FunctionDef]]:
    """Every method of ``cls`` and its upstream bases (the nearest definition wins): name -> (owner, def)."""
    out: dict[str, tuple[ClassInfo, ast.FunctionDef]] = {}
    if _depth > 10:
        return out
    for b in cls.node.bases:
        res = tree._base(cls.file, b)
        if res is not None:
            out.update(upstream_methods(tree, tree.class_info(res.file, res.node), _depth + 1))  # type: ignore[arg-type]
    for stmt in cls.node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[stmt.name] = (cls, stmt)  # type: ignore[assignment]
    return out


def members(tree: SourceTree, cls: ClassInfo, _depth: int = 0) -> set[str]:
    """Names an instance or the class has: methods, class-level names, and ``self.x`` set in any method,
    along the upstream bases."""
    names: set[str] = set()
    if _depth > 10:
        return names
    for stmt in cls.node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            names |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
    for n in ast.walk(cls.node):
        targets = (
            n.targets
            if isinstance(n, ast.Assign)
            else [n.target]
            if isinstance(n, (ast.AnnAssign, ast.AugAssign))
            else []
        )
        names |= {t.attr for t in targets if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"}
    for b in cls.node.bases:
        res = tree._base(cls.file, b)
        if res is not None:
            names |= members(tree, tree.class_info(res.file, res.node), _depth + 1)  # type: ignore[arg-type]
    return names


def check_python_api(
    tree: SourceTree, root: str, files: list[Path] | None = None, repo: Path | None = None
) -> tuple[list[Problem], int]:
    """Problems of our use of package ``root`` (nixl, megatron), and how many uses were checked."""
    repo = repo or SRC.parent
    problems: list[Problem] = []
    checked = 0
    for path in files if files is not None else our_files(root):
        label = path.relative_to(repo).as_posix() if path.is_relative_to(repo) else path.name
        fc = _FileChecker(tree, root, path, label, f"{root} API")
        fc.bind_imports()
        fc.infer_types()
        fc.check_calls()
        fc.check_class_members()
        fc.check_subclasses()
        problems += fc.problems
        checked += fc.checked
    return problems, checked
