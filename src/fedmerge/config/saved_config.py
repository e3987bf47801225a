"""The config as a run folder keeps it: ``config.yaml`` (keys added after run folders existed are left out at
their default, so older folders and their config digests stay unchanged), and the comparison of two saved
configs that ignores the settings which do not change what a run means."""

from __future__ import annotations

from typing import Any

import yaml

from fedmerge.config.experiment_config import ExperimentConfig

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
