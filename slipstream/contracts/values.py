"""Does a JSON value fit an upstream type annotation? Read from the annotation's syntax tree.

Understood: ``str``/``int``/``float``/``bool``, ``None``, ``Optional``/``Union``/``X | Y``,
``Literal[...]``, ``Annotated[T, ...]``, ``list``/``tuple``/``dict`` (and their ``typing`` forms),
forward references in strings, module-level aliases (``PauseMode = Literal[...]``) and model classes
(pydantic, dataclass, msgspec: their fields are checked in turn). Anything else (``Any``, type
variables, names that do not resolve) is taken to accept the value: the checker reports only what it
can prove wrong.
"""

from __future__ import annotations

import ast
from typing import Any

from slipstream.contracts.upstream import ClassInfo, SourceTree

Errors = list[tuple[str, str]]  # (field path, message)

_LISTS = {
    "list",
    "List",
    "Sequence",
    "MutableSequence",
    "Iterable",
    "set",
    "Set",
    "frozenset",
    "tuple",
    "Tuple",
}
_DICTS = {"dict", "Dict", "Mapping", "MutableMapping", "OrderedDict", "defaultdict"}
_ANY = {"Any", "object", "JsonValue", "Json"}
_MAX_DEPTH = 8


def _json_type(value: Any) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "object"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


def check_value(
    tree: SourceTree, value: Any, ann: ast.expr | None, rel: str, path: str, depth: int = 0
) -> Errors:
    """Errors for ``value`` at ``path`` against annotation ``ann`` written in file ``rel``."""
    if ann is None or depth > _MAX_DEPTH:
        return []
    if isinstance(ann, ast.Constant):
        if ann.value is None:
            return [] if value is None else [(path, f"must be null, got {_json_type(value)}")]
        if isinstance(ann.value, str):
            try:
                ann = ast.parse(ann.value, mode="eval").body
            except SyntaxError:
                return []
            return check_value(tree, value, ann, rel, path, depth + 1)
        return []
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
        return _union(tree, value, [ann.left, ann.right], rel, path, depth, ann)
    if isinstance(ann, ast.Subscript):
        return _subscript(tree, value, ann, rel, path, depth)
    if isinstance(ann, (ast.Name, ast.Attribute)):
        return _named(tree, value, ann, rel, path, depth)
    return []


def _flatten_union(ann: ast.expr) -> list[ast.expr]:
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
        return _flatten_union(ann.left) + _flatten_union(ann.right)
    return [ann]


def _union(tree, value, options, rel, path, depth, whole) -> Errors:
    """Fits if any option fits. Otherwise the errors of the one option whose shape fits (an object against
    one model among ``X | None``), or a single error naming the whole union."""
    flat = [x for o in options for x in _flatten_union(o)]
    shaped: list[Errors] = []
    for opt in flat:
        errs = check_value(tree, value, opt, rel, path, depth + 1)
        if not errs:
            return []
        if all(p != path for p, _ in errs):
            shaped.append(errs)
    if len(shaped) == 1:
        return shaped[0]
    text = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return [(path, f"{_json_type(value)} {text} does not fit `{ast.unparse(whole)}`")]


def _subscript(tree, value, ann: ast.Subscript, rel, path, depth) -> Errors:
    head = ast.unparse(ann.value).split(".")[-1]
    args = list(ann.slice.elts) if isinstance(ann.slice, ast.Tuple) else [ann.slice]
    if head == "Optional":
        return [] if value is None else check_value(tree, value, args[0], rel, path, depth + 1)
    if head == "Union":
        return _union(tree, value, args, rel, path, depth, ann)
    if head == "Annotated":
        return check_value(tree, value, args[0], rel, path, depth + 1)
    if head == "Literal":
        return _literal(tree, value, args, rel, path, ann)
    if head in _LISTS:
        if not isinstance(value, list):
            return [(path, f"must be a list (`{ast.unparse(ann)}`), got {_json_type(value)}")]
        if head in ("tuple", "Tuple") and not (len(args) == 2 and _is_ellipsis(args[1])):
            if len(args) != len(value) and not (len(args) == 1 and _is_empty_tuple(args[0])):
                return [(path, f"must have {len(args)} items (`{ast.unparse(ann)}`), got {len(value)}")]
            return [
                e
                for i, (v, a) in enumerate(zip(value, args, strict=False))
                for e in check_value(tree, v, a, rel, f"{path}[{i}]", depth + 1)
            ]
        errs: Errors = []
        for i, item in enumerate(value[:8]):
            errs += check_value(tree, item, args[0], rel, f"{path}[{i}]", depth + 1)
        return errs
    if head in _DICTS:
        if not isinstance(value, dict):
            return [(path, f"must be an object (`{ast.unparse(ann)}`), got {_json_type(value)}")]
        if len(args) == 2:
            return [
                e
                for k, v in value.items()
                for e in check_value(tree, v, args[1], rel, f"{path}.{k}", depth + 1)
            ]
        return []
    return check_value(tree, value, ann.value, rel, path, depth + 1)  # a generic class: Foo[T]


def _literal(tree, value, args, rel, path, ann) -> Errors:
    allowed: list[Any] = []
    for a in args:
        if isinstance(a, ast.Constant):
            allowed.append(a.value)
        else:  # a nested alias or enum member: give up rather than guess
            return []
    if value in allowed and type(value) in {type(x) for x in allowed}:
        return []
    return [(path, f"{value!r} is not one of {allowed} (`{ast.unparse(ann)}`)")]


def _named(tree, value, ann, rel, path, depth) -> Errors:
    text = ast.unparse(ann)
    name = text.split(".")[-1]
    if name in _ANY:
        return []
    scalar = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,), "bytes": (str,)}
    if name in scalar:
        ok = isinstance(value, scalar[name]) and not (name in ("int", "float") and isinstance(value, bool))
        return [] if ok else [(path, f"must be {name}, got {_json_type(value)} {value!r}")]
    if name == "None":
        return [] if value is None else [(path, f"must be null, got {_json_type(value)}")]
    if name in _LISTS:
        return [] if isinstance(value, list) else [(path, f"must be a list, got {_json_type(value)}")]
    if name in _DICTS:
        return [] if isinstance(value, dict) else [(path, f"must be an object, got {_json_type(value)}")]
    res = tree.resolve(rel, text)
    if res is None:
        return []
    if res.kind == "class":
        info = tree.class_info(res.file, res.node)  # type: ignore[arg-type]
        if info.kind in ("pydantic", "dataclass", "msgspec"):
            if not isinstance(value, dict):
                return [(path, f"must be an object ({info.name}), got {_json_type(value)}")]
            return check_object(tree, info, value, path, depth + 1)
        return []
    if res.kind == "value":
        node = res.node
        expr = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(expr, (ast.Subscript, ast.BinOp, ast.Name, ast.Attribute)):
            if isinstance(expr, ast.Subscript) and ast.unparse(expr.value).split(".")[-1] in (
                "TypeVar",
                "NewType",
            ):
                return []
            return check_value(tree, value, expr, res.file, path, depth + 1)
    return []


def check_object(tree: SourceTree, cls: ClassInfo, obj: dict, path: str, depth: int = 0) -> Errors:
    """Unknown keys, missing required keys and ill-typed values of ``obj`` as an instance of ``cls``."""
    errs: Errors = []
    prefix = f"{path}." if path else ""
    for key, val in obj.items():
        f = cls.fields.get(key)
        if f is None:
            why = " (it accepts unknown fields and ignores them)" if cls.open else ""
            errs.append((f"{prefix}{key}", f"is not a field of {cls.name}{why}"))
            continue
        errs += check_value(tree, val, f.annotation, f.module, f"{prefix}{key}", depth)
    for name, f in cls.fields.items():
        if f.required and name not in obj:
            errs.append((f"{prefix}{name}", f"is required by {cls.name} but not sent"))
    return errs


def _is_ellipsis(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is Ellipsis


def _is_empty_tuple(node: ast.expr) -> bool:
    return isinstance(node, ast.Tuple) and not node.elts
