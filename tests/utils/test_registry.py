"""The one registry every plug-in point uses: lookups, lazy entries, plug-in paths and the error style."""

from __future__ import annotations

import pytest

from slipstream.utils.registry import PluginError, Registry, UnknownNameError


class Base:
    name = ""


def _registry(**kwargs) -> Registry[type[Base]]:
    registry: Registry[type[Base]] = Registry("widget", "section.widget", **kwargs)

    @registry.register("plain")
    class Plain(Base):
        pass

    return registry


def test_registered_names_resolve_and_list_in_order():
    reg = _registry(lazy={"later": "collections:OrderedDict"})
    assert reg.get("plain").__name__ == "Plain" and reg["plain"] is reg.get("plain")
    assert reg.names() == ["plain", "later"] and list(reg) == reg.names() and len(reg) == 2
    assert "later" in reg and "nope" not in reg


def test_unknown_name_names_the_key_the_value_and_the_known_names():
    with pytest.raises(UnknownNameError) as err:
        _registry().get("plian")
    assert str(err.value) == "section.widget: unknown widget `plian`; known widgets: plain"
    assert isinstance(err.value, ValueError) and isinstance(err.value, KeyError)
    with pytest.raises(ValueError, match="^reward.sources.x: unknown widget `y`; known things: plain, or "):
        _registry(plural="things", plugins=True).get("y", key="reward.sources.x")


def test_plugin_paths_only_where_allowed_and_checked_for_their_kind():
    with pytest.raises(UnknownNameError):
        _registry().get("collections:OrderedDict")
    with pytest.raises(
        PluginError, match="^section.widget: `OrderedDict` in module `collections` is not a sub"
    ):
        _registry(plugins=True, base=Base).get("collections:OrderedDict")
    assert _registry(plugins=True).get("collections:OrderedDict").__name__ == "OrderedDict"


def test_lazy_entries_import_on_first_use_and_a_broken_one_names_the_key():
    reg = _registry(lazy={"od": "collections:OrderedDict", "gone": "no_such_module_here:X"})
    assert reg.get("od").__name__ == "OrderedDict"
    with pytest.raises(PluginError, match="^section.widget: cannot import module `no_such_module_here`"):
        reg.get("gone")


def test_registering_sets_the_name_attribute_and_refuses_a_second_object():
    reg = _registry(name_attr="name")

    @reg.register("fancy")
    class Fancy(Base):
        pass

    assert Fancy.name == "fancy"
    reg.register("fancy")(Fancy)  # the same object again is fine (a module imported twice)
    with pytest.raises(ValueError, match="widget `fancy` is already registered"):
        reg.add("fancy", Base)
