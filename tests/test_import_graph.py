"""The import graph of ``slipstream/``: no module imports another that imports it back (directly or through
others, at module level or inside a function; ``TYPE_CHECKING`` imports aside), no shipped code imports
the tests, no role imports the whole-system tools in ``slipstream/system/`` (they import the roles), and no
role imports the root config ``slipstream/config.py`` (it builds each role's settings and hands them down;
``TYPE_CHECKING`` imports count here). An ``importlib.import_module("a.b")`` with a literal name is an import
like any other."""

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


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        # A package's __init__ reached from its own submodule is the package, not a cycle between modules.
        graph[name] = {
            m for m in _imports(path) if m in modules and m != name and not name.startswith(m + ".")
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
        f"slipstream.{r}" for r in ("queue", "rollouter", "agents", "trainer", "weightsync", "pipeline")
    )
    importers = sorted(
        name
        for name, deps in _graph().items()
        if name.startswith(roles) and any(d.startswith("slipstream.system") for d in deps)
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
