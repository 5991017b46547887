"""Every config key documented in code, and the documents generated from it kept current."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import pytest
from msgspec import Meta

import slipstream
from slipstream.config import Config
from slipstream.config_base import ConfigStruct
from slipstream.config_doc import format_default, markdown, sections, undocumented

ROOT = Path(__file__).resolve().parents[1]


def _config_modules() -> list[str]:
    """Every `config.py` of the package (the role configs live there), imported so their structs exist."""
    package = Path(slipstream.__file__).parent
    names = [
        ".".join(("slipstream", *p.relative_to(package).with_suffix("").parts))
        for p in sorted(package.rglob("config.py"))
    ]
    for name in names:
        importlib.import_module(name)
    return names


def _config_structs() -> list[type]:
    _config_modules()
    found, todo = [], list(ConfigStruct.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__module__.startswith("slipstream."):
            found.append(cls)
    return found


def test_every_key_of_the_config_tree_has_a_description():
    assert undocumented(Config) == [], "document these in Meta(description=...) / a class docstring"


@pytest.mark.parametrize("cls", _config_structs(), ids=lambda c: c.__qualname__)
def test_every_config_struct_of_the_package_documents_its_fields(cls):
    """Structs outside the `Config` tree too (a role's own section built elsewhere)."""
    assert undocumented(cls) == []


class _Half(ConfigStruct):
    """A section with one undocumented field."""

    told: Annotated[int, Meta(ge=0, description="Documented.")] = 0
    untold: int = 1


class _NoDoc(ConfigStruct):
    inner: _Half = msgspec.field(default_factory=_Half)


def test_the_check_names_what_is_missing():
    assert undocumented(_NoDoc) == [
        "<root> (_NoDoc): no class docstring",
        "inner.untold: no Meta(description=...)",
    ]


def test_rows_carry_dotted_keys_types_with_bounds_and_yaml_defaults():
    rows = {k.key: k for s in sections(Config) for k in s.keys}
    assert (rows["trainer.lr"].type, rows["trainer.lr"].default) == ("float > 0", "1e-06")
    assert rows["queue.port"].type == "int >= 0, <= 65535"
    assert rows["async.mode"].type == "sync | one_step_off | fully_async"  # as written, not sorted
    assert rows["trainer.algorithm.clip_c"].type == "float | null"
    assert rows["eval.top_p"].type == "float > 0, <= 1 | null"
    assert rows["eval.top_p"].description.startswith("top_p of evaluation requests")  # Meta inside `| None`
    assert rows["eval.every"].key == "eval.every"  # the name users write, not `eval_`
    assert rows["queue.capacity_bytes"].default == "8589934592 (8 GiB)"
    assert [format_default(v) for v in (None, True, "", [], {"a": 1})] == [
        "null",
        "true",
        '""',
        "[]",
        "{a: 1}",
    ]


def test_docs_config_md_is_current():
    path = ROOT / "docs" / "config.md"
    assert path.read_text() == markdown(Config), "regenerate it: slipstream config docs > docs/config.md"


def test_markdown_has_a_table_row_per_key():
    text = markdown(Config)
    keys = [k.key for s in sections(Config) for k in s.keys]
    assert all(f"| `{key}` |" in text for key in keys)
    assert "## `trainer.algorithm`" in text


class _Choice(ConfigStruct):
    """Pipes in a cell are escaped."""

    kind: Annotated[Literal["a", "b"], Meta(description="Either a | b.")] = "a"


def test_markdown_escapes_pipes_in_cells():
    assert "| `kind` | a \\| b | `a` | Either a \\| b. |" in markdown(_Choice)
