"""The reproduction protocol, the same for every row of a study:

1. Tuning: every grid point of every row runs on the tuning seed; the point with the best mean client
   *validation* score (at the best-validation-loss round) is chosen, or with ``select: val_loss`` the one
   whose best round has the lowest mean client validation loss. Every row has the same number of
   points (the equal budget; ``fedmerge.study.spec``).
2. The chosen point runs on every seed; rows report mean +- std over seeds at the best-validation round
   (the papers' model selection) and at the last round.
3. The regime check: a central reference per seed (``fedmerge.study.regime``) against the tuned Local
   and FedAvg rows, on the validation split. ``regime: {scope, max_epochs, lrs}`` sets how the
   reference trains: at most ``max_epochs`` epochs, at the learning rates ``lrs`` (default: the Local
   row's grid), chosen by validation loss, on the base config's ``device``. A causal LM's reference is
   scored by ROUGE-1 of its generated answers, as its rows are. A stored reference from before validation
   scores were kept is computed again when the study runs (kept as ``regime-seedN.test-only.json``); with
   ``--report-only`` it is read as it is, and the report says its check read the test split.

Each run is one ``fedmerge run`` process (``fedmerge.sweep.launch``), in a folder of its own named by
the row, grid point and seed (``RUNS/KEY/RUN``): finished runs are skipped, unfinished ones resumed, so
a study can be run again at will. A run folder whose config is not what the study now asks for (a
grid, override or base config changed since it ran) is refused with the first difference, rather than
reused under its old name. A revision first copies the finished runs of the earlier revisions that it
asks for unchanged (same row, grid point, seed and config), and their central references when it
trains the reference in the same way. ``--reuse DIR`` does the same from another study's run folders:
a run is copied when its config is exactly the one this study asks for, a central reference when it
records the same reference settings (the digest of its config, learning rates and regime options).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedmerge.config.schema import ConfigError, load_config
from fedmerge.run.data_plan import plan_data
from fedmerge.run.provenance import source_commit
from fedmerge.run.results import DONE, SUMMARY_FILE
from fedmerge.run.run_records import RoundRecord, RunSummary, Stats, as_summary, read_summary
from fedmerge.study.regime import TEST, central_reference, reference_split
from fedmerge.study.spec import LATEST, Study, StudyFile, run_key, run_overrides, runs_dir
from fedmerge.sweep.clusters import LaunchOptions, make_launcher
from fedmerge.sweep.launch import Outcome, RunJob, config_difference, finished_run, started_run

Notify = Callable[[str], None]
STATUS_FILE = "status.jsonl"  # one line per attempt, as in a sweep folder
LOGS_DIR = "logs"  # RUNS/logs/KEY.log: what each attempt printed
SLURM_DIR = "slurm"  # RUNS/slurm/JOBID/: submitit's files of each SLURM job (--launcher slurm)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- run folders -------------------------------------------------------------------------------


def run_folder(runs: Path, key: str) -> Path | None:
    """The run of ``key`` (its newest attempt's folder), or None before it started."""
    return started_run(runs / key)


def finished(folder: Path | None) -> bool:
    return folder is not None and (folder / "summary.json").exists()


def summary_of(runs: Path, key: str) -> RunSummary | None:
    folder = finished_run(runs / key)
    return read_summary(folder / SUMMARY_FILE) if folder is not None else None


def stale(folder: Path, study: Study, key: str, overrides: list[str]) -> str | None:
    """Why the run in ``folder`` is not the one the study asks for now (its grid, overrides or base
    config changed since it ran), or None."""
    want = load_config(study.base, [*overrides, f"name={key}"]).model_dump(mode="json")
    try:
        diff = config_difference(folder, want)
    except ConfigError as exc:
        return f"its config.yaml no longer loads ({exc})"
    return None if diff is None else f"{diff[0]}: study {diff[2]!r}, run {diff[1]!r}"


# --- running -----------------------------------------------------------------------------------


def progress_line(i: int, n: int, t0: float, what: str) -> str:
    """ "[i/n] what  (eta M min)", the eta from the mean time of the ``i`` items done since ``t0``."""
    eta = (time.time() - t0) / i * (n - i)
    return f"[{i}/{n}] {what}  (eta {eta / 60:.0f} min)"


def launch_options(workers: int | LaunchOptions) -> LaunchOptions:
    return workers if isinstance(workers, LaunchOptions) else LaunchOptions(jobs=workers)


def run_all(
    jobs: list[tuple[str, list[str]]],
    study: Study,
    runs: Path,
    workers: int | LaunchOptions,
    notify: Notify = _stderr,
) -> list[Outcome]:
    """Bring every (key, overrides) run to its end, ``workers`` processes at a time, each on its share of the
    cores ([`Launcher`][fedmerge.sweep.launch.Launcher]), or where the launch options say
    ([`fedmerge.sweep.clusters`][fedmerge.sweep.clusters]: one Ray task or SLURM array task per run).
    A failed run is recorded (RUNS/logs/KEY.log, RUNS/status.jsonl) and the others go on."""
    todo = []
    for key, overrides in jobs:
        folder = run_folder(runs, key)
        why = stale(folder, study, key, overrides) if folder is not None else None
        if why:
            raise ConfigError(f"{folder} was made with other settings ({why}); delete it, or restore the study file")
        if not finished(folder):
            todo.append(
                RunJob(
                    key,
                    (study.base, *overrides, f"name={key}", "--output-dir", str(runs / key)),
                    runs / key,
                    runs / LOGS_DIR / f"{key}.log",
                )
            )
    if not todo:
        return []
    t0 = time.time()
    notify(f"{len(todo)} runs to do ({len(jobs) - len(todo)} done)")
    shown = 0

    def report(outcomes: list[Outcome]) -> None:
        nonlocal shown
        for i, o in enumerate(outcomes[shown:], shown + 1):
            what = "ok" if o.status == DONE else f"{o.status.upper()}: {o.error}"
            notify(progress_line(i, len(todo), t0, f"{o.key}: {what}"))
        shown = len(outcomes)

    launcher = make_launcher(launch_options(workers), status_file=runs / STATUS_FILE, work_dir=runs / SLURM_DIR)
    return launcher.run(todo, report)


def tune(study: Study, runs: Path, workers: int | LaunchOptions, notify: Notify = _stderr) -> dict[str, int]:
    seed = study.tuning_seed
    jobs = [
        (run_key(m.label, i, seed), run_overrides(m, point, seed))
        for m in study.methods
        for i, point in enumerate(m.points())
    ]
    run_all(jobs, study, runs, workers, notify)
    return choose(study, runs)


def choose(study: Study, runs: Path) -> dict[str, int]:
    """Per row, the grid point with the best validation score on the tuning seed (the first on a tie)."""
    seed = study.tuning_seed
    chosen = {}
    for m in study.methods:
        scores = [val_score(summary_of(runs, run_key(m.label, i, seed)), study) for i in range(len(m.points()))]
        chosen[m.label] = max(range(len(scores)), key=lambda i: scores[i])
    return chosen


def run_seeds(
    study: Study, runs: Path, chosen: dict[str, int], workers: int | LaunchOptions, notify: Notify = _stderr
) -> None:
    jobs = []
    for m in study.methods:
        i = chosen[m.label]
        for seed in study.seeds:
            jobs.append((run_key(m.label, i, seed), run_overrides(m, m.points()[i], seed)))
    run_all(jobs, study, runs, workers, notify)


def reference_settings(study: Study) -> tuple:
    """What the central reference depends on: two studies that agree share it."""
    return study.base, study.reference_lrs(), study.regime.model_dump(exclude={"lrs"})


def reference_digest(study: Study, seed: int) -> str:
    """What one seed's central reference depends on, by content rather than file name: its config, its
    learning rates and the regime options. Two studies whose digests agree may share the reference."""
    cfg = load_config(study.base, [*study.regime.overrides, f"seed={seed}"]).model_dump(mode="json")
    cfg.pop("name", None)
    what = [cfg, study.reference_lrs(), study.regime.model_dump(mode="json", exclude={"lrs"})]
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def regime(study: Study, runs: Path, report_only: bool = False, notify: Notify = _stderr) -> dict[int, dict[str, Any]]:
    """The central reference of every seed, computed once (RUNS/regime-seedN.json) and then read. One
    stored without validation accuracies is computed again unless ``report_only`` (the old file is kept
    next to it as ``regime-seedN.test-only.json``)."""
    out = {}
    opts = study.regime
    for seed in study.seeds:
        file = runs / f"regime-seed{seed}.json"
        if file.exists() and not report_only and reference_split(json.loads(file.read_text())) == TEST:
            file.replace(file.with_name(f"regime-seed{seed}.test-only.json"))
    todo = [seed for seed in study.seeds if not (runs / f"regime-seed{seed}.json").exists()]
    if todo:  # one model per unit and lr, trained in this process: minutes per seed with nothing else to show
        lrs = study.reference_lrs()
        tried = f"lr {', '.join(map(str, lrs))}" if lrs else "the base's lr"
        notify(f"{len(todo)} central references to compute ({tried}, up to {opts.max_epochs} epochs each)")
    t0 = time.time()
    for seed in study.seeds:
        file = runs / f"regime-seed{seed}.json"
        if not file.exists():
            cfg = load_config(study.base, [*opts.overrides, f"seed={seed}"])
            # the runs' clients, on the device they train on (a paper study's GPU; refused now if absent)
            planned = plan_data(cfg)
            ref = central_reference(
                planned.data,
                cfg.model,
                cfg.algorithm,
                seed,
                scope=opts.scope,
                max_epochs=opts.max_epochs,
                lrs=study.reference_lrs(),
                device=planned.device,
            )
            runs.mkdir(parents=True, exist_ok=True)
            commit, dirty = source_commit()
            settings = reference_digest(study, seed)
            file.write_text(json.dumps({**ref.to_json(), "settings": settings, "commit": commit, "dirty": dirty}))
            notify(progress_line(todo.index(seed) + 1, len(todo), t0, f"central reference, seed {seed}: done"))
        out[seed] = json.loads(file.read_text())
    return out


def copy_matching_runs(study: Study, runs: Path, other: Path) -> int:
    """Copy into ``runs`` each finished run in ``other`` that is exactly a run this study asks for: same
    row, grid point and seed, and a config that passes the staleness check. Returns how many were
    copied; each keeps its own provenance (command, commit)."""
    copied = 0
    for method in study.methods:
        for gi, point in enumerate(method.points()):
            for seed in study.seeds:
                key = run_key(method.label, gi, seed)
                src = run_folder(other, key)
                if run_folder(runs, key) is not None or not finished(src):
                    continue
                if stale(src, study, key, run_overrides(method, point, seed)) is None:
                    shutil.copytree(other / key, runs / key, symlinks=True)
                    copied += 1
    return copied


def share_runs(study: Study, runs: Path, old_study: Study, old_runs: Path) -> int:
    """Copy into ``runs`` the finished runs of an earlier revision (in ``old_runs``) that are exactly runs
    this one asks for, and its central references when the reference is trained in the same way. Returns
    the number of run folders copied."""
    copied = copy_matching_runs(study, runs, old_runs)
    if reference_settings(study) == reference_settings(old_study):
        for seed in study.seeds:
            ref = old_runs / f"regime-seed{seed}.json"
            if ref.exists() and not (runs / ref.name).exists():
                runs.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ref, runs / ref.name)
    return copied


def reuse_runs(study: Study, runs: Path, other: Path) -> tuple[int, int]:
    """Copy into ``runs`` what another study's run folders (``other``) already hold of this one: its
    matching runs ([`copy_matching_runs()`][fedmerge.study.protocol.copy_matching_runs]) and each central reference
    whose recorded settings digest
    is this study's. Returns (runs copied, references copied)."""
    copied = copy_matching_runs(study, runs, other)
    references = 0
    for seed in study.seeds:
        src, dest = other / f"regime-seed{seed}.json", runs / f"regime-seed{seed}.json"
        if src.exists() and not dest.exists():
            if json.loads(src.read_text()).get("settings") == reference_digest(study, seed):
                runs.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest)
                references += 1
    return copied, references


# --- scores ------------------------------------------------------------------------------------


def score_on_test(study: Study, summary: RunSummary | Mapping[str, Any], when: str = "best_val") -> float:
    """The table's metric on the test split; a method without a server model (Local) falls back to
    the mean over its clients when the metric is the server's."""
    selection = as_summary(summary).selection(when)
    if selection is None:
        raise ConfigError(f"the run's summary has no {when} round (no evaluation?)")
    part = selection.part(study.metric.part)
    if part is None and study.metric.adapt_epochs is not None and selection.unseen:
        raise ConfigError(
            f"metric.adapt_epochs {study.metric.adapt_epochs}: these runs onboarded no newcomer at that budget "
            "(unseen.also_adapt_epochs)"
        )
    if part is None and study.metric.scope == "unseen":
        raise ConfigError("metric.scope unseen: these runs have no clients that never trained (split.unseen_clients)")
    part = part or selection.clients
    value = part.get(f"test_{study.metric.name}", float("nan"))
    return value.mean if isinstance(value, Stats) else value


def client_scores(runs: Path, key: str, study: Study, when: str = "best_val") -> dict[str, tuple[float, int]] | None:
    """Each client's test metric and test size at the round the summary reports under ``when`` (from the
    run's metrics.jsonl), by client id; None where the run folder holds no per-client metrics. With
    ``metric.scope: unseen`` the clients are the newcomers (``eval_unseen``, or ``eval_unseen_adaptN`` at a
    further budget), else the participants."""
    folder = finished_run(runs / key)
    if folder is None or not (folder / "metrics.jsonl").exists():
        return None
    selection = read_summary(folder / SUMMARY_FILE).selection(when)
    at = selection.round if selection is not None else None
    name = f"test_{study.metric.name}"
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        row = RoundRecord.from_json(line)
        evaluation = row.evaluation("eval_" + study.metric.part if study.metric.scope == "unseen" else "eval")
        if row.round == at and evaluation is not None:
            clients = evaluation.clients or {}
            return {
                cid: (float(m[name]), int(m.get("test_n", 0)))
                for cid, m in clients.items()
                if name in m and m.get("test_n", 0) > 0
            }
    return None


def extra_score(summary: RunSummary, column: str) -> float:
    best = as_summary(summary).best_val
    if best is None or column not in best.clients:
        raise ConfigError(f"columns: {column} is not in the run's best_val figures")
    return best.clients[column].mean


def val_score(summary: RunSummary | Mapping[str, Any] | None, study: Study) -> float:
    """What tuning maximises; it always reads the clients' validation split (the test split is withheld):
    their mean validation metric at the best-validation round, or (``select: val_loss``) minus their
    mean validation loss there."""
    if not summary:
        return float("-inf")
    best = as_summary(summary).best_val
    if best is None:
        raise ConfigError("the run's summary has no best_val round (no validation split?)")
    if study.select == "val_loss":
        return -best.val_nll
    return best.clients[f"val_{study.metric.name}"].mean


# --- a whole study -----------------------------------------------------------------------------


@dataclass
class Conducted:
    """A study revision brought as far as its run folders allow: what its report is made from."""

    study: Study
    history: list[Study]  # every revision up to this one, oldest first
    runs: Path
    chosen: dict[str, int]
    reference: dict[int, dict[str, Any]]
    study_path: Path | None = None  # the study file: where its claims' declarations are looked up (git)


def regime_only(study: Study) -> Study:
    """Only the Local and FedAvg rows: check the regime before the table."""
    keep = {study.local_row, study.fedavg_row}
    return study.model_copy(
        update={
            "methods": [m for m in study.methods if m.label in keep],
            "title": study.title + " (regime check only)",
        }
    )


def conduct(
    spec: StudyFile,
    study_path: Path,
    revision: str | None = LATEST,
    runs: Path | None = None,
    jobs: int | LaunchOptions = 2,
    report_only: bool = False,
    only_regime: bool = False,
    notify: Notify = _stderr,
    reuse: tuple[Path, ...] = (),
) -> Conducted:
    """Tune, run the seeds and compute the references of one revision (``report_only``: read what exists).

    ``runs``: the first revision's run folders (default ``runs/repro/STUDY_NAME``); a revision's are
    ``RUNS_REVISION`` next to it."""
    history = spec.history(revision)
    study = history[-1]
    if only_regime:
        history = [regime_only(s) for s in history]
        study = history[-1]
    folder = runs_dir(study_path, study.revision, runs)
    notify(f"{study_path}, revision {study.revision or 'first'}: runs in {folder}")
    if not report_only:
        for earlier in reversed(history[:-1]):  # the newest copy of a run first
            old = runs_dir(study_path, earlier.revision, runs)
            if old.is_dir():
                n = share_runs(study, folder, earlier, old)
                if n:
                    notify(f"{n} finished runs copied from {old}")
        for other in reuse:
            if not other.is_dir():
                raise ConfigError(f"--reuse {other}: no such folder")
            n, refs = reuse_runs(study, folder, other)
            notify(f"--reuse {other}: {n} finished runs and {refs} central references copied")
    if report_only:
        chosen = choose(study, folder)
    else:
        chosen = tune(study, folder, jobs, notify)
        run_seeds(study, folder, chosen, jobs, notify)
    return Conducted(study, history, folder, chosen, regime(study, folder, report_only, notify), study_path)
