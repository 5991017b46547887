"""Argparse parts every `slipstream` command shares: the parser itself, the common flags, and one option per
config key generated from the typed configs (their descriptions are the help text, see config_doc.py).

Commands keep their own argparse parsers (each module's ``main(argv)``, dispatched lazily by cli.py); what
they have in common lives here so it reads the same everywhere: ``--json`` (machine-readable results, the
keys docs/benchmarks.md records), ``--device``, ``--seed``, a config with its ``key=value`` overrides.

Config keys become options in two spellings:

* dotted (``slipstream train``, ``slipstream config show``): ``--trainer.lr 2e-5`` is the same as the
  positional override ``trainer.lr=2e-5`` (the value goes through the same parsing, so ``null``, lists
  ``[a, b]`` and every check behave alike); flags are applied after the positional overrides;
* dashed and typed (``slipstream serve``): ``--max-model-len 2048`` for the fields of one section.

Worked example::

    parser, keys = config_parser("slipstream config show", "Validate a config.", Config)
    ns = parser.parse_intermixed_args(["run.yaml", "async.mode=sync", "--trainer.lr", "2e-5"])
    [*ns.overrides, *config_overrides(ns, keys)]     # ['async.mode=sync', 'trainer.lr=2e-5']
"""

from __future__ import annotations

import argparse
import difflib
import textwrap

import msgspec
from msgspec import inspect as mi

from slipstream.config_doc import KeyDoc, sections, value_type

__all__ = [
    "JSON_LAST_LINE",
    "JSON_OBJECT",
    "JSON_ONLY",
    "add_config_options",
    "add_config_positionals",
    "add_device_flag",
    "add_json_flag",
    "add_seed_flag",
    "command_parser",
    "config_overrides",
    "config_parser",
    "doc_paragraph",
    "keys_epilog",
    "parse_bool",
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
    return argparse.ArgumentParser(prog=prog, description=description, **kwargs)


class _KeyFlagParser(argparse.ArgumentParser):
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


def keys_epilog(root: type[msgspec.Struct], heading: str) -> str:
    """Every key under ``root`` as plain text, for the epilog of a parser whose overrides are those keys
    (use ``formatter_class=argparse.RawDescriptionHelpFormatter``)."""
    lines = [heading]
    for section in sections(root):
        for row in section.keys:
            lines.append(f"  {row.key}: {row.type} (default {row.default})")
            lines += textwrap.wrap(row.description, 100, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def add_json_flag(parser: argparse.ArgumentParser, help: str = JSON_LAST_LINE) -> None:
    parser.add_argument("--json", action="store_true", help=help)


def add_device_flag(parser: argparse.ArgumentParser, help: str | None = None, default: str = "cpu") -> None:
    parser.add_argument("--device", choices=["cpu", "cuda"], default=default, help=help)


def add_seed_flag(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    parser.add_argument("--seed", type=int, default=0, help=help)


def parse_bool(text: str) -> bool:
    """``true``/``false``/``1``/``0``/``yes``/``no`` as config values accept them."""
    try:
        return msgspec.convert(text, bool, strict=False)
    except msgspec.ValidationError:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}") from None


def add_config_options(
    parser: argparse.ArgumentParser,
    root: type[msgspec.Struct],
    *,
    dashed: bool = False,
    title: str = "config keys",
) -> dict[str, str]:
    """Add one option per key under ``root``, grouped by section, with the key's type, default and meaning
    as help, under ``title``; return ``{dest: dotted key}``.

    Dotted options (the default) keep the value as text and leave it out of the namespace when not given;
    :func:`config_overrides` turns the given ones into ``key=value`` overrides. ``dashed`` options
    (``--max-model-len``) convert ints, floats and bools themselves and default to None (not given).
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
            kwargs = _typed(row) if dashed else _text(row)
            group.add_argument(flag, dest=dest, help=_help(row), **kwargs)
            keys[dest] = row.key
    return keys


def config_overrides(ns: argparse.Namespace, keys: dict[str, str]) -> list[str]:
    """The dotted options given on the command line, as ``key=value`` overrides in the order of ``keys``."""
    given = vars(ns)
    return [f"{key}={given[dest]}" for dest, key in keys.items() if dest in given]


def _text(row: KeyDoc) -> dict:
    # Every dotted flag takes a value, bools too (`--run.resume false`): an optional value would swallow a
    # positional override that follows (`--run.resume trainer.lr=1`).
    return {"default": argparse.SUPPRESS, "metavar": _metavar(row)}


def _typed(row: KeyDoc) -> dict:
    if isinstance(
        row.info, mi.BoolType
    ):  # `--flag` alone means true; `--flag false` as config_to_args writes
        return {"type": parse_bool, "nargs": "?", "const": True, "metavar": "BOOL"}
    kind = {mi.IntType: int, mi.FloatType: float}.get(type(row.info), str)
    return {"type": kind, "default": None, "metavar": _metavar(row)}


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
