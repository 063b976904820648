"""A named registry of factories (agents, environments, backends, ...).

Duplicate registrations and unknown names are errors that list what is
registered, so a typo in a config says what the choices were. A name that is
not registered but has the form `path/to/file.py:Name` or `pkg.module:Name`
is the object it names (`realrl.base.plugins.load_object`): a class or
function of a user's file works without registering it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from realrl.base.plugins import is_object_spec, load_object

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str, factory: Callable[..., T]) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty str, got {name!r}")
        existing = self._factories.get(name)
        if existing is not None and existing is not factory:
            raise ValueError(
                f"{self.kind} {name!r} is already registered (by {_where(existing)}); registered: {self.names()}"
            )
        self._factories[name] = factory

    def make(self, name: str, *args, **kwargs) -> T:
        return self.get(name)(*args, **kwargs)

    def get(self, name: str) -> Callable[..., T]:
        """The factory registered as `name`, else the object a `source:Name`
        spec names (ValueError, one line, if it cannot be loaded); KeyError
        listing the registered names otherwise."""
        factory = self._factories.get(name)
        if factory is not None:
            return factory
        if isinstance(name, str) and is_object_spec(name):
            factory = load_object(name, self.kind)
            if not callable(factory):
                raise ValueError(f"{self.kind} {name!r}: {type(factory).__name__} {factory!r:.80} is not callable")
            return factory
        raise KeyError(f"unknown {self.kind} {name!r}; registered: {self.names()}")

    def names(self) -> list[str]:
        return sorted(self._factories)

    def __contains__(self, name: str) -> bool:
        return name in self._factories


def _where(factory: Callable) -> str:
    return f"{getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', repr(factory))}"
