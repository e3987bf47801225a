"""What a run may change when resumed, the config digest a checkpoint carries, and the checkpoint to continue from."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

from fedmerge.config.schema import ConfigError, ExperimentConfig, defaults_left_out, load_config, to_yaml
from fedmerge.core.checkpoint import (
    LATEST,
    Checkpoint,
    CheckpointError,
    checkpoint_files,
    load_checkpoint,
    newest_checkpoint_file,
    parse_checkpoint,
    roll_back_checkpoints,
)
from fedmerge.run.results import CHECKPOINT_DIR, CONFIG_FILE, METRICS_FILE, RunStore

# flower.ray_address: where a simulation's ClientApps run changes no number, and a cluster's head may move
RESUME_OVERRIDABLE = {
    "rounds", "device", "eval_batch_size", "workers", "state.cache_size", "keep_freed_memory", "flower.ray_address"
}  # fmt: skip


def config_digest(cfg: ExperimentConfig) -> str:
    # Engine tuning (``flower``: timeouts, retries) and extra outputs (``log``) do not change the
    # numbers a run produces.
    # Nor does where client states live (``state``): a checkpoint records that itself (``client_store``).
    fixed = cfg.model_dump(
        mode="json",
        exclude=dict.fromkeys(RESUME_OVERRIDABLE | {"flower", "log", "state"}, True) | defaults_left_out(cfg),
    )
    return hashlib.sha256(repr(sorted(fixed.items())).encode()).hexdigest()


def resume_checkpoint(run_dir: Path, cfg: ExperimentConfig, file: str | None = None) -> Checkpoint | None:
    """The checkpoint to continue from: ``file`` if given, else the one ``latest.json`` names
    (checksum verified). None when the run stopped before its first checkpoint. A folder whose
    ``latest.json`` is gone while round files remain is refused: restarting would discard them."""
    folder = run_dir / CHECKPOINT_DIR
    with_clients = cfg.state is None  # a store's states are read as clients need them
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
    if not continues(ckpt, cfg):
        raise ConfigError(f"{run_dir}: config.yaml no longer matches the checkpoint; refusing to resume")
    return ckpt


def continues(ckpt: Checkpoint, cfg: ExperimentConfig) -> bool:
    """Whether ``ckpt`` was made by ``cfg``'s run, with client states where ``cfg`` keeps them."""
    with_clients = cfg.state is None
    return ckpt.meta.get("config_digest") == config_digest(cfg) and (ckpt.client_store is None) == with_clients


def roll_back_to_records(
    run_dir: Path, cfg: ExperimentConfig, ckpt: Checkpoint | None, recorded: int
) -> tuple[Checkpoint | None, str | None]:
    """The checkpoint to continue from so that no round's record is lost, and a one-line notice when that
    meant rolling back. ``recorded``: rounds 1..recorded have whole rows in ``metrics.jsonl``. A checkpoint
    past them (its rows cut by a crash or a copy) would leave those rounds without a record forever; the
    newest checkpoint within them is taken instead (none: the run starts over), and the rounds after it are
    made again, bit-identical. The checkpoint files past it are deleted and ``latest.json`` names it."""
    start = ckpt.round if ckpt is not None else 0
    if start <= recorded:
        return ckpt, None
    folder = run_dir / CHECKPOINT_DIR
    with_clients = cfg.state is None
    older = None
    for rnd, path in reversed(checkpoint_files(folder).items()):
        if rnd > recorded:
            continue
        try:
            candidate = parse_checkpoint(path, None, with_clients)  # written whole (write-then-rename)
        except CheckpointError:
            continue
        if continues(candidate, cfg):
            older = candidate
            break
    back_to = older.round if older is not None else 0
    roll_back_checkpoints(folder, back_to)
    where = f"the checkpoint of round {back_to}" if older is not None else "the start (no checkpoint before it)"
    again = f"round {start} is" if back_to + 1 == start else f"rounds {back_to + 1}-{start} are"
    return older, (
        f"{run_dir / METRICS_FILE}: the record of round {recorded + 1} is cut or missing; rolled back to {where}, "
        f"{again} made again"
    )


def planned_rounds(run_dir: Path) -> int:
    """The ``rounds`` of the run's ``config.yaml`` (0 when it cannot be read: the resume refuses it later)."""
    try:
        rounds = yaml.safe_load((run_dir / CONFIG_FILE).read_text()).get("rounds", 0)
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return 0
    return rounds if isinstance(rounds, int) else 0


def check_not_shortened(run_dir: Path, cfg: ExperimentConfig, ckpt: Checkpoint | None) -> None:
    """A resume adds rounds, never takes any away: ``rounds`` below those the run was started (or last
    extended) with, or below those it has made, is refused."""
    has = max(planned_rounds(run_dir), ckpt.round if ckpt is not None else 0, RunStore(run_dir).recorded_rounds())
    if cfg.rounds < has:
        raise ConfigError(
            f"--resume {run_dir} rounds={cfg.rounds}: the run has {has} rounds; a resume can add rounds, never "
            "take them away"
        )


def finished_summary(run_dir: Path, cfg: ExperimentConfig, ckpt: Checkpoint | None) -> dict[str, Any] | None:
    """The run's summary when it has already made every round ``cfg`` asks for and written it (resuming
    it changes nothing); None when there is something left to do."""
    store = RunStore(run_dir)
    summary = store.read_summary()
    if ckpt is None or summary is None or ckpt.round < cfg.rounds or store.recorded_rounds() < ckpt.round:
        return None
    return summary.to_dict()


def keep_rounds_in_config(store: RunStore, rounds: int) -> None:
    """Write ``rounds`` into the run's ``config.yaml`` when a resume extends the run, so that the file
    describes the run (and a later plain ``--resume`` continues to the new end)."""
    if planned_rounds(store.dir) == rounds:
        return
    saved = load_config(store.read_config_path())
    store.write_config(to_yaml(saved.model_copy(update={"rounds": rounds})))


def latest_names(folder: Path, file: str) -> bool:
    """Whether ``latest.json`` (when readable) points at ``file``: then its checksum can be verified."""
    try:
        return json.loads((folder / LATEST).read_text()).get("file") == Path(file).name
    except (OSError, ValueError, AttributeError):
        return False
