"""Argparse parts every `slipstream` command shares: the parser itself, the common flags, and one option per
config key generated from the typed configs (their descriptions are the help text, see config_doc.py).

Commands keep their own argparse parsers (each module's ``main(argv)``, dispatched lazily by cli.py); what
they have in common lives here so it reads the same everywhere: ``--json`` (machine-readable results, the
keys docs/benchmarks.md records), ``--device``, ``--seed``, a config with its ``key=value`` overrides.

Config keys become options in two spellings:

* dotted (``slipstream train``, ``slipstream config show``): ``--trainer.lr 2e-5`` is the same as the
  positional override ``trainer.lr=2e-5`` (the value goes through the same parsing, so ``null``, lists
  ``[a, b]`` and every check behave alike); flags are applied after the positional overrides;
* dashed and typed (``slipstream serve``, ``slipstream queue serve``): ``--max-model-len 2048`` for the
  fields of one section; the value is checked against the field's type and bounds while parsing, and a bad
  one is refused naming the key (``argument --port: port: expected int <= 65535, got '70000'``);
  :func:`config_values` turns the given ones into the struct.

A command that borrows a few keys of a run's config (a bench's ``--bucket-mb``, ``--max-staleness``) takes
each with :func:`add_key_option`: the same typed, checked option, under the bench's own default when it
has one, its help the key's description. Options that are no config key (bench sizes, ``--json``) stay
hand-written, through the helpers here where they are common.

Worked example::

    parser, keys = config_parser("slipstream config show", "Validate a config.", Config)
    ns = parser.parse_intermixed_args(["run.yaml", "async.mode=sync", "--trainer.lr", "2e-5"])
    [*ns.overrides, *config_overrides(ns, keys)]     # ['async.mode=sync', 'trainer.lr=2e-5']

    add_key_option(parser, WeightSyncConfig, "bucket_mb", section="weightsync", default=64)
    parser.parse_args(["--bucket-mb", "0"])
    # error: argument --bucket-mb: weightsync.bucket_mb: expected int >= 1, got '0'
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
import typing
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from msgspec import inspect as mi

from slipstream.config_doc import KeyDoc, format_default, sections, value_type

__all__ = [
    "JSON_LAST_LINE",
    "JSON_OBJECT",
    "JSON_ONLY",
    "add_config_options",
    "add_config_positionals",
    "add_device_flag",
    "add_json_flag",
    "add_key_option",
    "add_seed_flag",
    "command_parser",
    "config_overrides",
    "config_parser",
    "config_values",
    "doc_paragraph",
    "field_type",
    "key_doc",
]

JSON_LAST_LINE = "end with one JSON line of results"
JSON_ONLY = "print only the JSON summary on stdout"
JSON_OBJECT = "print one JSON object"


def doc_paragraph(doc: str | None, index: int = 0) -> str:
    """Paragraph ``index`` of a docstring on one line: the description of a command's ``--help``."""
    paragraphs = [p for p in (doc or "").strip().split("\n\n") if p.strip()]
    return " ".join(paragraphs[index].split()) if index < len(paragraphs) else ""


def command_parser(prog: str, description: str | None = None, **kwargs) -> argparse.ArgumentParser:
    """The parser of one command, named as users type it (``slipstream bench queue``)."""
    return _Parser(prog=prog, description=description, **kwargs)


class _Parser(argparse.ArgumentParser):
    """A generated bool option takes an optional value (``--journal``, ``--journal false``); followed by a
    ``key=value`` override it means true and leaves the override alone, where argparse would take the
    override as the flag's value."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        words = list(sys.argv[1:] if args is None else args)
        bools = {
            flag
            for flag, action in self._option_string_actions.items()
            if hasattr(action, "config_key") and action.nargs == "?"
        }
        for i in range(len(words) - 1, -1, -1):
            following = words[i + 1] if i + 1 < len(words) else ""
            if words[i] in bools and "=" in following and not following.startswith("-"):
                words.insert(i + 1, "true")
        return super().parse_known_args(words, namespace)


class _KeyFlagParser(_Parser):
    """An unknown ``--section.key`` flag gets the hint an unknown ``section.key=value`` gets."""

    def error(self, message: str):  # type: ignore[override]
        if message.startswith("unrecognized arguments:"):
            flags = [f for f in self._option_string_actions if f.startswith("--")]
            for word in message.split(":", 1)[1].split():
                hint = difflib.get_close_matches(word.partition("=")[0], flags, n=1)
                if word.startswith("--") and hint:
                    message += f" (did you mean `{hint[0]}`?)"
                    break
        super().error(message)


def config_parser(
    prog: str, description: str, root: type[msgspec.Struct], epilog: str | None = None
) -> tuple[argparse.ArgumentParser, dict[str, str]]:
    """The parser of a command run on a config (``slipstream train``, ``slipstream config show``): a preset,
    dotted ``key=value`` overrides, and every key of ``root`` as a dotted option with its documentation.
    Parse with ``parse_intermixed_args`` so flags may follow the overrides."""
    parser = _KeyFlagParser(
        prog=prog,
        description=description,
        usage=f"{prog} CONFIG [key=value ...] [--section.key VALUE ...] [options]",
        epilog=epilog,
        allow_abbrev=False,  # `--trainer.l` must not quietly mean `--trainer.lr`
    )
    parser.add_argument("config", help="a YAML preset (configs/*.yaml)")
    parser.add_argument(
        "overrides",
        nargs="*",
        help="dotted key=value overrides, e.g. trainer.lr=2e-5; every key is listed below, where "
        "`--trainer.lr 2e-5` is the same override (flags apply after the positional ones)",
    )
    return parser, add_config_options(parser, root)


def add_config_positionals(parser: argparse.ArgumentParser) -> None:
    """``CONFIG [key=value ...]`` of the commands that read a run's config without running it (plan,
    simulate): the same preset and dotted overrides as ``slipstream train``."""
    parser.add_argument("config", help="a YAML preset (configs/*.yaml)")
    parser.add_argument(
        "overrides",
        nargs="*",
        help="dotted key=value overrides, e.g. trainer.lr=2e-5 (`slipstream config show --help` lists the keys)",
    )


def add_json_flag(parser: argparse.ArgumentParser, help: str = JSON_LAST_LINE) -> None:
    parser.add_argument("--json", action="store_true", help=help)


def add_device_flag(parser: argparse.ArgumentParser, help: str | None = None, default: str = "cpu") -> None:
    parser.add_argument("--device", choices=["cpu", "cuda"], default=default, help=help)


def add_seed_flag(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    parser.add_argument("--seed", type=int, default=0, help=help)


def add_config_options(
    parser: argparse.ArgumentParser,
    root: type[msgspec.Struct],
    *,
    dashed: bool = False,
    title: str = "config keys",
) -> dict[str, str]:
    """Add one option per key under ``root``, grouped by section, with the key's type, default and meaning
    as help, under ``title``; return ``{dest: dotted key}``.

    Dotted options (the default) keep the value as text; :func:`config_overrides` turns the given ones
    into ``key=value`` overrides. ``dashed`` options (``--max-model-len``) convert and check the value
    against the field's type and bounds while parsing; :func:`config_values` builds the struct from them.
    Either kind is left out of the namespace when not given.
    """
    keys: dict[str, str] = {}
    for section in sections(root):
        if not section.keys:
            continue
        name = f"{title}: {section.key}" if section.key else title
        group = parser.add_argument_group(name, section.description or None)
        for row in section.keys:
            dest = row.key.replace(".", "_") if dashed else row.key
            flag = "--" + (row.key.replace("_", "-") if dashed else row.key)
            kwargs = _typed(row, field_type(root, row.key)) if dashed else _text(row)
            action = group.add_argument(flag, dest=dest, help=_help(row), **kwargs)
            action.config_key = row.key  # type: ignore[attr-defined]  # which key made it (tests read it)
            keys[dest] = row.key
    return keys


def config_overrides(ns: argparse.Namespace, keys: dict[str, str]) -> list[str]:
    """The dotted options given on the command line, as ``key=value`` overrides in the order of ``keys``."""
    given = vars(ns)
    return [f"{key}={given[dest]}" for dest, key in keys.items() if dest in given]


def config_values(ns: argparse.Namespace, keys: dict[str, str]) -> dict[str, Any]:
    """The dashed options given on the command line as a nested mapping of their (already checked) values,
    ready for ``from_dict(values, root)`` (which adds the defaults and the cross-field checks)."""
    given = vars(ns)
    values: dict[str, Any] = {}
    for dest, key in keys.items():
        if dest in given:
            *parents, leaf = key.split(".")
            node = values
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = given[dest]
    return values


_CONFIG_DEFAULT: Any = object()


def add_key_option(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    root: type[msgspec.Struct],
    key: str,
    *,
    flags: Sequence[str] = (),
    default: Any = _CONFIG_DEFAULT,
    choices: Sequence[Any] | None = None,
    note: str = "",
    section: str = "",
) -> argparse.Action:
    """One option for the config key ``key`` of ``root`` (``Config``'s ``weightsync.bucket_mb``): typed and
    checked as the key is (a bad value is refused naming it), its help the key's description plus ``note``.

    ``flags`` default to the last part of the key, dashed (``--bucket-mb``); the dest is argparse's from the
    first flag. ``default`` is the command's own when it differs from the config's (the help shows both);
    ``choices`` narrows a key's literal choices to those the command supports. ``section`` is where
    ``root`` sits in a run's config (``weightsync``), for a module that may not import the whole config:
    help and errors then name the key as a run's config does (``weightsync.bucket_mb``).
    """
    row = key_doc(root, key)
    tp = field_type(root, key)
    flags = list(flags) or ["--" + row.name.replace("_", "-")]
    kwargs = _typed(dataclasses.replace(row, key=f"{section}.{key}" if section else key), tp)
    kwargs["default"] = _default_of(root, key) if default is _CONFIG_DEFAULT else default
    key = f"{section}.{key}" if section else key
    shown = format_default(kwargs["default"])
    if shown != row.default:
        shown += f" here; {row.default} in a run's config"
    if choices is not None:
        allowed = _literal_values(tp)
        extra = [c for c in choices if c not in allowed]
        if extra:
            raise ValueError(f"{key}: choices {extra} are not values of the key ({allowed})")
        kwargs["choices"] = list(choices)
        kwargs["metavar"] = "{" + ",".join(str(c) for c in choices) + "}"
    text = f"{row.description} [{key}: {row.type}; default {shown}]" + (f" {note}" if note else "")
    action = parser.add_argument(*flags, help=text.replace("%", "%%"), **kwargs)
    action.config_key = key  # type: ignore[attr-defined]
    return action


def key_doc(root: type[msgspec.Struct], key: str) -> KeyDoc:
    """The documentation row of one dotted key of ``root`` (KeyError naming it when there is none)."""
    for section in sections(root):
        for row in section.keys:
            if row.key == key:
                return row
    raise KeyError(f"{root.__name__} has no key {key!r}")


def field_type(root: type[msgspec.Struct], key: str) -> Any:
    """The annotated type of a dotted key of ``root``, bounds included (``Annotated[int, Meta(ge=1)]``)."""
    tp: Any = root
    for part in key.split("."):
        tp = next(f.type for f in msgspec.structs.fields(tp) if f.encode_name == part)
        tp = _struct_of(tp) or tp
    return tp


def _struct_of(tp: Any) -> type[msgspec.Struct] | None:
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    return None


def _default_of(root: type[msgspec.Struct], key: str) -> Any:
    *parents, leaf = key.split(".")
    tp: Any = root
    for part in parents:
        tp = field_type(tp, part)
    info = next(f for f in msgspec.structs.fields(tp) if f.encode_name == leaf)
    return info.default if info.default_factory is msgspec.NODEFAULT else info.default_factory()


def _literal_values(tp: Any) -> list[Any]:
    if typing.get_origin(tp) is typing.Literal:
        return list(typing.get_args(tp))
    return [v for arg in typing.get_args(tp) for v in _literal_values(arg)]


def _text(row: KeyDoc) -> dict:
    # Every dotted flag takes a value, bools too (`--run.resume false`): an optional value would swallow a
    # positional override that follows (`--run.resume trainer.lr=1`).
    return {"default": argparse.SUPPRESS, "metavar": _metavar(row)}


def _typed(row: KeyDoc, tp: Any) -> dict:
    parse = _value_parser(row.key, tp)
    if isinstance(
        row.info, mi.BoolType
    ):  # `--flag` alone means true; `--flag false` as config_to_args writes
        return {"type": parse, "nargs": "?", "const": True, "metavar": "BOOL", "default": argparse.SUPPRESS}
    return {"type": parse, "default": argparse.SUPPRESS, "metavar": _metavar(row)}


def _value_parser(key: str, tp: Any) -> Callable[[str], Any]:
    """Text to the key's value as an override reads it (``null``, ``[a, b]``, quoted strings; "" stays the
    empty string), then converted and bound-checked by msgspec; an ArgumentTypeError names the key."""

    def parse(text: str) -> Any:
        from slipstream.config_base import check_finite, override_value

        try:
            value = override_value(key, text) if text.strip() else text
            value = msgspec.convert(value, tp, strict=False)
            check_finite(value, key)
        except msgspec.ValidationError as err:
            reason = str(err).split(" - at ")[0].split(", got ")[0].replace("`", "")
            reason = reason[:1].lower() + reason[1:]
            if reason.startswith("invalid enum value"):
                reason = "expected one of " + ", ".join(map(str, _literal_values(tp)))
            raise argparse.ArgumentTypeError(f"{key}: {reason}, got {text!r}") from None
        except ValueError as err:  # ConfigError from the override's YAML or a nan/inf
            raise argparse.ArgumentTypeError(str(err)) from None
        return value

    parse.__name__ = key
    return parse


def _metavar(row: KeyDoc) -> str:
    info = value_type(row.info)  # `X | null` is named after X; the help shows the whole type
    if isinstance(info, mi.LiteralType):
        return "{" + ",".join(c for c in row.type.split(" | ") if c != "null") + "}"
    names = {mi.IntType: "INT", mi.FloatType: "FLOAT", mi.BoolType: "BOOL", mi.StrType: "STR"}
    names.update({mi.ListType: "LIST", mi.TupleType: "LIST", mi.DictType: "MAP"})
    return names.get(type(info), "VALUE")


def _help(row: KeyDoc) -> str:
    text = f"{row.description} [{row.type}; default {row.default}]"
    return text.replace("%", "%%")  # argparse %-formats help strings
