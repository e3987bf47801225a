"""The file ``fedmerge tune`` writes and ``fedmerge run --tuned`` / ``fedmerge sweep --tuned`` read.

::

    tuned_on: {config: configs/x.yaml, overrides: [rounds=20], metric: val_acc, trials: 20}
    methods:
      fedavg: {overrides: [algorithm.lr=0.031], value: 0.812, trials: 20}
      ditto:  {overrides: [algorithm.lr=0.012, algorithm.lam=0.3], value: 0.845, trials: 20}

A run takes the overrides of its algorithm; overrides given explicitly still win.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel

from fedmerge.config.schema import ConfigError, load_config, read_yaml


def load_tuned(path: str | Path) -> dict[str, Any]:
    data = read_yaml(Path(path), "tune file")
    methods = data.get("methods")
    if not isinstance(methods, dict) or not all(
        isinstance(m, dict) and isinstance(m.get("overrides"), list) for m in methods.values()
    ):
        raise ConfigError(f"{path}: not a fedmerge tune file (expected methods: NAME: overrides: [key=value, ...])")
    return {"path": str(path), **data}


def tuned_overrides(tuned: dict[str, Any], algorithm: str) -> list[str]:
    methods = tuned["methods"]
    if algorithm not in methods:
        raise ConfigError(
            f"{tuned['path']} has no tuned values for algorithm {algorithm!r} (it has: {', '.join(methods) or 'none'})"
        )
    return [str(o) for o in methods[algorithm]["overrides"]]


def load_tuned_config(config: str | Path | None, overrides: list[str], tuned_path: str | Path) -> BaseModel:
    """The config with the tuned values of its algorithm applied; ``overrides`` are applied before them
    (to know the algorithm) and again after them (so that explicit values win)."""
    algorithm = load_config(config, overrides).algorithm.name
    return load_config(config, [*overrides, *tuned_overrides(load_tuned(tuned_path), algorithm), *overrides])
