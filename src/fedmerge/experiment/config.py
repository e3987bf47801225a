"""The experiment config: one validated pydantic model built from the component registries.

Sources, in order of precedence: command-line ``key.path=value`` overrides, the YAML file, the
built-in defaults. Any problem (unknown key, wrong type, impossible value) raises ConfigError
with a one-line message naming the key path.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from fedmerge.algorithms import ALGORITHMS
from fedmerge.data import DATASETS, PARTITIONERS, NoiseConfig, SplitConfig
from fedmerge.models import MODELS

DEFAULT_CONFIG: dict[str, Any] = {
    "name": "fedavg-digits",
    "seed": 0,
    "rounds": 20,
    "dataset": {"name": "digits"},
    "partition": {"name": "dirichlet", "num_clients": 10, "alpha": 0.5},
    "model": {"name": "mlp"},
    "algorithm": {"name": "fedavg", "lr": 0.2, "local_epochs": 2, "batch_size": 32},
}


class ConfigError(ValueError):
    """A user-facing configuration problem; ``str(err)`` is one line."""


class FlowerSettings(BaseModel):
    """``flower:`` section, read only with ``engine: flower`` (docs/deployment.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replies: int = Field(1, ge=1, description="fewest training replies a round needs (capped at those selected)")
    max_retries: int = Field(1, ge=0, description="resends to the failed clients when a round has too few replies")
    round_timeout: float = Field(600.0, gt=0, description="seconds to wait for the replies to one round's messages")
    connect_timeout: float = Field(120.0, gt=0, description="seconds to wait for a SuperNode for every partition")
    num_cpus: int | None = Field(None, ge=1, description="simulation: CPUs Ray may use (None: all)")
    client_cpus: float = Field(1.0, gt=0, description="simulation: CPUs reserved per ClientApp")
    client_gpus: float = Field(0.0, ge=0, description="simulation: GPUs reserved per ClientApp")


class RunSettings(BaseModel):
    """Fields that are not components: the schedule, engine and outputs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("experiment", min_length=1, pattern=r"^[A-Za-z0-9_.+-]+$")
    seed: int = Field(0, ge=0)
    rounds: int = Field(20, ge=1)
    participation: float = Field(1.0, gt=0, le=1, description="fraction of clients sampled per round")
    eval_every: int = Field(1, ge=1)
    checkpoint_every: int = Field(1, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    engine: Literal["local", "flower"] = "local"
    flower: FlowerSettings | None = None  # None: defaults; omitted from config.yaml so local runs are unchanged
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?|mps|auto)$")
    output_dir: str = "runs"
    eval_batch_size: int = Field(1024, ge=1)
    threads: int | None = Field(
        1,
        ge=1,
        description="torch intra-op CPU threads for client and server work, the same in every engine and worker: "
        "the thread count changes the numbers (reduction order); null: the machine's default, not portable",
    )
    workers: int = Field(1, ge=1, description="engine=local: processes running clients in parallel (threads=1 each)")


@cache
def experiment_model() -> type[BaseModel]:
    """The full schema, built once the registries are populated."""
    return create_model(
        "ExperimentConfig",
        __base__=RunSettings,
        dataset=(DATASETS.config_union(), ...),
        partition=(PARTITIONERS.config_union(), ...),
        split=(SplitConfig, SplitConfig()),
        noise=(NoiseConfig, NoiseConfig()),
        model=(MODELS.config_union(), ...),
        algorithm=(ALGORITHMS.config_union(), ...),
    )


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a","b","c"], yaml-parsed value)."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: expected key.path=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def infer_dataset_name(path: str) -> str | None:
    """The user-data loader a bare ``dataset.path=...`` most likely means."""
    lower = path.lower()
    if lower.endswith(".npz"):
        return "npz"
    if lower.endswith((".csv", ".tsv", ".txt")):
        return "csv"
    if Path(path).is_dir():
        return "image_folder"
    return None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    keys = {o.partition("=")[0] for o in overrides}
    if "dataset.path" in keys and "dataset.name" not in keys:
        # `fedmerge run dataset.path=my.npz` just works: pick the loader from the file.
        path = next(o.partition("=")[2] for o in overrides if o.startswith("dataset.path="))
        section = data.get("dataset") or {}
        accepts_path = (
            "path" in DATASETS.get(section["name"]).config.model_fields if section.get("name") in DATASETS else False
        )
        inferred = infer_dataset_name(path)
        if not accepts_path and inferred is not None:
            overrides = [f"dataset.name={inferred}", *overrides]
    for text in overrides:
        path, value = parse_override(text)
        if path == ["dataset", "data_dir"]:
            path = _data_dir_key(data.get("dataset") or {})
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"{'.'.join(path[: i + 1])}: is not a section, cannot set {'.'.join(path)}")
            node = child
        if path[-1] == "name" and len(path) == 2 and node.get("name") != value:
            _switch_component(path[0], node, value)
        node[path[-1]] = value
    return data


_COMPONENT_SECTIONS = {
    "algorithm": ALGORITHMS,
    "dataset": DATASETS,
    "partition": PARTITIONERS,
    "model": MODELS,
}


def _switch_component(section: str, node: dict[str, Any], new_name: Any) -> None:
    """On ``section.name=other``, keep only the fields the new component also accepts
    (e.g. lr and batch_size survive fedavg -> fedprox; alpha does not survive dirichlet -> iid)."""
    registry = _COMPONENT_SECTIONS.get(section)
    if registry is None or not isinstance(new_name, str) or new_name not in registry:
        return  # validation reports the bad name
    accepted = registry.get(new_name).config.model_fields
    for key in [k for k in node if k not in accepted]:
        del node[key]


def _data_dir_key(section: dict[str, Any]) -> list[str]:
    """``--data-dir`` means ``dataset.data_dir`` for built-in sources and ``dataset.path`` for user files."""
    name = section.get("name")
    if name not in DATASETS:
        return ["dataset", "data_dir"]  # validation reports the bad name
    fields = DATASETS.get(name).config.model_fields
    for key in ("data_dir", "path"):
        if key in fields:
            return ["dataset", key]
    raise ConfigError(f"dataset.data_dir: dataset {name!r} reads no files (it ships inside its Python package)")


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: invalid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of keys to values")
    return data


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``update`` into a copy of ``base``; a section whose ``name`` changes is replaced."""
    out = dict(base)
    for key, value in update.items():
        old = out.get(key)
        if isinstance(old, dict) and isinstance(value, dict) and value.get("name", old.get("name")) == old.get("name"):
            out[key] = merge(old, value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> BaseModel:
    data = merge(DEFAULT_CONFIG, read_yaml(Path(path))) if path is not None else dict(DEFAULT_CONFIG)
    data = apply_overrides(_deep_copy(data), overrides or [])
    return validate(data)


def validate(data: dict[str, Any]) -> BaseModel:
    try:
        return experiment_model().model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, data)) from None


def format_validation_error(exc: ValidationError, data: dict[str, Any]) -> str:
    err = exc.errors()[0]
    loc = _clean_loc(err["loc"], data)
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    elif err["type"] == "union_tag_invalid":
        ctx = err.get("ctx", {})
        msg = f"unknown name {ctx.get('tag')!r}; expected one of {ctx.get('expected_tags')}"
        loc = loc + ".name"
    elif "input" in err and not isinstance(err["input"], dict | list):
        msg = f"{msg} (got {err['input']!r})"
    more = f" (+{len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"{loc}: {msg}{more}"


def _clean_loc(loc: tuple, data: dict[str, Any]) -> str:
    """Drop the discriminator tags pydantic inserts (e.g. ('algorithm','fedprox','mu'))."""
    parts: list[str] = []
    node: Any = data
    for item in loc:
        if isinstance(node, dict) and isinstance(item, str) and item not in node and node.get("name") == item:
            continue
        parts.append(str(item))
        node = node.get(item) if isinstance(node, dict) else None
    return ".".join(parts) or "config"


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def to_yaml(cfg: BaseModel) -> str:
    exclude = {"flower"} if getattr(cfg, "flower", None) is None else None
    return yaml.safe_dump(cfg.model_dump(mode="json", exclude=exclude), sort_keys=False)
