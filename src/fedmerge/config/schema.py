"""The experiment config: one validated pydantic model built from the component registries.

Sources, in order of precedence: command-line ``key.path=value`` overrides, the YAML file, the
built-in defaults. Any problem (unknown key, wrong type, impossible value) raises ConfigError
with a one-line message naming the key path.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError, create_model

from fedmerge.algorithms import ALGORITHMS
from fedmerge.algorithms.ifca import IFCAConfig
from fedmerge.config.errors import CONFIG_FILE as CONFIG_FILE
from fedmerge.config.errors import ConfigError as ConfigError
from fedmerge.config.experiment_config import MODULE_NAME, RUN_NAME
from fedmerge.config.experiment_config import ExperimentConfig as ExperimentConfig
from fedmerge.config.experiment_config import RunSettings as RunSettings
from fedmerge.config.saved_config import RUN_LOCAL_KEYS as RUN_LOCAL_KEYS
from fedmerge.config.saved_config import defaults_left_out as defaults_left_out
from fedmerge.config.saved_config import first_config_difference as first_config_difference
from fedmerge.config.saved_config import to_yaml as to_yaml
from fedmerge.config.schema_docs import did_you_mean, keys_at
from fedmerge.config.sections import FlowerSettings as FlowerSettings
from fedmerge.config.sections import LogSettings as LogSettings
from fedmerge.config.sections import StateSettings as StateSettings
from fedmerge.config.sections import UnseenSettings as UnseenSettings
from fedmerge.config.sources import COMPONENT_SECTIONS
from fedmerge.config.sources import USER_FILE_DATASETS as USER_FILE_DATASETS
from fedmerge.config.sources import apply_overrides as apply_overrides
from fedmerge.config.sources import infer_dataset_name as infer_dataset_name
from fedmerge.config.sources import merge as merge
from fedmerge.config.sources import parse_override as parse_override
from fedmerge.config.sources import read_yaml as read_yaml
from fedmerge.core.algorithm import BUILTIN_DEFAULTS, AlgorithmConfig
from fedmerge.core.plugins import PluginError, import_plugins, load_installed
from fedmerge.core.registry import registry_version
from fedmerge.data import DATASETS, PARTITIONERS, NoiseConfig, PartitionConfig, SplitConfig
from fedmerge.data.pool import DatasetConfig
from fedmerge.models import MODELS

DEFAULT_CONFIG: dict[str, Any] = {
    "seed": 0,
    "rounds": 20,
    "dataset": {"name": "digits"},
    "partition": {"name": "dirichlet", "num_clients": 10, "alpha": 0.5},
    "model": {"name": "mlp"},
    "algorithm": {"name": "fedavg", "lr": 0.2, "local_epochs": 2, "batch_size": 32},
}


def make_folder(path: Path, option: str, exist_ok: bool = True) -> Path:
    """``path.mkdir(parents=True)``, or a one-line `ConfigError` naming the ``option`` that chose
    the place (a read-only or impossible location, a file in the way)."""
    try:
        path.mkdir(parents=True, exist_ok=exist_ok)
    except OSError as exc:  # FileExistsError too: a file of that name (or, with exist_ok=False, anything)
        raise ConfigError(f"{option}: cannot create {path} ({exc.strerror})") from None
    return path


def experiment_model() -> type[ExperimentConfig]:
    """The full schema, built from the registries after the installed plugins registered their components;
    built again when a component is registered later (a plugin a config names, a test's own method)."""
    load_plugins(())
    return _experiment_model(registry_version())


@lru_cache(maxsize=1)
def _experiment_model(version: int) -> type[ExperimentConfig]:
    return create_model(
        "ExperimentConfig",
        __base__=ExperimentConfig,
        dataset=(DATASETS.config_union(), ...),
        partition=(PARTITIONERS.config_union(), ...),
        split=(SplitConfig, SplitConfig()),
        noise=(NoiseConfig, NoiseConfig()),
        model=(MODELS.config_union(), ...),
        algorithm=(ALGORITHMS.config_union(), ...),
    )


def load_plugins(modules: Any) -> None:
    """Import the installed plugins, then ``modules`` (a config's ``plugins``; a malformed value is left to
    validation to report), so that their components are registered; ConfigError when one cannot be imported."""
    try:
        load_installed()
        if isinstance(modules, list | tuple) and all(isinstance(m, str) and re.match(MODULE_NAME, m) for m in modules):
            import_plugins(modules)
    except PluginError as exc:
        raise ConfigError(str(exc)) from None


# the keys that name a user's files: relative ones are taken from the folder the command runs in
PATH_KEYS = ("path", "data_dir")


def absolute_paths(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with ``dataset.path`` and ``dataset.data_dir`` made absolute (against the working folder),
    so that config.yaml names the same files whichever folder a resume or a report later runs in."""
    section = data.get("dataset")
    if not isinstance(section, dict):
        return data
    fixed = {
        key: os.path.abspath(os.path.expanduser(value))
        for key in PATH_KEYS
        if isinstance(value := section.get(key), str) and value.strip() and not os.path.isabs(value)
    }
    return {**data, "dataset": {**section, **fixed}} if fixed else data


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, *, resolve_paths: bool = True
) -> ExperimentConfig:
    """The config of a file (None: the built-in default) and ``key.path=value`` overrides. ``resolve_paths``:
    relative dataset paths become absolute (a resume keeps those its run folder recorded: its digest)."""
    user = read_yaml(Path(path)) if path is not None else {}
    data = merge(DEFAULT_CONFIG, user)
    # before the overrides: switching a section to a plugin's component keeps the keys that component accepts
    named = [parse_override(o)[1] for o in overrides or [] if o.partition("=")[0] == "plugins"]
    load_plugins(named[-1] if named else data.get("plugins"))
    # a file's name that is just its own ALGORITHM-DATASET is the default written out: it follows an
    # override of the algorithm or the dataset (a Ditto run of digits_fedavg.yaml is ditto-digits)
    follows = data.get("name") == default_name(data) and not any(o.startswith("name=") for o in overrides or [])
    data = apply_overrides(_deep_copy(data), overrides or [])
    if follows:
        data["name"] = None
    if resolve_paths:
        data = absolute_paths(data)
    return validate(data, builtin_algorithm_keys(user, overrides or []))


def builtin_algorithm_keys(user: dict[str, Any], overrides: list[str]) -> frozenset[str]:
    """The algorithm keys that hold a built-in default (neither the file nor an override wrote them):
    an algorithm's preset may replace those (FedMerge's reference preset sets its own lr)."""
    section = user.get("algorithm")
    written = set(section) if isinstance(section, dict) else set()
    written |= {key.split(".")[1] for key in (o.partition("=")[0] for o in overrides) if key.startswith("algorithm.")}
    return frozenset(key for key in DEFAULT_CONFIG["algorithm"] if key not in written)


def validate(data: dict[str, Any], builtin_algorithm: frozenset[str] = frozenset()) -> ExperimentConfig:
    load_plugins(data.get("plugins"))
    if data.get("name") is None:
        data = {**data, "name": default_name(data)}
    try:
        cfg = experiment_model().model_validate(data, context={BUILTIN_DEFAULTS: builtin_algorithm})
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, data)) from None
    if (problem := impossible_setting(cfg)) is not None:
        raise ConfigError(problem)
    return cfg


def impossible_setting(cfg: ExperimentConfig) -> str | None:
    """A valid-looking setting that cannot work: more IFCA clusters than training clients (each client
    picks one cluster, so the extra ones would never be trained); the publisher's test set asked of a dataset
    that has none."""
    from fedmerge.data.unseen import unseen_count

    dataset = cfg.dataset
    # a dataset config that is not a DatasetConfig cannot say: its loaded pool is checked (data.federated)
    if cfg.split.test_from == "publisher" and isinstance(dataset, DatasetConfig) and not dataset.marks_publisher_test():
        return (
            f"split.test_from: publisher: dataset {dataset.name!r} (as configured) has no test set of its publisher's; "
            "use split.test_from: clients"
        )

    # IFCA's clients each train one cluster model, so models beyond the training clients are never trained.
    # (FedMerge's global models and FedEM's components are all trained by every client: the paper's own tables
    # run FedMerge d=5 and FedEM M=5 on 4 clients.) `natural` counts its clients from the data: not checked here.
    if not isinstance(cfg.algorithm, IFCAConfig) or not isinstance(cfg.partition, PartitionConfig):
        return None
    num_clients, clusters = cfg.partition.num_clients, cfg.algorithm.num_clusters
    try:
        training = num_clients - unseen_count(num_clients, cfg.split.unseen_clients)
    except ValueError:  # too many unseen clients: reported where the data is built
        training = num_clients
    if clusters <= training:
        return None
    counted = "partition.num_clients" + ("" if training == num_clients else " less split.unseen_clients")
    return (
        f"algorithm.num_clusters={clusters} asks for more cluster models than the {training} clients that train "
        f"({counted}); lower algorithm.num_clusters to at most {training}"
    )


def dataset_label(section: Any) -> str:
    """How runs, settings and reports name a dataset: a user's file by its stem (two CSV files are told
    apart: ``letter``, not ``csv``), any other by its registered name."""
    section = section.model_dump() if isinstance(section, BaseModel) else section
    if not isinstance(section, dict):
        return "?"
    path = section.get("path")
    if section.get("name") in USER_FILE_DATASETS and isinstance(path, str) and path.strip():
        file = Path(path.rstrip("/\\"))
        stem = file.name if section.get("name") == "image_folder" else file.stem
        stem = re.sub(r"[^A-Za-z0-9_.+-]+", "_", stem).strip("._")
        if stem:
            return stem
    return str(section.get("name", "?"))


def default_name(data: dict[str, Any]) -> str:
    """``ALGORITHM-DATASET`` of the resolved config: a run folder's name unless ``name`` is given."""
    algorithm, dataset = data.get("algorithm"), data.get("dataset")
    parts = [
        algorithm.get("name") if isinstance(algorithm, dict) else None,
        dataset_label(dataset) if isinstance(dataset, dict) and dataset.get("name") else None,
    ]
    parts = [p for p in parts if isinstance(p, str) and p]
    name = "-".join(parts) or "experiment"
    return name if RUN_NAME.fullmatch(name) else "experiment"  # a bad component name is reported by validation


def format_validation_error(exc: ValidationError, data: dict[str, Any]) -> str:
    err = exc.errors()[0]
    loc = _clean_loc(err["loc"], data)
    msg = err["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's ValueError
    if err["type"] == "extra_forbidden":
        msg = "unknown key" + _nearest_keys(err["loc"])
    elif err["type"] == "union_tag_invalid":
        ctx = err.get("ctx", {})
        tag, expected = str(ctx.get("tag")), str(ctx.get("expected_tags", ""))
        names = [n.strip(" '") for n in expected.split(",")]
        close = did_you_mean(tag, names)
        msg = f"unknown name {tag!r}" + (close or f"; expected one of {expected}")
        loc = loc + ".name"
    elif "input" in err and not isinstance(err["input"], dict | list):
        msg = f"{msg} (got {err['input']!r})"
    more = f" (+{len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"{loc}: {msg}{more}"


def _nearest_keys(loc: tuple) -> str:
    """'; did you mean num_models?', else which other component takes the key, else the valid keys."""
    in_component = len(loc) >= 3 and loc[0] in COMPONENT_SECTIONS  # (section, component name, ..., key)
    valid = [k for k in keys_at(experiment_model(), loc) or [] if not (in_component and k == "name")]
    if not valid:
        return ""
    key = str(loc[-1])
    close = did_you_mean(key, valid)
    if close:
        return close
    if not in_component:
        where = f"fedmerge list {loc[0]}" if len(loc) == 2 else "fedmerge list run"
        return f"; valid keys: {', '.join(valid)} (described by: {where})"
    section, name = str(loc[0]), str(loc[1])
    owners = [e.name for e in COMPONENT_SECTIONS[section].entries() if key in e.config.model_fields]
    if owners and len(loc) == 3:
        return f" for {section} {name!r}; it belongs to {', '.join(owners[:4])} (fedmerge list {section} {owners[0]})"
    return f"; valid keys: {', '.join(valid)} (described by: fedmerge list {section} {name})"


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


def config_warnings(cfg: ExperimentConfig) -> list[str]:
    """Valid but most likely unintended settings (one line each): each method says its own."""
    # the registry takes any ComponentConfig: a plugin's method config may not derive from AlgorithmConfig
    return list(cfg.algorithm.warnings(cfg.rounds)) if isinstance(cfg.algorithm, AlgorithmConfig) else []
