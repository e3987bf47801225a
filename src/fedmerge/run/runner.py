"""Run an experiment end to end: plan it (``plan.py``), set up its folder and starting point (``setup.py``), then
execute it (``execute.py``: the engine and the recorded round loop)."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

from fedmerge.config.schema import ExperimentConfig, load_config
from fedmerge.config.tuned import load_tuned_config
from fedmerge.data import FederatedDataset
from fedmerge.run.execute import execute
from fedmerge.run.plan import Notify, RunSource, plan_run, refuse, silent
from fedmerge.run.recorder import RunResult, Segment
from fedmerge.run.results import CONFIG_FILE, FEDERATION_FILE, new_run_folder_problem
from fedmerge.run.resume import RESUME_OVERRIDABLE
from fedmerge.run.setup import open_run_folder, resume_point
from fedmerge.run.summary import TIMING_KEYS


def run_experiment(
    cfg: ExperimentConfig,
    run_dir: str | Path | None = None,
    *,
    resume: bool = False,
    show_progress: bool = True,
    stop_after: int | None = None,
    grid: Any = None,
    deployment: bool = False,
    pooled_test: str | None = None,
    checkpoint: str | None = None,
    notify: Notify | None = None,
    withhold_test: bool = False,
    data: FederatedDataset | None = None,
    invocation: dict[str, Any] | None = None,
) -> RunResult:
    """Run (or resume) ``cfg``. ``stop_after`` ends after that round, as a crash would (tests).

    ``withhold_test``: the test split is removed before training starts, so nothing (no metric, no
    summary, no model selection) can read it: ``fedmerge tune``'s trials.

    ``grid``: a Flower Grid, when called by a ServerApp (``engine: flower``); with ``deployment`` the
    nodes own their data and their states (docs/deployment.md): the server loads no dataset, and
    tests a global model only on ``pooled_test``, a file ``fedmerge export-clients --pooled-test`` wrote.
    ``checkpoint``: resume from this file of ``RUN_DIR/checkpoints`` instead of the one ``latest.json``
    names. ``notify``: receives one-line notices (warnings, "resuming from round N of M").
    ``data``: a dataset already built (benchmarks), used instead of loading ``cfg``'s.
    ``invocation``: what the user asked for (``command`` and details), recorded in ``provenance.jsonl``
    instead of this process's command line (a ServerApp's holds its token, which no file may hold).

    The run folder is this process's alone while it runs (``folder_lock``): from before a resume reads
    it, or from its creation, to the end; another writer is refused in one line.
    """
    source = RunSource(data, grid, deployment, pooled_test, withhold_test)
    notify = notify or silent
    segment = Segment(show_progress, stop_after, notify, round_notices=deployment, invocation=invocation)
    with ExitStack() as held:
        point = resume_point(held, run_dir, cfg, source, checkpoint, notify) if resume else None
        if point is not None and point.finished is not None:
            return RunResult(point.run_dir, point.finished, point.checkpoint.server_state)
        plan = plan_run(cfg, source, run_dir=run_dir, resume=resume, notify=notify)
        store = open_run_folder(held, plan, run_dir, resumed=resume)
        return execute(plan, store, point, segment)


def run_from_files(
    config_path: str | None,
    overrides: list[str],
    *,
    resume_dir: str | None = None,
    checkpoint: str | None = None,
    show_progress: bool = True,
    grid: Any = None,
    deployment: bool = False,
    pooled_test: str | None = None,
    notify: Notify | None = None,
    run_dir: str | None = None,
    tuned: str | None = None,
    invocation: dict[str, Any] | None = None,
) -> RunResult:
    """``run_dir``: create the run in exactly this folder (``--out``; ``fedmerge sweep``); ``tuned``: a
    ``fedmerge tune`` file whose values for the config's algorithm apply under ``overrides``."""
    refuse([arguments_problem(config_path, overrides, resume_dir, checkpoint, run_dir, tuned, deployment)])
    if resume_dir is not None:
        cfg = load_config(Path(resume_dir) / CONFIG_FILE, overrides, resolve_paths=False)  # as recorded
        where: dict[str, Any] = {"run_dir": Path(resume_dir), "resume": True, "checkpoint": checkpoint}
    else:
        cfg = load_tuned_config(config_path, overrides, tuned) if tuned else load_config(config_path, overrides)
        refuse([new_run_folder_problem(run_dir, "--out") if run_dir is not None else None])
        where = {"run_dir": run_dir}
    return run_experiment(
        cfg,
        **where,
        show_progress=show_progress,
        grid=grid,
        deployment=deployment,
        pooled_test=pooled_test,
        notify=notify,
        invocation=invocation,
    )


def arguments_problem(
    config_path: str | None,
    overrides: list[str],
    resume_dir: str | None,
    checkpoint: str | None,
    run_dir: str | None,
    tuned: str | None,
    deployment: bool,
) -> str | None:
    """Why ``run_from_files``'s arguments do not make a run or a resume (one line), or None."""
    if checkpoint is not None and resume_dir is None:
        return "--checkpoint only applies with --resume RUN_DIR"
    if resume_dir is None:
        return None
    if run_dir is not None or tuned is not None:
        return f"{'--out' if run_dir is not None else '--tuned'} does not apply with --resume"
    if not Path(resume_dir).exists():
        return f"--resume {resume_dir}: the folder does not exist"
    if not (Path(resume_dir) / CONFIG_FILE).is_file():
        return f"--resume {resume_dir}: no {CONFIG_FILE} there; is it a run folder?"
    if (problem := resume_place_problem(Path(resume_dir), deployment)) is not None:
        return problem
    bad = [o for o in overrides if o.partition("=")[0] not in RESUME_OVERRIDABLE]
    if bad or config_path is not None:
        return (
            f"cannot change {bad[0].partition('=')[0] if bad else 'the config file'} when resuming; "
            f"only {sorted(RESUME_OVERRIDABLE)} may be overridden"
        )
    return None


def resume_place_problem(run_dir: Path, deployment: bool) -> str | None:
    """A deployed run (its folder has ``federation.json``) continues only on its SuperLink, with the nodes
    that hold its clients' data and states; any other run only where it started."""
    deployed = (run_dir / FEDERATION_FILE).is_file()
    if deployed and not deployment:
        return (
            f"{run_dir} is a deployed run: its clients' data and states are on its SuperNodes. Resume it through "
            f"its SuperLink: fedmerge deploy run SUPERLINK --resume {run_dir}  (or: flwr run APP SUPERLINK "
            f"--stream --run-config 'resume=\"{run_dir}\"')"
        )
    if deployment and not deployed:
        return (
            f"{run_dir} is not a deployed run (no {FEDERATION_FILE}); continue it with: fedmerge run --resume {run_dir}"
        )
    return None


__all__ = ["RunResult", "run_experiment", "run_from_files", "TIMING_KEYS", "RESUME_OVERRIDABLE"]
