"""The base every config section derives from, the sections several roles hold whole (``model``, ``run``)
and the validation of any section tree; kept apart from `config.py` so role modules can import them without
importing the whole tree (no role imports `config.py`: the root builds each role's settings and hands them
down typed, docs/architecture.md "Configuration").

msgspec checks types and ``Meta`` bounds but lets ``inf`` and ``nan`` through wherever the bounds do not
exclude them (``lr: .inf`` satisfies ``gt=0``), so :func:`check_finite` walks a converted tree once and
rejects them for every field, naming the key. :func:`validate` turns a plain mapping into any section (the
root ``Config`` or one role's, e.g. ``slipstream queue serve``'s ``QueueConfig``), rewording msgspec's
message for people with a "did you mean" hint; :func:`checked` validates a struct built in code.
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Annotated, Any, Literal, TypeVar, get_args, get_origin

import msgspec
import yaml
from msgspec import Meta

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


# ------------------------------------------------------------------------------ shared sections


class RunConfig(ConfigStruct):
    """Identity and bookkeeping of one run."""

    name: Annotated[
        str,
        Meta(description="Name of the run: its files go under output_dir/name, and it names the wandb run."),
    ] = "run"
    output_dir: Annotated[
        str, Meta(description="Every run writes metrics.jsonl, checkpoints and logs under output_dir/name.")
    ] = "runs"
    seed: Annotated[
        int,
        Meta(
            description="Seed of the prompt order (each epoch is shuffled from it) and of the Megatron "
            "engine's random state.",
        ),
    ] = 0
    total_steps: Annotated[
        int, Meta(ge=0, description="Trainer steps to run; 0 means one pass over the training data.")
    ] = 0
    resume: Annotated[
        bool, Meta(description="Resume from the latest checkpoint under output_dir/name when one exists.")
    ] = True
    record_uids: Annotated[
        bool,
        Meta(
            description="Append the uids each trainer step trained on to "
            "output_dir/name/trained_uids.jsonl: an audit that no sample is lost or trained twice across "
            "restarts (one line per step, about 20 bytes per sample).",
        ),
    ] = False


class ModelConfig(ConfigStruct):
    """The policy model: a local HF checkpoint directory or a name known to `slipstream models`."""

    path: Annotated[
        str,
        Meta(
            description="The policy: a local HF checkpoint directory or a model name known to `slipstream "
            "models prepare`.",
        ),
    ] = "smollm2-135m-instruct"
    dtype: Annotated[
        Literal["float32", "bfloat16", "float16"],
        Meta(
            description="Dtype the trainer loads the weights in without mixed precision, and the servers' "
            "default when no server dtype is given.",
        ),
    ] = "float32"
    trust_remote_code: Annotated[
        bool,
        Meta(
            description="Let transformers run the checkpoint's own modelling code (tokenizer and model); "
            "only for checkpoints you trust.",
        ),
    ] = False


# ------------------------------------------------------------------------------------ validation


S = TypeVar("S", bound=msgspec.Struct)


def validate(raw: dict[str, Any], cls: type[S]) -> S:
    """Validate a plain mapping into ``cls``; raise :class:`ConfigError` naming the key on failure."""
    try:
        cfg = msgspec.convert(raw, cls, strict=False)
    except msgspec.ValidationError as err:
        raise ConfigError(_explain(str(err), cls)) from None
    check_finite(cfg)
    return cfg


def checked(settings: S) -> S:
    """``settings`` (a struct built in code) with every field's type and bounds checked: a constructor checks
    none, and a tree changed with ``msgspec.structs.replace`` is not validated either. A bad value is a
    :class:`ConfigError` naming the struct's field (``RollouterSettings.put_timeout_s: ...``)."""
    cls = type(settings)
    # Nested structs pass through as they are (already the right type); their own values were checked
    # when they were built.
    values = {f.encode_name: getattr(settings, f.name) for f in msgspec.structs.fields(cls)}
    try:
        return msgspec.convert(values, cls)
    except msgspec.ValidationError as err:
        message, _, where = str(err).partition(" - at `$.")
        name = where.rstrip("`").split(".")[0].split("[")[0]
        raise ConfigError(f"{cls.__name__}.{name}: {message}") from None


def override_value(key: str, text: str) -> Any:
    """The value of a ``key=text`` override: YAML's null, a list or mapping, a quoted string (quotes
    removed: ``auth_token=""`` is the empty string, not two quote characters), else the text itself."""
    text = text.strip()
    if text in ("null", "~"):  # YAML's null: `cluster.ray_address=null` clears a preset's value
        return None
    if text[:1] in "[{":  # the empty text too: YAML reads it as null, as before
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"{key}: value `{text}` is not a valid YAML list/mapping: {err}") from None
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"{key}: value `{text}` is not a valid quoted string: {err}") from None
        if isinstance(value, str):
            return value
    return text


_PATH_RE = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_UNKNOWN_RE = re.compile(r"Object contains unknown field `(?P<field>[^`]+)`")


def _explain(message: str, root: type[msgspec.Struct]) -> str:
    match = _PATH_RE.match(message)
    msg, path = (match.group("msg"), match.group("path") or "") if match else (message, "")
    parts = [p for p in re.split(r"\.|\[(\d+)\]", path) if p]
    unknown = _UNKNOWN_RE.search(msg)
    if unknown:
        field = unknown.group("field")
        where = ".".join(parts)
        valid = _field_names(root, parts)
        hint = difflib.get_close_matches(field, valid, n=1)
        tip = f"; did you mean `{hint[0]}`?" if hint else ""
        section = f"under `{where}`" if where else "at the top level"
        full = f"{where}.{field}" if where else field
        return f"{full}: unknown key{tip} (valid keys {section}: {', '.join(valid)})"
    key = ".".join(parts) or "<root>"
    if msg.startswith("Invalid enum value"):
        choices = [repr(c) for c in _literal_choices(_field_type(root, parts))]
        return f"{key}: {msg[len('Invalid enum value ') :]} is not one of {', '.join(choices)}"
    msg = msg.replace("Expected", "expected").replace("`", "")
    return f"{key}: {msg}"


def _field_type(root: type[msgspec.Struct], parts: list[str]) -> Any:
    """The annotated type at a dotted path, or None when the path leaves the struct tree."""
    tp: Any = root
    for part in parts:
        if not (isinstance(tp, type) and issubclass(tp, msgspec.Struct)):
            return None
        info = {f.encode_name: f for f in msgspec.structs.fields(tp)}.get(part)
        if info is None:
            return None
        tp = info.type
    return tp


def _literal_choices(tp: Any) -> list[Any]:
    if get_origin(tp) is Literal:
        return list(get_args(tp))
    return [c for arg in get_args(tp) for c in _literal_choices(arg)]


def _field_names(root: type[msgspec.Struct], parts: list[str]) -> list[str]:
    tp = _field_type(root, parts)
    if not (isinstance(tp, type) and issubclass(tp, msgspec.Struct)):
        return []
    return [f.encode_name for f in msgspec.structs.fields(tp)]
