"""Find the runs under report paths and read what the report draws from them.

A path may be a sweep folder (``index.json``: methods, settings and seeds come from the sweep), a
run folder (``config.yaml``: the method is its algorithm, the setting its dataset and partition),
or any folder holding either below it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

from fedmerge.config.schema import dataset_label
from fedmerge.report.compare import DONE, INCOMPLETE, RunRecord
from fedmerge.report.plot_budget import run_setting, setting_labels
from fedmerge.report.plot_privacy import privacy_tag
from fedmerge.run.folder_lock import active_writer
from fedmerge.run.results import CONFIG_FILE, SUMMARY_FILE, RunStore
from fedmerge.run.run_records import read_summary
from fedmerge.sweep.runner import INDEX_FILE, is_sweep_dir, sweep_records


class NoRuns(ValueError):
    """A report path that holds no run (``str`` is one line)."""


def find_runs(paths: list[Path]) -> list[RunRecord]:
    records: list[RunRecord] = []
    loose: list[Path] = []
    for path in paths:
        if not path.exists():
            raise NoRuns(f"{path} does not exist")
        sweeps, runs = _walk(path)
        if not sweeps and not runs:
            raise NoRuns(f"{path} holds no runs (no run folder with {CONFIG_FILE} and no sweep with {INDEX_FILE})")
        for s in sweeps:
            records += sweep_records(s)
        loose += runs
    return mark_in_progress(records + loose_records(loose))


def mark_in_progress(records: list[RunRecord]) -> list[RunRecord]:
    """Runs that a live process is writing: incomplete, whatever their files say yet (a resumed run's
    summary is about to be rewritten), with the writer named."""
    for record in records:
        if record.run_dir is not None and (writer := active_writer(record.run_dir)) is not None:
            record.status, record.error = INCOMPLETE, f"run in progress ({writer})"
    return records


def in_progress_notes(records: list[RunRecord]) -> list[str]:
    """One line per run being written, for the terminal: the report shows what was recorded so far."""
    return [
        f"{r.run_dir}: {r.error}; the report shows the rounds recorded so far"
        for r in records
        if r.run_dir is not None and (r.error or "").startswith("run in progress")
    ]


def _walk(path: Path) -> tuple[list[Path], list[Path]]:
    """Sweep folders and run folders at or below ``path`` (not inside either)."""
    if is_sweep_dir(path):
        return [path], []
    if (path / CONFIG_FILE).is_file():
        return [], [path]
    sweeps: list[Path] = []
    runs: list[Path] = []
    if path.is_dir():
        for child in sorted(p for p in path.iterdir() if p.is_dir()):
            s, r = _walk(child)
            sweeps += s
            runs += r
    return sweeps, runs


def loose_records(run_dirs: list[Path]) -> list[RunRecord]:
    """Runs outside a sweep: method = algorithm, setting = dataset and partition (plus what differs)."""
    infos = []
    for d in run_dirs:
        config = yaml.safe_load((d / CONFIG_FILE).read_text()) or {}
        summary = read_summary(d / SUMMARY_FILE) if (d / SUMMARY_FILE).is_file() else None
        infos.append((d, config, summary, run_setting(d, summary)))
    labels = setting_labels([info[3] for info in infos])
    records = []
    for (d, config, summary, _), label in zip(infos, labels):
        dataset = dataset_label(config.get("dataset"))
        method = (config.get("algorithm") or {}).get("name", "?")
        if tag := privacy_tag(config.get("privacy")):  # runs at several privacy settings stay apart
            method = f"{method} ({tag})"
        status = DONE if summary is not None else INCOMPLETE
        records.append(RunRecord(d.name, method, f"{dataset}, {label}", int(config.get("seed", 0)), status, d, summary))
    return records


def learning_curve(run_dir: Path) -> dict[str, list[float]]:
    """Per evaluated round: mean client test accuracy; per round: train loss."""
    rows = RunStore(run_dir).read_rounds()
    evals = [(r.round, acc) for r in rows if (acc := r.mean("test_acc")) is not None]
    return {
        "eval_rounds": [rnd for rnd, _ in evals],
        "test_acc": [acc for _, acc in evals],
        "rounds": [r.round for r in rows],
        "train_loss": [r.train_loss for r in rows],
    }


def band(curves: list[tuple[list[int], list[float]]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rounds, mean and std across seeds (std over the seeds that reached each round)."""
    by_round: dict[int, list[float]] = {}
    for rounds, values in curves:
        for r, v in zip(rounds, values):
            by_round.setdefault(r, []).append(v)
    rounds = np.array(sorted(by_round))
    mean = np.array([np.mean(by_round[r]) for r in rounds])
    std = np.array([np.std(by_round[r]) for r in rounds])
    return rounds, mean, std


def client_accuracies(record: RunRecord) -> list[float]:
    """Each client's test accuracy at the run's best-validation round (else its last evaluated round)."""
    if record.run_dir is None:
        return []
    summary = record.summary
    part = summary and (summary.best_val or summary.last)
    wanted = part.round if part else None
    rows = [r for r in RunStore(record.run_dir).read_rounds() if r.eval is not None]
    chosen = next((r for r in rows if r.round == wanted), rows[-1] if rows else None)
    if chosen is None or chosen.eval is None:
        return []
    return [m["test_acc"] for m in chosen.eval.clients.values() if "test_acc" in m]
