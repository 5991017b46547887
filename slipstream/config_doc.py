"""What every config key means, read from the typed configs themselves.

Each field of a :class:`~slipstream.config_base.ConfigStruct` carries its meaning in
``Meta(description=...)`` and each section in its class docstring. One walk over msgspec's type info
(:func:`sections`) turns them into :class:`KeyDoc` rows (dotted key, type with bounds, default, meaning),
which feed every place a person reads about keys:

* ``--help`` of ``slipstream train``, ``slipstream config show``, ``slipstream serve`` and
  ``slipstream queue serve`` (:func:`slipstream.cli_args.add_config_options`), and of the options a bench or
  ``slipstream data make`` borrows from the config (:func:`slipstream.cli_args.add_key_option`);
* docs/config.md, written by ``slipstream config docs`` (:func:`markdown`), which a test keeps current;
* ``slipstream config schema``: msgspec's JSON schema, descriptions included, for editors' YAML checks.

Why not tyro: it is not a dependency, it builds its own parser around ``--section.key value`` flags while
our interface is dotted ``key=value`` overrides read by :func:`slipstream.config.load_config`, and
``msgspec.inspect`` already hands over every type, bound, default and description, so the walk is short.

Worked example::

    [s.key for s in sections(Config)][:3]      # ['', 'run', 'datagen']: the root first
    row = next(k for s in sections(Config) for k in s.keys if k.key == "trainer.lr")
    row.type, row.default                      # ('float > 0', '1e-06')
    row.description                            # 'Peak learning rate of AdamW, reached after warmup_steps.'
"""

from __future__ import annotations

import inspect as pyinspect
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from msgspec import inspect as mi

__all__ = [
    "KeyDoc",
    "SectionDoc",
    "format_default",
    "format_type",
    "markdown",
    "sections",
    "undocumented",
    "value_type",
]


@dataclass(frozen=True)
class KeyDoc:
    """One settable key: ``key`` as users write it (``trainer.algorithm.clip_c``), ``type`` as text with its
    bounds (``float > 0 | null``), ``default`` as YAML would show it, ``info`` the msgspec type behind it."""

    key: str
    name: str
    type: str
    default: str
    description: str
    info: mi.Type


@dataclass(frozen=True)
class SectionDoc:
    """A struct of the tree: its dotted ``key`` ("" for the root), its class docstring, its leaf keys."""

    key: str
    cls: type
    description: str
    keys: list[KeyDoc] = field(default_factory=list)


def sections(root: type[msgspec.Struct]) -> list[SectionDoc]:
    """Every struct under ``root`` (itself first, then depth first in field order) with its leaf keys."""
    out: list[SectionDoc] = []
    _walk(mi.type_info(root), "", out)
    return out


def _walk(info: mi.StructType, key: str, out: list[SectionDoc]) -> None:
    section = SectionDoc(key, info.cls, class_description(info.cls))
    out.append(section)
    children = []
    hints = typing.get_type_hints(info.cls, include_extras=True)
    for f in info.fields:
        sub = f"{key}.{f.encode_name}" if key else f.encode_name
        inner, description = _unwrap(f.type)
        if isinstance(inner, mi.StructType):
            children.append((inner, sub))
            continue
        default = f.default if f.default_factory is mi.NODEFAULT else f.default_factory()
        text = format_type(inner, _literal_values(hints[f.name]))
        section.keys.append(KeyDoc(sub, f.encode_name, text, format_default(default), description, inner))
    for inner, sub in children:
        _walk(inner, sub, out)


def class_description(cls: type) -> str:
    """The first paragraph of a class's own docstring, on one line ("" when it has none)."""
    doc = cls.__dict__.get("__doc__") or ""
    return " ".join(pyinspect.cleandoc(doc).split("\n\n")[0].split())


def _unwrap(info: mi.Type) -> tuple[mi.Type, str]:
    """The type under any ``Meta`` wrapper, and the field's description wherever ``Meta`` put it (on the
    field, or on the non-null member of ``Annotated[int, Meta(ge=1, description=...)] | None``)."""
    description = ""
    while isinstance(info, mi.Metadata):
        description = description or (info.extra_json_schema or {}).get("description", "")
        info = info.type
    if not description and isinstance(info, mi.UnionType):
        for member in info.types:
            description = description or _unwrap(member)[1]
    return info, description


def _literal_values(hint: Any) -> list[Any]:
    """The choices of every ``Literal`` in a type hint, in the order the code wrote them (msgspec sorts)."""
    if typing.get_origin(hint) is Literal:
        return list(typing.get_args(hint))
    return [v for arg in typing.get_args(hint) for v in _literal_values(arg)]


def value_type(info: mi.Type) -> mi.Type:
    """The type of a key's value when it is not null (``float`` for ``Annotated[float, Meta(gt=0)] | None``)."""
    info = _unwrap(info)[0]
    if isinstance(info, mi.UnionType):
        members = [t for t in info.types if not isinstance(t, mi.NoneType)]
        return value_type(members[0]) if len(members) == 1 else info
    return info


def format_type(info: mi.Type, order: list[Any] | None = None) -> str:
    """A type as a person reads it: ``int >= 1``, ``sync | one_step_off``, ``list[str]``, ``float | null``;
    ``order`` lists literal choices in the order to show them."""
    info = _unwrap(info)[0]
    if isinstance(info, mi.UnionType):
        return " | ".join(format_type(t, order) for t in info.types)
    if isinstance(info, mi.LiteralType):
        rank = {v: i for i, v in enumerate(order or [])}
        return " | ".join(str(v) for v in sorted(info.values, key=lambda v: rank.get(v, len(rank))))
    if isinstance(info, (mi.IntType, mi.FloatType)):
        name = "int" if isinstance(info, mi.IntType) else "float"
        pairs = [(">", info.gt), (">=", info.ge), ("<", info.lt), ("<=", info.le)]
        # Floats as %g: typing caches Annotated[float, Meta(ge=0.0)] as an equal Annotated[float, Meta(ge=0)]
        # made earlier in the process, so the bound's own type depends on import order.
        bounds = [f"{op} {v:g}" if name == "float" else f"{op} {v}" for op, v in pairs if v is not None]
        return f"{name} {', '.join(bounds)}" if bounds else name
    if isinstance(info, mi.ListType):
        return f"list[{format_type(info.item_type)}]"
    if isinstance(info, mi.TupleType):
        return "[" + ", ".join(format_type(t) for t in info.item_types) + "]"
    if isinstance(info, mi.DictType):
        return f"map[{format_type(info.key_type)}, {format_type(info.value_type)}]"
    simple = {mi.StrType: "str", mi.BoolType: "bool", mi.NoneType: "null", mi.AnyType: "any"}
    return simple.get(type(info), type(info).__name__)


_MAX_DEFAULT = 48


def format_default(value: object) -> str:
    """A default as it would be written in YAML: ``null``, ``true``, ``[]``, ``""``; long text cut short."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        plain = value and value.strip() == value and "\n" not in value
        text = value if plain else msgspec.json.encode(value).decode()
        return text if len(text) <= _MAX_DEFAULT else text[: _MAX_DEFAULT - 1] + "…"
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        unit = "GiB" if value % (1 << 30) == 0 else "MiB"
        return f"{value} ({value >> (30 if unit == 'GiB' else 20)} {unit})"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_default(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {format_default(v)}" for k, v in value.items()) + "}"
    return repr(value)


def undocumented(root: type[msgspec.Struct]) -> list[str]:
    """Keys with no description and sections with no class docstring (what tests refuse)."""
    missing = []
    for section in sections(root):
        if not section.description:
            missing.append(f"{section.key or '<root>'} ({section.cls.__qualname__}): no class docstring")
        missing += [f"{k.key}: no Meta(description=...)" for k in section.keys if not k.description]
    return missing


def markdown(root: type[msgspec.Struct], title: str = "Config keys") -> str:
    """The key reference: one table per section, in the order of the tree (docs/config.md)."""
    lines = [
        f"# {title}",
        "",
        "<!-- Generated by `slipstream config docs` from the descriptions in the typed configs; edit those,",
        "     not this file (tests/test_config_doc.py checks it is current). -->",
        "",
        "Set a key in a YAML preset (`configs/*.yaml`, nested by section) or on the command line as",
        "`section.key=value` (`slipstream train configs/quickstart.yaml trainer.lr=2e-5`);",
        "`slipstream train --help` lists the same keys.",
    ]
    for section in sections(root):
        if not section.keys:
            continue
        lines += ["", f"## `{section.key}`" if section.key else "## top level", ""]
        if section.description:
            lines += [section.description, ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for k in section.keys:
            cells = [f"`{k.key}`", _cell(k.type), f"`{_cell(k.default)}`", _cell(k.description)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
