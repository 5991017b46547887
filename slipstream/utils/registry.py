"""One registry for every plug-in point chosen by a config string, and the ``package.module:name`` loader.

Advantage estimators, policy losses, KL estimators, rejection criteria, loss aggregation modes, trainer
engines, weight-sync backends, server launchers, agent loops, tools and reward functions are each looked up
by a string the user writes in the config. Each keeps one :class:`Registry`, so every one of them fails the
same way on a typo: an :class:`UnknownNameError` (a ValueError) that names the config key, the bad value and
the known names, and says that ``package.module:name`` is accepted where users may bring their own::

    agent.name: unknown agent loop `react`; known loops: single_turn, tool, external, or `package.module:name`

Entries are registered with a decorator (``@REGISTRY.register("name")``), added directly (``add``), or named
lazily by import path (``lazy={"megatron": "slipstream.trainer.engine.megatron:MegatronEngine"}``) so a
backend whose dependencies may be missing is imported only when chosen. Where ``plugins=True`` a name with a
colon is a user's own object, imported and checked: a subclass of ``base`` when given, else any callable.

Worked example::

    ADVANTAGES = Registry("advantage estimator", "trainer.algorithm.adv_estimator")

    @ADVANTAGES.register("grpo")
    def grpo(...): ...

    ADVANTAGES.get("grpo")    # the function
    ADVANTAGES.get("grpoo")   # UnknownNameError: trainer.algorithm.adv_estimator: unknown advantage
                              #   estimator `grpoo`; known advantage estimators: grpo, ...
    load_plugin("agent.tools", "mypkg.tools:Weather", kind=Tool)
    # PluginError: agent.tools: cannot import module `mypkg.tools` (ModuleNotFoundError: No module ...)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")

PLUGIN_HINT = "`package.module:name`"


class UnknownNameError(ValueError, KeyError):
    """A config string that names nothing registered. A ValueError (a bad config value); also a KeyError,
    because it is a failed lookup and callers that catch the lookup failure keep working."""

    __str__ = Exception.__str__  # KeyError would quote the message


class PluginError(ValueError):
    """A plug-in path that cannot be used; the message names the key, the module and the problem."""


class Registry(Generic[T]):
    """Config strings to objects (classes or functions) for one plug-in point.

    ``kind`` is what an entry is ("policy loss"), ``config_key`` the dotted key that chooses one, ``plural``
    the word for several (default ``kind + "s"``). ``plugins`` lets a ``package.module:name`` string name a
    user's object, checked to be a subclass of ``base`` (or callable when ``base`` is None). ``name_attr``
    is set on each registered object to its name (``cls.name = "torch_dist"``).
    """

    def __init__(
        self,
        kind: str,
        config_key: str,
        *,
        plural: str = "",
        plugins: bool = False,
        base: type | None = None,
        name_attr: str = "",
        lazy: Mapping[str, str] | None = None,
    ) -> None:
        self.kind = kind
        self.config_key = config_key
        self.plural = plural or kind + "s"
        self.plugins = plugins
        self.base = base
        self.name_attr = name_attr
        self._items: dict[str, T] = {}
        self._lazy: dict[str, str] = dict(lazy or {})

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: register the decorated object under ``name`` (twice with another object fails)."""

        def decorator(obj: T) -> T:
            self.add(name, obj)
            return obj

        return decorator

    def add(self, name: str, obj: T) -> None:
        if name in self._items and self._items[name] is not obj:
            raise ValueError(f"{self.kind} `{name}` is already registered ({self._items[name]!r})")
        if self.name_attr:
            setattr(obj, self.name_attr, name)
        self._items[name] = obj

    def get(self, name: str, *, key: str = "") -> T:
        """The object ``name`` names; :class:`UnknownNameError` or :class:`PluginError` otherwise. ``key``
        names the config key in errors when it is more precise than ``config_key`` (``reward.sources.gsm8k``).
        """
        if name in self._items:
            return self._items[name]
        key = key or self.config_key
        if name in self._lazy:
            obj = load_plugin(key, self._lazy[name], kind=self.base)
            self._items.setdefault(name, obj)
            return self._items[name]
        if self.plugins and is_plugin_path(name):
            return load_plugin(key, name, kind=self.base)
        raise self.unknown(name, key=key)

    def unknown(self, name: object, *, key: str = "") -> UnknownNameError:
        """The error for a name nothing is registered under (for callers that check before looking up)."""
        known = ", ".join(self.names())
        hint = f", or {PLUGIN_HINT}" if self.plugins else ""
        return UnknownNameError(
            f"{key or self.config_key}: unknown {self.kind} `{name}`; known {self.plural}: {known}{hint}"
        )

    def names(self) -> list[str]:
        """The registered names, in registration order (lazy ones not yet imported included)."""
        return list(self._items) + [n for n in self._lazy if n not in self._items]

    def items(self) -> list[tuple[str, T]]:
        """(name, object) of every entry, importing the lazy ones."""
        return [(name, self.get(name)) for name in self.names()]

    __getitem__ = get

    def __contains__(self, name: object) -> bool:
        return name in self._items or name in self._lazy

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())


def is_plugin_path(name: str) -> bool:
    """Whether ``name`` is a user's ``package.module:name`` rather than a registered name."""
    return ":" in name


def load_plugin(key: str, path: str, *, kind: type | None = None) -> Any:
    """Import ``package.module:name`` and check it: a subclass of ``kind`` when given, else callable.

    Raises :class:`PluginError` (one line, naming ``key`` and the module) for a malformed path, a module
    that does not import, a missing attribute or an object of the wrong kind.
    """
    module_name, _, attr = path.partition(":")
    if not module_name or not attr or ":" in attr:
        raise PluginError(f"{key}: expected {PLUGIN_HINT}, got `{path}`")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # a plug-in module's own import error is the user's to see, in one line
        reason = " ".join(f"{type(err).__name__}: {err}".split())
        raise PluginError(f"{key}: cannot import module `{module_name}` ({reason})") from None
    obj: Any = module
    for part in attr.split("."):  # `module:Class.factory` reaches into a class
        if not hasattr(obj, part):
            raise PluginError(f"{key}: module `{module_name}` has no attribute `{attr}`")
        obj = getattr(obj, part)
    if kind is not None:
        if not (isinstance(obj, type) and issubclass(obj, kind)):
            raise PluginError(
                f"{key}: `{attr}` in module `{module_name}` is not a subclass of "
                f"{kind.__module__}.{kind.__qualname__} (it is {_describe(obj)})"
            )
    elif not callable(obj):
        raise PluginError(
            f"{key}: `{attr}` in module `{module_name}` is not callable (it is {_describe(obj)})"
        )
    return obj


def _describe(obj: Any) -> str:
    if isinstance(obj, type):
        return f"class {obj.__qualname__}"
    return f"a {type(obj).__name__}"


__all__ = ["PluginError", "Registry", "UnknownNameError", "is_plugin_path", "load_plugin"]
