"""One lookup for every plug-in point of the agents: a registered name, or a user's ``package.module:name``.

Agent loops (``agent.name``), tools (``agent.tools``) and reward functions (``reward.sources`` values) are
each chosen by a config string. A plain name is looked up in that point's registry (a dict) and an unknown
one fails listing the known names; a string with a colon is a user's own plug-in, imported and checked for
its kind: an agent loop must be a subclass of :class:`~slipstream.agents.base.AgentLoop`, a tool a subclass
of :class:`~slipstream.agents.tools.base.Tool`, a reward function any callable. Every failure is one line
naming the config key, the module and what is wrong, so the pipeline's config check
(``slipstream.pipeline.modes``) can report it before a process starts.

Worked example::

    lookup(AGENT_LOOPS, "tool", key="agent.name", what="agent loop")        # ToolAgentLoop
    lookup(AGENT_LOOPS, "slipstream.agents.examples.plugins:EchoLoop", key="agent.name",
           what="agent loop", kind=AgentLoop)                               # EchoLoop
    load_plugin("agent.tools", "mypkg.tools:Weather", kind=Tool)
    # PluginError: agent.tools: cannot import module `mypkg.tools` (ModuleNotFoundError: No module ...)
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class PluginError(ValueError):
    """A plug-in path that cannot be used; the message names the key, the module and the problem."""


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
        raise PluginError(f"{key}: expected `package.module:name`, got `{path}`")
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


def lookup(
    registry: Mapping[str, T],
    name: str,
    *,
    key: str,
    what: str,
    plural: str = "",
    kind: type | None = None,
) -> T:
    """``registry[name]``, or the plug-in ``name`` names when it has a colon.

    An unknown plain name raises :class:`PluginError` (a ValueError):
    ``"<key>: unknown <what> `<name>`; known <plural>: a, b"``.
    """
    if is_plugin_path(name):
        return load_plugin(key, name, kind=kind)
    if name not in registry:
        known = f"known {plural}:" if plural else "known:"
        raise PluginError(
            f"{key}: unknown {what} `{name}`; {known} {', '.join(registry)}, or `package.module:name`"
        )
    return registry[name]


def _describe(obj: Any) -> str:
    if isinstance(obj, type):
        return f"class {obj.__qualname__}"
    return f"a {type(obj).__name__}"
