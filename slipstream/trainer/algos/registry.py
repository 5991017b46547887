"""A tiny name → function registry that fails loudly on unknown or duplicate names.

Every algorithm family (advantage estimators, policy losses, rejection criteria, KL estimators) keeps one
of these, keyed by the strings users write in the config, so a typo names the valid choices instead of
silently falling back to a default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Maps config strings to callables.

    Example::

        ADVANTAGES = Registry("advantage estimator", "trainer.algorithm.adv_estimator")

        @ADVANTAGES.register("grpo")
        def grpo(...): ...

        ADVANTAGES.get("grpo")   # the function
        ADVANTAGES.get("grpoo")  # KeyError: unknown advantage estimator 'grpoo' (trainer.algorithm....)
    """

    def __init__(self, kind: str, config_key: str) -> None:
        self.kind = kind
        self.config_key = config_key
        self._items: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def decorator(fn: F) -> F:
            if name in self._items and self._items[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered ({self._items[name]!r})")
            self._items[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        try:
            return self._items[name]
        except KeyError:
            raise KeyError(
                f"unknown {self.kind} {name!r} ({self.config_key}); choose one of {sorted(self._items)}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items
