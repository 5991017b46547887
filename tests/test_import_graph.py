"""The import graph of ``slipstream/``: no module imports another that imports it back (directly or through
others, at module level or inside a function; ``TYPE_CHECKING`` imports aside), no shipped code imports
the tests, no role imports the whole-system tools in ``slipstream/system/`` (they import the roles), no
role imports the root config ``slipstream/config.py`` (it builds each role's settings and hands them down),
each role imports only the roles design.md §2 allows it, and no role holds a bench command (they live in
``system/``; a role may keep a measurement its own code never imports). ``TYPE_CHECKING`` imports count for
all but the cycles. An ``importlib.import_module("a.b")`` with a literal name is an import like any other."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "slipstream"


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_by_name(node: ast.Call) -> str | None:
    """The module a call ``importlib.import_module("a.b")`` (or ``import_module``, ``__import__``) names, when
    the name is a literal."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name not in ("import_module", "__import__") or not node.args:
        return None
    first = node.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def _imports(path: Path, typing_too: bool = False) -> set[str]:
    """Every module ``path`` imports (``from a.b import c`` counts as ``a.b`` and ``a.b.c``), by statement or
    by a literal name given to ``importlib.import_module``; ``TYPE_CHECKING`` imports only with
    ``typing_too``."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(sub) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node)
        for sub in ast.walk(node)
    }  # fmt: skip
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only and not typing_too:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and (name := _imported_by_name(node)):
            found.add(name)
    return found


def _graph(typing_too: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        # A package's __init__ reached from its own submodule is the package, not a cycle between modules.
        graph[name] = {
            m
            for m in _imports(path, typing_too)
            if m in modules and m != name and not name.startswith(m + ".")
        }
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def _floors(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between floors: each top-level package (``slipstream.queue``) or module (``slipstream.config``)
    of the package, with its imports of the others (the house the code's own imports draw)."""

    def floor(name: str) -> str:
        return ".".join(name.split(".")[:2])

    out: dict[str, set[str]] = {}
    for src, targets in graph.items():
        out.setdefault(floor(src), set()).update(floor(t) for t in targets if floor(t) != floor(src))
    return out


def test_the_floors_form_no_circle():
    """Every package sits above all it imports (TYPE_CHECKING and importlib imports included), so no import
    runs back up a floor."""
    assert _cycles(_floors(_graph(typing_too=True))) == []
    assert _cycles(_floors({"slipstream.a.x": {"slipstream.b.y"}, "slipstream.b.z": {"slipstream.a"}})) == [
        ["slipstream.a", "slipstream.b"]
    ]


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_shipped_code_never_imports_the_tests():
    importers = sorted(
        name
        for name, path in _modules().items()
        for m in _imports(path)
        if m == "tests" or m.startswith("tests.")
    )
    assert importers == []


def test_no_role_imports_the_whole_system_tools():
    roles = tuple(
        f"slipstream.{r}"
        for r in (
            "queue",
            "rollouter",
            "agents",
            "trainer",
            "weightsync",
            "serverapi",
            "serverkinds",
            "pipeline",
        )
    )
    importers = sorted(
        name
        for name, path in _modules().items()
        if name.startswith(roles)
        and any(d.startswith("slipstream.system") for d in _imports(path, typing_too=True))
    )
    assert importers == []


ROLES = ("queue", "rollouter", "trainer", "weightsync", "agents", "serverapi")


def _config_importers(modules: dict[str, Path]) -> list[str]:
    roles = tuple(f"slipstream.{r}" for r in ROLES)
    return sorted(
        name
        for name, path in modules.items()
        if name.startswith(roles) and "slipstream.config" in _imports(path, typing_too=True)
    )


def test_no_role_imports_the_root_config():
    # `from slipstream import config` counts as slipstream.config too (a.b.c for `from a.b import c`).
    assert _config_importers(_modules()) == []


def test_the_config_check_sees_typing_and_importlib_imports(tmp_path):
    sources = {
        "typed": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from slipstream.config import Config\n",
        "by_name": "import importlib\ncfg = importlib.import_module('slipstream.config')\n",
        "package": "def f():\n    from slipstream import config\n",
        "base": "from slipstream.config_base import ConfigStruct\n",
    }
    modules = {}
    for name, text in sources.items():
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        modules[f"slipstream.queue.{name}"] = path
    modules["slipstream.pipeline.typed"] = tmp_path / "typed.py"  # above the roles: allowed
    assert _config_importers(modules) == [
        "slipstream.queue.by_name",
        "slipstream.queue.package",
        "slipstream.queue.typed",
    ]


# design.md §2, "Imports flow one way": the roles each role may import (utilities and config_base aside).
ALLOWED_ROLES = {
    "queue": set(),
    "weightsync": set(),
    "agents": set(),
    "rollouter": {"agents", "queue", "weightsync"},
    "trainer": {"queue", "weightsync"},
}


def _role_of(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED_ROLES else None


def _role_crossings(modules: dict[str, Path]) -> list[str]:
    """``module -> imported`` for every import from one role into another that design.md §2 does not allow."""
    known = set(_modules()) | set(modules)  # `from a.b import c` also yields a.b.c: keep the modules
    found = []
    for name, path in modules.items():
        role = _role_of(name)
        if role is None:
            continue
        for dep in sorted(_imports(path, typing_too=True) & known):
            other = _role_of(dep)
            if other is not None and other != role and other not in ALLOWED_ROLES[role]:
                found.append(f"{name} -> {dep}")
    return found


def test_roles_import_only_the_roles_design_allows():
    assert _role_crossings(_modules()) == []


def test_the_role_check_sees_a_forbidden_import(tmp_path):
    (tmp_path / "a.py").write_text("def f():\n    from slipstream.rollouter.config import RolloutConfig\n")
    (tmp_path / "b.py").write_text("from slipstream.queue.types import GroupMeta\n")
    modules = {"slipstream.weightsync.a": tmp_path / "a.py", "slipstream.rollouter.b": tmp_path / "b.py"}
    assert _role_crossings(modules) == ["slipstream.weightsync.a -> slipstream.rollouter.config"]


BENCH_ROLES = ("queue", "rollouter", "trainer", "weightsync", "agents", "serverapi", "serverkinds")


def _bench_problems(modules: dict[str, Path]) -> list[str]:
    """Role modules that build a ``slipstream bench`` command, and bench modules a role keeps (``bench*.py``)
    that have a ``main`` or are imported by their own role's code."""
    roles = tuple(f"slipstream.{r}." for r in BENCH_ROLES)
    found = []
    for name, path in modules.items():
        if not name.startswith(roles):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and str(node.args[0].value).startswith("slipstream bench")
            ):
                found.append(f"{name}: builds the `{node.args[0].value}` command")
        leaf = name.rsplit(".", 1)[1]
        if leaf.startswith("bench") or leaf.endswith("_bench"):
            if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
                found.append(f"{name}: a bench with a main")
            role = ".".join(name.split(".")[:2]) + "."
            found += [
                f"{name}: imported by {other}"
                for other, other_path in modules.items()
                if other.startswith(role) and name in _imports(other_path, typing_too=True)
            ]
    return sorted(found)


def test_no_role_holds_a_bench_command():
    assert _bench_problems(_modules()) == []


def test_the_bench_check_sees_a_bench_command(tmp_path):
    (tmp_path / "bench.py").write_text("def main():\n    command_parser('slipstream bench x', '')\n")
    (tmp_path / "user.py").write_text("from slipstream.trainer import bench\n")
    modules = {
        "slipstream.trainer.bench": tmp_path / "bench.py",
        "slipstream.trainer.user": tmp_path / "user.py",
    }
    assert _bench_problems(modules) == [
        "slipstream.trainer.bench: a bench with a main",
        "slipstream.trainer.bench: builds the `slipstream bench x` command",
        "slipstream.trainer.bench: imported by slipstream.trainer.user",
    ]


# Below the server kinds: they build on these, so these never reach up for a kind (they are handed its record).
BELOW_KINDS = (*ROLES, "config")


def _kind_importers(modules: dict[str, Path]) -> list[str]:
    below = tuple(f"slipstream.{r}" for r in BELOW_KINDS)
    return sorted(
        name
        for name, path in modules.items()
        if (name in below or name.startswith(tuple(f"{b}." for b in below)))
        and any(
            m == "slipstream.serverkinds" or m.startswith("slipstream.serverkinds.")
            for m in _imports(path, True)
        )
    )


def test_nothing_below_the_server_kinds_imports_them():
    assert _kind_importers(_modules()) == []


def test_the_kinds_check_sees_typing_and_importlib_imports(tmp_path):
    sources = {
        "typed": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from slipstream.serverkinds import ServerKind\n",
        "by_name": "import importlib\nkind = importlib.import_module('slipstream.serverkinds.vllm')\n",
        "package": "def f():\n    from slipstream import serverkinds\n",
        "api": "from slipstream.serverapi import VLLM\n",
    }
    modules = {}
    for name, text in sources.items():
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        modules[f"slipstream.weightsync.{name}"] = path
    modules["slipstream.pipeline.typed"] = tmp_path / "typed.py"  # above the kinds: allowed
    modules["slipstream.config"] = tmp_path / "by_name.py"  # the root config is below them
    assert _kind_importers(modules) == [
        "slipstream.config",
        "slipstream.weightsync.by_name",
        "slipstream.weightsync.package",
        "slipstream.weightsync.typed",
    ]


def _getattr_shims(modules: dict[str, Path]) -> list[str]:
    """Modules with a module-level ``__getattr__`` that hands out names from outside their own package (by
    module-path strings): shims for moved names, whose imports this graph cannot see. A package that loads
    its own submodules lazily (``slipstream.queue``) is no shim."""
    found = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        if not any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body):
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = {
            n.value.partition(":")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("slipstream.")
        }
        if not targets or any(t != package and not t.startswith(package + ".") for t in targets):
            found.append(name)
    return sorted(found)


def test_no_module_level_getattr_shims():
    assert _getattr_shims(_modules()) == []


def test_the_shim_check_tells_a_shim_from_a_lazy_package(tmp_path):
    shim = (
        "import importlib\n_MOVED = {'X': 'slipstream.serverkinds.vllm'}\ndef __getattr__(n):\n    return 1\n"
    )
    lazy = "import importlib\n_EXPORTS = {'Y': 'slipstream.queue.types'}\ndef __getattr__(n):\n    return 1\n"
    (tmp_path / "shim.py").write_text(shim)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text(lazy)
    modules = {
        "slipstream.weightsync.adapters": tmp_path / "shim.py",
        "slipstream.queue": tmp_path / "pkg" / "__init__.py",
    }
    assert _getattr_shims(modules) == ["slipstream.weightsync.adapters"]


def test_test_modules_have_unique_basenames():
    """The test folders have no __init__.py, so pytest imports each test module under its file name alone: two
    files of one name in different folders fail the whole collection ("import file mismatch")."""
    tests = Path(__file__).resolve().parent
    names: dict[str, list[str]] = {}
    for path in tests.rglob("*.py"):
        if path.name not in ("conftest.py", "__init__.py"):
            names.setdefault(path.name, []).append(str(path.relative_to(tests)))
    assert {n: p for n, p in names.items() if len(p) > 1} == {}
