"""What ``fedmerge list`` shows: the component registries, the plain config sections, and the
names under which the papers know some settings of a registered method (FedIT)."""

from __future__ import annotations

from pydantic import BaseModel

from fedmerge.algorithms.privacy_settings import PrivacySettings
from fedmerge.config.known_as import KNOWN_AS as KNOWN_AS
from fedmerge.config.schema import (
    COMPONENT_SECTIONS,
    FlowerSettings,
    LogSettings,
    RunSettings,
    StateSettings,
    UnseenSettings,
)
from fedmerge.config.schema_docs import did_you_mean
from fedmerge.core.registry import Registry
from fedmerge.data import NoiseConfig, SplitConfig

REGISTRIES: dict[str, Registry] = COMPONENT_SECTIONS
SECTIONS: dict[str, type[BaseModel]] = {
    "run": RunSettings,
    "split": SplitConfig,
    "noise": NoiseConfig,
    "flower": FlowerSettings,
    "log": LogSettings,
    "state": StateSettings,
    "unseen": UnseenSettings,
    "privacy": PrivacySettings,
}
_KIND_WORDS = {"algorithms": "algorithm", "datasets": "dataset", "partitioner": "partition", "models": "model"}
_KIND_WORDS |= {"partitioners": "partition", "partitions": "partition", "settings": "run"}


def kind_of(word: str) -> str | None:
    """``algorithms`` -> ``algorithm``; None when ``word`` is no kind of component or section."""
    word = word.lower()
    word = _KIND_WORDS.get(word, word)
    return word if word in REGISTRIES or word in SECTIONS else None


def kinds() -> list[str]:
    return [*REGISTRIES, *SECTIONS]


def config_class(kind: str, name: str | None = None) -> type[BaseModel]:
    """The schema of a section (``run``, ``split``...) or of a registered component; KeyError names
    the nearest names when ``name`` is unknown."""
    if kind in SECTIONS:
        return SECTIONS[kind]
    registry = REGISTRIES[kind]
    if name not in registry:
        alias = KNOWN_AS.get(str(name).lower())
        if alias is not None and kind == "algorithm":
            return registry.get(alias[0]).config
        raise KeyError(f"unknown {kind} {name!r}{did_you_mean(str(name), registry.names())}; see: fedmerge list {kind}")
    return registry.get(name).config


def find_component(name: str) -> list[tuple[str, str]]:
    """(kind, registered name) of every component called ``name`` (or known by that name)."""
    hits = [(kind, name) for kind, registry in REGISTRIES.items() if name in registry]
    alias = KNOWN_AS.get(name.lower())
    if alias is not None:
        hits.append(("algorithm", name))  # config_class resolves the alias
    return hits
