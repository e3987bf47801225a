"""A run's folder and starting point: a new run (folder, lock, config.yaml, a fresh server state) or a resume
(lock, the checkpoint to continue from, its states restored into the engine)."""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedmerge.config.schema import ExperimentConfig, to_yaml
from fedmerge.core.checkpoint import Checkpoint, atomic_write_bytes
from fedmerge.core.loop import Engine
from fedmerge.core.state_store import StateStore
from fedmerge.core.types import ServerState
from fedmerge.run.engine_setup import federation_summary
from fedmerge.run.folder_lock import writing_run_folder
from fedmerge.run.plan import Notify, RunPlan, RunSource, refuse
from fedmerge.run.results import FEDERATION_FILE, RunStore, check_new_run_folder, new_run_dir
from fedmerge.run.resume import (
    check_not_shortened,
    finished_summary,
    keep_rounds_in_config,
    resume_checkpoint,
    roll_back_to_records,
)


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run continues: its checkpoint (None: it stopped before the first one), and the summary of
    a run that has already made every round asked for (then nothing is to be done)."""

    run_dir: Path
    checkpoint: Checkpoint | None
    finished: dict[str, Any] | None = None


@dataclass(frozen=True)
class Start:
    """The first round of this process's segment and the server state it starts from."""

    state: ServerState
    round: int  # the rounds before it are done (0: a new run)
    resumed: bool
    earlier_seconds: float  # wall time of a resumed run's earlier segments (elapsed_seconds is cumulative)


def secure_resume_problem(cfg: ExperimentConfig, source: RunSource, run_dir: str | Path) -> str | None:
    """A Flower simulation under secure aggregation keeps its client states from the checkpoints."""
    if cfg.engine == "flower" and not source.deployment and cfg.privacy is not None:
        if cfg.privacy.secure_aggregation is not None:
            return (
                f"{run_dir}: a Flower simulation under privacy.secure_aggregation cannot resume: its clients' states "
                "stayed in the simulation's memory, which secure aggregation keeps from the server's checkpoints "
                "(a deployment keeps them on the nodes' disks and resumes); start it again"
            )
    return None


def resume_point(
    held: ExitStack,
    run_dir: str | Path | None,
    cfg: ExperimentConfig,
    source: RunSource,
    checkpoint: str | None,
    notify: Notify,
) -> ResumePoint:
    """Take ``run_dir``'s lock (on ``held``) before anything that another writer could change, then find the
    checkpoint to continue from: ``checkpoint`` (a file of ``RUN_DIR/checkpoints``) or the one ``latest.json``
    names, rolled back to the rounds ``metrics.jsonl`` records whole. Refused in one line when the config no
    longer matches it or would take rounds away."""
    if run_dir is None:
        raise ValueError("resume=True needs the run folder")
    refuse([secure_resume_problem(cfg, source, run_dir)])
    folder = Path(run_dir)
    held.enter_context(writing_run_folder(folder))
    ckpt = resume_checkpoint(folder, cfg, checkpoint)
    check_not_shortened(folder, cfg, ckpt)
    ckpt, rolled_back = roll_back_to_records(folder, cfg, ckpt, RunStore(folder).recorded_rounds())
    if rolled_back is not None:
        notify(rolled_back)
    elif checkpoint is None and (summary := finished_summary(folder, cfg, ckpt)) is not None:
        notify(
            f"{run_dir} already finished its {cfg.rounds} rounds; nothing changed (to add rounds: rounds=N; "
            "to make rounds again: --checkpoint FILE)"
        )
        return ResumePoint(folder, ckpt, summary)
    return ResumePoint(folder, ckpt)


def open_run_folder(held: ExitStack, plan: RunPlan, run_dir: str | Path | None, resumed: bool) -> RunStore:
    """The run's folder, this process's alone: a new run's is created (``run_dir``, or a fresh one under
    ``output_dir``) and locked on ``held``; a resumed run's (already locked) records the rounds it now has.
    A deployment's folder receives what its nodes said about their data (``federation.json``)."""
    cfg = plan.cfg
    store = RunStore(run_dir if run_dir is not None else new_run_dir(cfg.output_dir, cfg.name))
    if not resumed:
        held.enter_context(writing_run_folder(store.dir))
        check_new_run_folder(store.dir)  # a writer that got here first
    else:
        keep_rounds_in_config(store, cfg.rounds)  # an extended run's config.yaml says how long it is
    if plan.federation is not None:
        summary = json.dumps(federation_summary(plan.federation), indent=1) + "\n"
        atomic_write_bytes(store.dir / FEDERATION_FILE, summary.encode())
    return store


def start_segment(
    plan: RunPlan,
    store: RunStore,
    engine: Engine,
    client_store: StateStore | None,
    point: ResumePoint | None,
    notify: Notify,
) -> Start:
    """A new run writes its ``config.yaml`` and starts from the method's initial state. A resumed run restores
    its checkpoint into the engine, forgets what came after it (metrics rows, stored client states: those
    rounds are made again, bit-identical) and says where it continues."""
    cfg, device = plan.cfg, plan.device
    if point is None:
        store.write_config(to_yaml(cfg))
        return Start(plan.algorithm.init_server_state().to(device), 0, False, 0.0)
    # elapsed_seconds is cumulative: the rows written (kept or about to be replayed) and the summary of a
    # finished run hold the time every earlier segment ran, so wall_seconds only grows
    earlier_seconds = store.time_spent()
    ckpt, start_round = point.checkpoint, 0
    if ckpt is not None:
        state = ckpt.server_state.to(device)
        engine.restore(ckpt.meta)  # deployment: the rounds of the states the nodes keep
        start_round = ckpt.round
        if client_store is None:
            engine.load_client_states(ckpt.client_states)
    else:
        state = plan.algorithm.init_server_state().to(device)
    if client_store is not None:  # states of rounds after the checkpoint are redone
        client_store.rewind(start_round)
    store.truncate_metrics(start_round)
    notify(f"resuming from round {start_round} of {cfg.rounds}")
    return Start(state, start_round, True, earlier_seconds)
