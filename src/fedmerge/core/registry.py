"""Name -> component registries with one typed (pydantic) config class per entry.

Every registry entry owns a config class whose ``name`` field is a ``Literal`` of the entry's
name; the experiment schema builds a discriminated union from them, so a config section such as
``algorithm: {name: fedprox, mu: 0.01}`` is validated by exactly the class that will consume it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Generic, Literal, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field

T = TypeVar("T")

# Bumped by every registration in any registry: what is built from the registries (the experiment
# schema) keys its cache on it, so a component registered after first use (a plugin) is seen.
_version = 0


def registry_version() -> int:
    """How many components have been registered so far, in all registries together."""
    return _version


class ComponentConfig(BaseModel):
    """Base of every component config: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str


@dataclass(frozen=True)
class Entry(Generic[T]):
    name: str
    obj: T
    config: type[ComponentConfig]
    description: str


class Registry(Generic[T]):
    """A registry of components of one kind (algorithm, dataset, partitioner, model)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}

    def register(self, name: str, *, config: type[ComponentConfig], description: str) -> Callable[[T], T]:
        field = config.model_fields.get("name")
        if field is None or get_origin(field.annotation) is not Literal or get_args(field.annotation) != (name,):
            raise TypeError(f"{config.__name__}.name must be annotated Literal[{name!r}]")
        if field.default != name:
            raise TypeError(f"{config.__name__}.name must default to {name!r}")

        def decorator(obj: T) -> T:
            global _version
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = Entry(name, obj, config, description)
            _version += 1
            return obj

        return decorator

    def get(self, name: str) -> Entry[T]:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries))
            raise KeyError(f"unknown {self.kind} {name!r}; known: {known}") from None

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry[T]]:
        return [self._entries[n] for n in self.names()]

    def config_union(self) -> Any:
        """A pydantic type accepting any registered config, discriminated by ``name``."""
        classes = tuple(e.config for e in self.entries())
        if not classes:
            raise RuntimeError(f"no {self.kind} registered")
        if len(classes) == 1:
            return classes[0]
        return Annotated[Union[classes], Field(discriminator="name")]  # noqa: UP007

    def parse(self, data: dict[str, Any]) -> ComponentConfig:
        """Validate one section on its own (for library use outside the experiment schema)."""
        if "name" not in data:
            raise ValueError(f"{self.kind} config needs a 'name'")
        return self.get(data["name"]).config.model_validate(data)
