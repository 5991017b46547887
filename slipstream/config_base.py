"""The base every config section derives from; kept apart from `config.py` so role configs can import it
without importing the whole tree.

msgspec checks types and ``Meta`` bounds but lets ``inf`` and ``nan`` through wherever the bounds do not
exclude them (``lr: .inf`` satisfies ``gt=0``), so :func:`check_finite` walks a converted tree once and
rejects them for every field, naming the key.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, get_args, get_origin

import msgspec

ALLOW_INF = "allow_inf"
"""Key of ``msgspec.Meta(extra=...)`` that lets a float field hold ``inf`` (its description says what it means)."""


class ConfigError(ValueError):
    """A configuration problem, always naming the offending key."""


class ConfigStruct(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every config section: keyword-only fields, unknown keys rejected.

    Every field says what it means in ``Meta(description=...)``, next to its bounds, and every section
    has a class docstring: ``--help``, docs/config.md and the JSON schema are generated from them
    (config_doc.py), and tests/test_config_doc.py fails on a field without one::

        class TrainerConfig(ConfigStruct):
            # (a class docstring here)
            lr: Annotated[float, Meta(gt=0, description="Peak learning rate of AdamW.")] = 1e-6

    Cross-field rules go in ``__post_init__`` and raise ``ValueError`` with a message that names the field
    (msgspec adds the section path). Floats must be finite unless the field is annotated
    ``Annotated[float, msgspec.Meta(extra={ALLOW_INF: True})]``; ``nan`` is never accepted.
    """


def check_finite(value: Any, key: str = "", allow_inf: bool = False) -> None:
    """Raise :class:`ConfigError` naming the first ``nan`` or ``inf`` float under ``value``.

    Walks structs (by the names users write), mappings and lists, e.g. ``trainer.lr: expected a finite
    number, got inf``.
    """
    if isinstance(value, float):
        if math.isnan(value) or (math.isinf(value) and not allow_inf):
            raise ConfigError(f"{key or '<root>'}: expected a finite number, got {value}")
    elif isinstance(value, msgspec.Struct):
        for field in msgspec.structs.fields(value):
            inf_ok = allow_inf or _allows_infinity(field.type)
            check_finite(getattr(value, field.name), _join(key, field.encode_name), inf_ok)
    elif isinstance(value, dict):
        for name, item in value.items():
            check_finite(item, _join(key, str(name)), allow_inf)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            check_finite(item, f"{key}[{index}]", allow_inf)


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def _allows_infinity(tp: Any) -> bool:
    """Whether a field's type carries the ``ALLOW_INF`` opt-in, also inside ``X | None`` or ``list[X]``."""
    if get_origin(tp) is Annotated:
        base, *metas = get_args(tp)
        opted = any(isinstance(m, msgspec.Meta) and (m.extra or {}).get(ALLOW_INF) for m in metas)
        return opted or _allows_infinity(base)
    return any(_allows_infinity(arg) for arg in get_args(tp))


def value_at(root: msgspec.Struct, key: str) -> Any:
    """The value at dotted ``key`` of a config tree, spelled as users write it (``async.sync_every``)."""
    value: Any = root
    for part in key.split("."):
        names = {f.encode_name: f.name for f in msgspec.structs.fields(type(value))}
        value = getattr(value, names[part])
    return value


def settings_from_root(cls: type[msgspec.Struct], root: msgspec.Struct, root_keys: dict[str, str]) -> Any:
    """A role's settings struct ``cls`` from the root config: each field that names a root section takes that
    section whole, each field in ``root_keys`` the value at its dotted root key (the one mapping, read by the
    settings tests too).

    Built through ``msgspec.convert``, which checks every field's type and bounds (``cls(**values)`` checks
    none): a value the settings bound more tightly than the root, or a root changed with
    ``msgspec.structs.replace`` (which validates nothing), is a :class:`ConfigError` naming the root key."""
    sections = {f.name for f in msgspec.structs.fields(type(root))}
    values = {}
    for field in msgspec.structs.fields(cls):
        values[field.encode_name] = (
            value_at(root, root_keys[field.name]) if field.name in root_keys else getattr(root, field.name)
        )
        if field.name not in root_keys and field.name not in sections:
            raise TypeError(f"{cls.__name__}.{field.name}: neither a root section nor in its ROOT_KEYS")
    try:
        return msgspec.convert(values, cls)  # sections pass through as they are (already the right type)
    except msgspec.ValidationError as err:
        message, _, where = str(err).partition(" - at `$.")
        name = where.rstrip("`").split(".")[0].split("[")[0]
        key = root_keys.get(name, name)
        raise ConfigError(f"{key or '<root>'}: {message} (for {cls.__name__})") from None
