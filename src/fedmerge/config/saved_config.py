"""The config as a run folder keeps it: ``config.yaml`` (keys added after run folders existed are left out at
their default, so older folders and their config digests stay unchanged), and the comparison of two saved
configs that ignores the settings which do not change what a run means."""

from __future__ import annotations

from typing import Any

import yaml

from fedmerge.config.experiment_config import ExperimentConfig
from fedmerge.data.pool import DatasetConfig

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


def defaults_left_out(cfg: ExperimentConfig) -> dict[str, Any]:
    """Keys added after run folders existed, left out of config.yaml (and the digest) at their default, as
    a pydantic ``exclude`` mapping (nested keys under their section)."""
    left_out: dict[str, Any] = {}
    if cfg.eval_clients == "all":
        left_out["eval_clients"] = True
    if not cfg.plugins:
        left_out["plugins"] = True
    if not cfg.vectorize:
        left_out["vectorize"] = True
    if cfg.privacy is None:
        left_out["privacy"] = True
    elif cfg.privacy.secure_aggregation is None:  # DP run folders from before it stay unchanged
        left_out["privacy"] = {"secure_aggregation": True}
    if cfg.unseen is None:
        left_out["unseen"] = True
    if cfg.keep_freed_memory:
        left_out["keep_freed_memory"] = True
    # options of a section added after run folders existed, left out at their default
    dataset = cfg.dataset  # a plugin's dataset config that is no DatasetConfig has no subsample_seed
    nested = {
        "dataset": {"subsample_seed": not isinstance(dataset, DatasetConfig) or dataset.subsample_seed == 0},
        "split": {
            "test_per_client": cfg.split.test_per_client is None,
            "test_from": cfg.split.test_from == "clients",
            "unseen_clients": cfg.split.unseen_clients == 0,
        },
        "unseen": {}
        if cfg.unseen is None  # the whole section is left out
        else {"also_adapt_epochs": cfg.unseen.also_adapt_epochs == (), "adapt_lr": cfg.unseen.adapt_lr is None},
    }
    for section, keys in nested.items():
        for key, at_default in keys.items():
            if at_default:
                left_out.setdefault(section, {})[key] = True
    return left_out


def to_yaml(cfg: ExperimentConfig) -> str:
    unset = {"flower": cfg.flower is None, "log": cfg.log is None, "state": cfg.state is None}
    exclude = {k: True for k, none in unset.items() if none} | defaults_left_out(cfg)
    return yaml.safe_dump(cfg.model_dump(mode="json", exclude=exclude or None), sort_keys=False)
