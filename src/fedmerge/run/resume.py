"""What a run may change when resumed, the config digest a checkpoint carries, and the checkpoint to continue from."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import BaseModel

from fedmerge.config.schema import ConfigError, defaults_left_out
from fedmerge.core.checkpoint import (
    LATEST,
    Checkpoint,
    CheckpointError,
    load_checkpoint,
    newest_checkpoint_file,
    parse_checkpoint,
)
from fedmerge.run.results import CHECKPOINT_DIR

RESUME_OVERRIDABLE = {"rounds", "device", "eval_batch_size", "workers", "state.cache_size", "keep_freed_memory"}


def config_digest(cfg: BaseModel) -> str:
    # Engine tuning (``flower``: timeouts, retries) and extra outputs (``log``) do not change the
    # numbers a run produces.
    # Nor does where client states live (``state``): a checkpoint records that itself (``client_store``).
    fixed = cfg.model_dump(
        mode="json",
        exclude=dict.fromkeys(RESUME_OVERRIDABLE | {"flower", "log", "state"}, True) | defaults_left_out(cfg),
    )
    return hashlib.sha256(repr(sorted(fixed.items())).encode()).hexdigest()


def resume_checkpoint(run_dir: Path, cfg: BaseModel, file: str | None = None) -> Checkpoint | None:
    """The checkpoint to continue from: ``file`` if given, else the one ``latest.json`` names
    (checksum verified). None when the run stopped before its first checkpoint. A folder whose
    ``latest.json`` is gone while round files remain is refused: restarting would discard them."""
    folder = run_dir / CHECKPOINT_DIR
    with_clients = getattr(cfg, "state", None) is None  # a store's states are read as clients need them
    if file is not None and not latest_names(folder, file):
        ckpt = parse_checkpoint(Path(file) if Path(file).is_file() else folder / Path(file).name, None, with_clients)
    elif (folder / LATEST).exists():
        ckpt = load_checkpoint(folder, with_clients)  # checksum verified
    else:
        newest = newest_checkpoint_file(folder)
        if newest is None:
            return None
        raise CheckpointError(
            f"{folder / LATEST} is missing but checkpoints remain (newest: {newest.name}); to continue from it: "
            f"fedmerge run --resume {run_dir} --checkpoint {newest.name}"
        )
    if ckpt.meta.get("config_digest") != config_digest(cfg) or (ckpt.client_store is None) != with_clients:
        raise ConfigError(f"{run_dir}: config.yaml no longer matches the checkpoint; refusing to resume")
    return ckpt


def latest_names(folder: Path, file: str) -> bool:
    """Whether ``latest.json`` (when readable) points at ``file``: then its checksum can be verified."""
    try:
        return json.loads((folder / LATEST).read_text()).get("file") == Path(file).name
    except (OSError, ValueError, AttributeError):
        return False
