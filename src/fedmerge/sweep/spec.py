"""What a sweep runs: a base config, fixed overrides, a grid, optional named methods and tuned values.

A sweep file (YAML)::

    config: configs/digits_fedavg.yaml     # optional base config (relative to the working folder,
                                           # else to the sweep file's folder)
    overrides: [rounds=30, partition.num_clients=20]   # fixed for every run
    grid:                                  # the cartesian product of these values
      algorithm.name: [fedavg, ditto, fedmerge]
      partition.alpha: [0.1, 0.5]
      seed: [0, 1, 2]
    methods:                               # optional: named variants instead of algorithm.* grid keys
      fedmerge-paper: [algorithm.name=fedmerge, algorithm.preset=paper]
      ditto: [algorithm.name=ditto]

or the same from the command line: ``fedmerge sweep CONFIG algorithm.name=[fedavg,ditto] seed=[0,1,2]``
(a ``KEY=[...]`` value is a grid axis; a list-valued key such as ``model.hidden`` is fixed with
``model.hidden=[[64,32]]``).

Every grid point is resolved and validated before anything runs, so a key that does not exist is
refused up front, naming it. A point's *method* is its named method, else its ``algorithm.*``
values; its *setting* is every other grid key except ``seed``: comparison tables are per setting.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from fedmerge.config.schema import ConfigError, ExperimentConfig, dataset_label, load_config, parse_override, read_yaml
from fedmerge.config.tuned import load_tuned, load_tuned_config

SWEEP_KEYS = ("config", "overrides", "grid", "methods", "tuned", "name")
SEED = "seed"


@dataclass(frozen=True)
class SweepSpec:
    config: str | None = None
    overrides: tuple[str, ...] = ()
    grid: dict[str, list[Any]] = field(default_factory=dict)
    methods: dict[str, list[str]] = field(default_factory=dict)
    tuned: str | None = None  # a `fedmerge tune` output file
    name: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "overrides": list(self.overrides),
            "grid": self.grid,
            "methods": self.methods,
            "tuned": self.tuned,
            "name": self.name,
        }

    def default_name(self) -> str:
        digest = hashlib.sha256(json.dumps(self.to_json(), sort_keys=True, default=str).encode()).hexdigest()
        return self.name or f"sweep-{digest[:8]}"


@dataclass
class SweepPoint:
    """One run of the sweep."""

    key: str  # its folder name under SWEEP_DIR/runs
    method: str
    setting: str
    seed: int
    setting_values: dict[str, Any]
    overrides: list[str]  # after the base config: fixed, method, grid values
    config: ExperimentConfig = field(repr=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "method": self.method,
            "setting": self.setting,
            "seed": self.seed,
            "overrides": self.overrides,
        }


def is_sweep_file(path: str | Path) -> bool:
    """A YAML whose top level has sweep keys (a config never has ``grid``, ``methods`` or ``config``)."""
    data = read_yaml(Path(path))
    return any(k in data for k in ("grid", "methods", "config"))


def load_sweep_file(path: str | Path) -> SweepSpec:
    path = Path(path)
    data = read_yaml(path)
    unknown = sorted(set(data) - set(SWEEP_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown sweep key {unknown[0]!r}; a sweep file has {', '.join(SWEEP_KEYS)}")
    config = data.get("config")
    if config is not None and not Path(config).exists() and (path.parent / config).exists():
        config = str(path.parent / config)
    grid = data.get("grid") or {}
    if not isinstance(grid, dict):
        raise ConfigError(f"{path}: grid must map keys to lists of values")
    methods = data.get("methods") or {}
    if not isinstance(methods, dict):
        raise ConfigError(f"{path}: methods must map a label to a list of key=value overrides")
    return SweepSpec(
        config=config,
        overrides=tuple(_override_list(data.get("overrides"), f"{path}: overrides")),
        grid={str(k): _grid_values(k, v) for k, v in grid.items()},
        methods={str(k): _override_list(v, f"{path}: methods.{k}") for k, v in methods.items()},
        tuned=data.get("tuned"),
        name=data.get("name") or path.stem,
    )


def spec_from_args(args: list[str], tuned: str | None = None) -> SweepSpec:
    """``[SWEEP.yaml | CONFIG.yaml] KEY=VALUE | KEY=[v1,v2] ...``: lists become grid axes."""
    spec = SweepSpec()
    rest = list(args)
    if rest and "=" not in rest[0]:
        first = rest.pop(0)
        spec = load_sweep_file(first) if is_sweep_file(first) else SweepSpec(config=first)
    fixed, grid = list(spec.overrides), dict(spec.grid)
    for text in rest:
        path, value = parse_override(text)
        key = ".".join(path)
        if isinstance(value, list) and key != "plugins":  # a list of modules to import, never an axis
            grid[key] = _grid_values(key, value)
        else:
            fixed.append(text)
    return SweepSpec(spec.config, tuple(fixed), grid, spec.methods, tuned or spec.tuned, spec.name)


def expand(spec: SweepSpec) -> list[SweepPoint]:
    """Every point of the grid (x methods), resolved and validated; raises ConfigError naming the key."""
    tuned = spec.tuned
    if tuned:
        load_tuned(tuned)  # a bad file is named once, not per point
    for text in spec.overrides:  # a bad fixed key is named before the grid multiplies it
        try:
            load_config(spec.config, [text])
        except ConfigError as exc:
            raise ConfigError(f"override {exc}") from None
    methods = list(spec.methods.items()) or [(None, [])]
    keys = list(spec.grid)
    setting_keys = [k for k in keys if k != SEED and not k.startswith("algorithm.")]
    points = []
    for label, method_overrides in methods:
        for values in itertools.product(*(spec.grid[k] for k in keys)):
            chosen = dict(zip(keys, values))
            # algorithm.name first: switching the algorithm drops the keys the new one does not accept
            ordered = sorted(chosen, key=lambda k: k != "algorithm.name")
            overrides = [*spec.overrides, *method_overrides, *(f"{k}={format_value(chosen[k])}" for k in ordered)]
            where = ", ".join(f"{k}={format_value(v)}" for k, v in chosen.items())
            where = f"grid point {where}" + (f" of method {label!r}" if label else "")
            try:
                cfg = _resolve(spec.config, overrides, tuned)
            except ConfigError as exc:
                bad = next((k for k in keys if str(exc).startswith(f"{k}:")), None)
                raise ConfigError(f"grid key {exc}" if bad else f"{where}: {exc}") from None
            method = label or _method_label(cfg, chosen)
            setting = ", ".join(f"{k}={format_value(chosen[k])}" for k in setting_keys) or _default_setting(cfg)
            values_of_setting = {k: chosen[k] for k in setting_keys}
            points.append(SweepPoint("", method, setting, cfg.seed, values_of_setting, overrides, cfg))
    _assign_keys(points)
    return points


def _resolve(config: str | None, overrides: list[str], tuned: str | None) -> BaseModel:
    return load_tuned_config(config, overrides, tuned) if tuned else load_config(config, overrides)


def format_value(value: Any) -> str:
    """The text of ``value`` in a ``key=value`` override (read back with YAML)."""
    if isinstance(value, str) and yaml.safe_load(value) == value and "=" not in value:
        return value
    return json.dumps(value)


def _method_label(cfg: ExperimentConfig, chosen: dict[str, Any]) -> str:
    extra = [f"{k.removeprefix('algorithm.')}={format_value(v)}" for k, v in chosen.items()]
    extra = [e for e, k in zip(extra, chosen) if k.startswith("algorithm.") and k != "algorithm.name"]
    return " ".join([cfg.algorithm.name, *extra])


def _default_setting(cfg: ExperimentConfig) -> str:
    return f"{dataset_label(cfg.dataset)}, {cfg.partition.name}"


def _assign_keys(points: list[SweepPoint]) -> None:
    """Readable, unique folder names: method, setting values, seed (``fedavg__alpha-0.1__s0``)."""
    seen: dict[str, int] = {}
    for p in points:
        setting = [f"{k.rsplit('.', 1)[-1]}-{format_value(v)}" for k, v in p.setting_values.items()]
        parts = [p.method, *setting, f"s{p.seed}"]
        key = "__".join(_slug(x) for x in parts)
        n = seen.get(key, 0)
        seen[key] = n + 1
        p.key = key if n == 0 else f"{key}-{n}"


def _slug(text: str) -> str:
    return re.sub(r"-{2,}", "-", re.sub(r"[^A-Za-z0-9_.+-]+", "-", text)).strip("-") or "x"


def _grid_values(key: Any, values: Any) -> list[Any]:
    if not isinstance(values, list) or not values:
        raise ConfigError(f"grid key {key}: expected a non-empty list of values, got {values!r}")
    return values


def _override_list(value: Any, where: str) -> list[str]:
    """``[key=value, ...]`` or ``{key: value}`` -> ``["key=value", ...]``."""
    if value is None:
        return []
    if isinstance(value, dict):
        return [f"{k}={format_value(v)}" for k, v in value.items()]
    if isinstance(value, list) and all(isinstance(v, str) and "=" in v for v in value):
        return list(value)
    raise ConfigError(f"{where}: expected a list of key=value strings or a mapping, got {value!r}")
