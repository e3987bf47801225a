"""Where a config's raw values come from, before validation: YAML files (read strictly: no repeated key, no
empty file) and command-line ``key.path=value`` overrides, merged into one dict
([`fedmerge.config.schema`][fedmerge.config.schema]
validates it)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from fedmerge.algorithms import ALGORITHMS
from fedmerge.config import strict_yaml
from fedmerge.config.errors import CONFIG_FILE, ConfigError
from fedmerge.core.registry import Registry
from fedmerge.data import DATASETS, PARTITIONERS
from fedmerge.models import MODELS


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a","b","c"], yaml-parsed value)."""
    key, sep, raw = text.partition("=")
    if not sep and (text.lower().endswith((".yaml", ".yml")) or Path(text).is_file()):
        raise ConfigError(f"{text}: a config file comes first, before any key=value override")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: expected key.path=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        opened = raw.strip()[:1]
        closing = {"[": "]", "{": "}"}.get(opened)
        if closing is not None and not raw.rstrip().endswith(closing):  # a list cut short, not a name
            raise ConfigError(
                f"override {text!r}: the {opened} is never closed; end the value with {closing}"
            ) from None
        value = raw
    return key.split("."), value


# the loaders of a user's own files (data/sources/user_files.py), which infer_dataset_name picks from
USER_FILE_DATASETS = ("npz", "csv", "image_folder")


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
        elif not accepts_path and not Path(path).expanduser().exists():
            raise ConfigError(f"dataset.path: no such file or folder: {path}")
        elif not accepts_path:
            raise ConfigError(
                f"dataset.path: cannot tell the loader from {Path(path).name!r}; add dataset.name=csv (a delimited "
                "table, e.g. UCI's .data), dataset.name=npz, dataset.name=image_folder, or another loader of "
                "fedmerge list dataset"
            )
    given: dict[str, set[str]] = {}  # per section, the keys these overrides set: a later name switch keeps them
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
            _switch_component(path[0], node, value, keep=given.get(path[0], set()))
        node[path[-1]] = value
        if len(path) == 2:
            given.setdefault(path[0], set()).add(path[1])
    return data


COMPONENT_SECTIONS: dict[str, Registry] = {
    "algorithm": ALGORITHMS,
    "dataset": DATASETS,
    "partition": PARTITIONERS,
    "model": MODELS,
}


def _switch_component(section: str, node: dict[str, Any], new_name: Any, keep: set[str]) -> None:
    """On ``section.name=other``, keep only the fields the new component also accepts
    (e.g. lr and batch_size survive fedavg -> fedprox; alpha does not survive dirichlet -> iid), and the
    ``keep`` keys the user gave on the same command line, so that validation refuses a typo given
    before the name (``algorithm.num_model=3 algorithm.name=fedmerge``) instead of dropping it."""
    registry = COMPONENT_SECTIONS.get(section)
    if registry is None or not isinstance(new_name, str) or new_name not in registry:
        return  # validation reports the bad name
    accepted = registry.get(new_name).config.model_fields
    for key in [k for k in node if k not in accepted and k not in keep]:
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


def read_yaml(path: Path, what: str = "config file") -> dict[str, Any]:
    if not path.exists():
        key = re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", str(path))
        if what == "config file" and key and path.suffix.lower() not in (".yaml", ".yml"):
            # `fedmerge run rounds`: most likely an override without its value
            raise ConfigError(f"{what} {path} does not exist; if {path} is a key, give it a value: {path}=VALUE")
        raise ConfigError(f"{what} {path} does not exist")
    if path.is_dir():
        if (path / CONFIG_FILE).is_file():  # a run folder: the user most likely meant to continue it
            raise ConfigError(f"{path} is a run folder, not a config; to continue it: fedmerge run --resume {path}")
        raise ConfigError(f"{path} is a folder; expected a YAML config file")
    if infer_dataset_name(str(path)) in ("npz", "csv") and path.suffix.lower() != ".txt":
        raise ConfigError(f"{path} is a data file, not a config; to train on it: fedmerge run dataset.path={path}")
    try:
        data = strict_yaml.load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path}: not a text (YAML) file") from None
    except strict_yaml.DuplicateKey as exc:  # PyYAML would keep the last one silently
        raise ConfigError(f"{path} line {exc.line}: key {exc.key!r} is given twice; keep one") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: invalid YAML ({getattr(exc, 'problem', exc)})") from None
    if data is None:  # empty, or only comments: running the built-in default instead would be a guess
        raise ConfigError(f"{what} {path} is empty; give it at least one key, or leave it out")
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
