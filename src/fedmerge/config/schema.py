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
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    create_model,
    field_validator,
)

from fedmerge.algorithms import ALGORITHMS
from fedmerge.algorithms.privacy_settings import PrivacySettings
from fedmerge.config.errors import CONFIG_FILE as CONFIG_FILE
from fedmerge.config.errors import ConfigError as ConfigError
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
from fedmerge.core.loop import EVAL_CLIENTS_HELP, parse_eval_clients
from fedmerge.core.plugins import PluginError, import_plugins, load_installed
from fedmerge.core.registry import ComponentConfig, registry_version
from fedmerge.data import DATASETS, PARTITIONERS, NoiseConfig, SplitConfig
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


RUN_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")
MODULE_NAME = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"


def make_folder(path: Path, option: str, exist_ok: bool = True) -> Path:
    """``path.mkdir(parents=True)``, or a one-line `ConfigError` naming the ``option`` that chose
    the place (a read-only or impossible location, a file in the way)."""
    try:
        path.mkdir(parents=True, exist_ok=exist_ok)
    except OSError as exc:  # FileExistsError too: a file of that name (or, with exist_ok=False, anything)
        raise ConfigError(f"{option}: cannot create {path} ({exc.strerror})") from None
    return path


class RunSettings(BaseModel):
    """Fields that are not components: the schedule, engine and outputs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # empty: omitted from config.yaml so that existing run folders stay unchanged
    plugins: tuple[Annotated[str, StringConstraints(pattern=MODULE_NAME)], ...] = Field(
        (),
        description="modules imported before the config is read, registering components of other packages "
        "(docs/extending.md); saved in config.yaml, so resumes, sweeps and Flower nodes import them too",
    )
    name: str = Field(
        "experiment",
        min_length=1,
        pattern=RUN_NAME.pattern,
        description="run folder prefix; default ALGORITHM-DATASET (e.g. fedprox-npz)",
    )
    seed: int = Field(0, ge=0, description="seeds the partition, splits, noise, initialisation and training")
    rounds: int = Field(20, ge=1, description="communication rounds")
    participation: float = Field(1.0, gt=0, le=1, description="fraction of clients sampled per round")
    eval_every: int = Field(1, ge=1, description="evaluate every this many rounds (and always the last)")
    # "all" is omitted from config.yaml and the config digest so that existing run folders stay unchanged
    eval_clients: str = Field("all", description=f"whose personalised models are evaluated: {EVAL_CLIENTS_HELP}")
    checkpoint_every: int = Field(1, ge=1, description="checkpoint every this many rounds (and always the last)")
    keep_checkpoints: int = Field(2, ge=1, description="checkpoint files kept in RUN_DIR/checkpoints")
    engine: Literal["local", "flower"] = Field("local", description="local: in-process; flower: Flower (simulation)")
    # None: defaults; omitted from config.yaml so local runs are unchanged
    flower: FlowerSettings | None = Field(None, description="Flower settings (fedmerge list flower)")
    # None: states in memory; omitted from config.yaml so that existing run folders stay unchanged
    state: StateSettings | None = Field(
        None, description="keep client states on disk with incremental checkpoints (fedmerge list state); null: in RAM"
    )
    # None: defaults; omitted from config.yaml so that existing run folders stay unchanged
    log: LogSettings | None = Field(None, description="extra outputs (fedmerge list log)")
    # None: defaults (no adaptation); omitted from config.yaml so that existing run folders stay unchanged
    unseen: UnseenSettings | None = Field(
        None, description="onboarding of the clients that never train, split.unseen_clients (fedmerge list unseen)"
    )
    # None: no differential privacy; omitted from config.yaml so that existing run folders stay unchanged
    privacy: PrivacySettings | None = Field(
        None, description="differential privacy and secure aggregation (fedmerge list privacy)"
    )
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?|mps|auto)$", description="cpu, cuda, cuda:N, mps or auto")
    output_dir: str = Field("runs", description="where run folders are created")
    eval_batch_size: int = Field(1024, ge=1, description="batch size of evaluation (memory only, not results)")
    threads: int | None = Field(
        1,
        ge=1,
        description="torch intra-op CPU threads for client and server work, the same in every engine and worker: "
        "the thread count changes the numbers (reduction order); null: the machine's default, not portable",
    )
    # "auto" is written to config.yaml as such and resolved by each process that runs or resumes the run
    workers: int | Literal["auto"] = Field(
        "auto",
        description="engine=local: processes running clients in parallel (threads=1 each), the same numbers for "
        "any count; auto: one per core available, at most the clients per round, 1 where forking cannot help "
        "(device not cpu, threads not 1, vectorize) and while a round's client work is under 0.5 s",
    )
    vectorize: bool = Field(
        False,
        description="engine=local: train the round's clients as one batched computation (vmap; for GPUs); plain "
        "local SGD methods only (fedavg, fedavg_ft, fedprox, local, fedmerge); equal to the default within float "
        "tolerance, not bit for bit",
    )
    keep_freed_memory: bool = Field(
        True,
        description="Linux (glibc): freed memory stays in the process for reuse instead of going back to the OS, "
        "so that each round's updates do not page-fault fresh memory (less system time per round); "
        "the process keeps its peak memory until it exits. Changes no number",
    )

    @field_validator("workers", mode="before")
    @classmethod
    def _valid_workers(cls, value: Any) -> int | str:
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int | str) or not str(value).isdigit() or int(value) < 1:
            raise ValueError("a number of processes (1 or more) or auto")
        return int(value)

    @field_validator("eval_clients")
    @classmethod
    def _valid_eval_clients(cls, value: str) -> str:
        parse_eval_clients(value)
        return value


class ExperimentConfig(RunSettings):
    """The static type of a validated config (what [`load_config()`][fedmerge.config.schema.load_config]
    returns): each component section typed by its base class. The schema validated at run time
    ([`experiment_model()`][fedmerge.config.schema.experiment_model]) derives from it, narrowing each component
    section to the union of the registered components' configs."""

    dataset: ComponentConfig
    partition: ComponentConfig
    split: SplitConfig = SplitConfig()
    noise: NoiseConfig = NoiseConfig()
    model: ComponentConfig
    algorithm: AlgorithmConfig


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


# (algorithm, key, what): models of which each client trains only one, so that models beyond the number of
# training clients are never trained. (FedMerge's global models and FedEM's components are all trained by
# every client: the paper's own tables run FedMerge d=5 and FedEM M=5 on 4 clients.)
ONE_MODEL_PER_CLIENT = (("ifca", "num_clusters", "cluster models"),)


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

    num_clients = getattr(cfg.partition, "num_clients", None)
    if not isinstance(num_clients, int):
        return None
    try:
        training = num_clients - unseen_count(num_clients, cfg.split.unseen_clients)
    except ValueError:  # too many unseen clients: reported where the data is built
        training = num_clients
    for name, key, what in ONE_MODEL_PER_CLIENT:
        value = getattr(cfg.algorithm, key, None)
        if cfg.algorithm.name == name and isinstance(value, int) and value > training:
            counted = "partition.num_clients" + ("" if training == num_clients else " less split.unseen_clients")
            return (
                f"algorithm.{key}={value} asks for more {what} than the {training} clients that train ({counted}); "
                f"lower algorithm.{key} to at most {training}"
            )
    return None


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


# Keys that do not change what a finished run means: a sweep or study run again with other --jobs
# (threads, workers), elsewhere or under another name reuses the run.
RUN_LOCAL_KEYS = {"threads", "workers", "output_dir", "name", "eval_batch_size", "device", "keep_freed_memory"}


def first_config_difference(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> tuple[str, Any, Any] | None:
    """(dotted key, old value, new value) of the first setting where two config dumps differ, ignoring
    `RUN_LOCAL_KEYS`; None when they describe the same run."""
    for key in sorted(set(old) | set(new)):
        if not prefix and key in RUN_LOCAL_KEYS:
            continue
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found = first_config_difference(a, b, f"{prefix}{key}.")
            if found:
                return found
        elif a != b:
            return f"{prefix}{key}", a, b
    return None


def config_warnings(cfg: ExperimentConfig) -> list[str]:
    """Valid but most likely unintended settings (one line each): each method says its own."""
    hook = getattr(cfg.algorithm, "warnings", None)  # a plugin's config may not derive from AlgorithmConfig
    return list(hook(cfg.rounds)) if callable(hook) else []


def defaults_left_out(cfg: ExperimentConfig) -> dict[str, Any]:
    """Keys added after run folders existed, left out of config.yaml (and the digest) at their default, as
    a pydantic ``exclude`` mapping (nested keys under their section)."""
    left_out: dict[str, Any] = {"eval_clients": True} if getattr(cfg, "eval_clients", "all") == "all" else {}
    left_out |= {"plugins": True} if not getattr(cfg, "plugins", ()) else {}
    left_out |= {"vectorize": True} if not getattr(cfg, "vectorize", False) else {}
    privacy = getattr(cfg, "privacy", None)
    left_out |= {"privacy": True} if privacy is None else {}
    if privacy is not None and privacy.secure_aggregation is None:  # DP run folders from before it stay unchanged
        left_out["privacy"] = {"secure_aggregation": True}
    left_out |= {"unseen": True} if getattr(cfg, "unseen", None) is None else {}
    left_out |= {"keep_freed_memory": True} if getattr(cfg, "keep_freed_memory", True) else {}
    for section, key, default in NESTED_ADDED_KEYS:
        if left_out.get(section) is True:  # the whole section is left out
            continue
        if getattr(getattr(cfg, section, None), key, default) == default:
            left_out.setdefault(section, {})[key] = True
    return left_out


# (section, key, default): options of a section added after run folders existed
NESTED_ADDED_KEYS = (
    ("dataset", "subsample_seed", 0),
    ("split", "test_per_client", None),
    ("split", "test_from", "clients"),
    ("split", "unseen_clients", 0),
    ("unseen", "also_adapt_epochs", ()),
    ("unseen", "adapt_lr", None),
)


def to_yaml(cfg: ExperimentConfig) -> str:
    exclude = {k: True for k in ("flower", "log", "state") if getattr(cfg, k, None) is None} | defaults_left_out(cfg)
    return yaml.safe_dump(cfg.model_dump(mode="json", exclude=exclude or None), sort_keys=False)
