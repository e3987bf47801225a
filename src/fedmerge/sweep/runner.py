"""``fedmerge sweep``: run every point of a grid in parallel worker processes, resumably.

SWEEP_DIR/sweep.yaml      the sweep (base config, fixed overrides, grid, methods, tuned file)
SWEEP_DIR/index.json      every point: its folder key, method, setting, seed and overrides
SWEEP_DIR/runs/KEY/       one ordinary run folder per point (config.yaml, metrics.jsonl, provenance.jsonl, ...)
SWEEP_DIR/logs/KEY.log    what each attempt of that run printed
SWEEP_DIR/status.jsonl    one line per finished attempt: done, failed (with its error line) or interrupted
SWEEP_DIR/results.md|csv  the comparison tables (``fedmerge.report.compare``)

Each run is one ``fedmerge run ... --out SWEEP_DIR/runs/KEY`` process, so its provenance holds
a command that reproduces it alone. Running the sweep again skips finished runs, continues
stopped ones from their checkpoints (``fedmerge run --resume``) and retries failed ones. Each run
gets ``cores // jobs`` cores, which its ``workers: auto`` uses for worker processes of one thread each,
so a sweep's run gives the numbers of the same ``fedmerge run`` alone. The processes are started by
``fedmerge.sweep.launch``, which studies share.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from fedmerge.config.schema import ConfigError, first_config_difference, make_folder
from fedmerge.core.checkpoint import atomic_write_bytes
from fedmerge.run.results import CONFIG_FILE, DONE, FAILED, INCOMPLETE, METRICS_FILE, PENDING, SUMMARY_FILE, RunRecord
from fedmerge.run.run_records import read_summary
from fedmerge.sweep.clusters import LaunchOptions, make_launcher
from fedmerge.sweep.launch import INTERRUPTED, Outcome, RunJob, config_difference, cores
from fedmerge.sweep.spec import SweepPoint, SweepSpec, expand

__all__ = ["INTERRUPTED", "Outcome", "SweepRunner", "cores", "prepare", "sweep_records"]

SPEC_FILE = "sweep.yaml"
INDEX_FILE = "index.json"
STATUS_FILE = "status.jsonl"
RUNS_DIR = "runs"
LOGS_DIR = "logs"
SLURM_DIR = "slurm"  # submitit's files of each SLURM job (--launcher slurm)

Notify = Callable[[str], None]


def is_sweep_dir(path: str | Path) -> bool:
    return (Path(path) / INDEX_FILE).is_file()


def default_sweep_dir(spec: SweepSpec, points: list[SweepPoint]) -> Path:
    """``OUTPUT_DIR/sweeps/NAME``: the same command finds (and resumes) the same folder."""
    return Path(points[0].config.output_dir) / "sweeps" / spec.default_name()


def load_spec(sweep_dir: str | Path) -> SweepSpec:
    path = Path(sweep_dir) / SPEC_FILE
    if not path.is_file():
        raise ConfigError(f"{sweep_dir}: no {SPEC_FILE}; is it a sweep folder?")
    data = yaml.safe_load(path.read_text())
    return SweepSpec(
        data.get("config"),
        tuple(data.get("overrides") or ()),
        data.get("grid") or {},
        data.get("methods") or {},
        data.get("tuned"),
        data.get("name"),
    )


def prepare(spec: SweepSpec, sweep_dir: Path) -> list[SweepPoint]:
    """Validate every point, check that runs already in ``sweep_dir`` were made with the same
    configs, and write the sweep and its index. Nothing runs before this has passed."""
    points = expand(spec)
    for p in points:
        _check_same_config(sweep_dir / RUNS_DIR / p.key, p)
    make_folder(sweep_dir, "sweep folder (--out, or output_dir)")
    stored = spec.to_json()
    for key in ("config", "tuned"):  # absolute: the sweep resumes from any working folder
        if stored[key]:
            stored[key] = str(Path(stored[key]).resolve())
    atomic_write_bytes(sweep_dir / SPEC_FILE, yaml.safe_dump(stored, sort_keys=False).encode())
    index = json.dumps([p.to_json() for p in points], indent=1)
    atomic_write_bytes(sweep_dir / INDEX_FILE, index.encode())
    return points


def _check_same_config(run_dir: Path, point: SweepPoint) -> None:
    if not (run_dir / CONFIG_FILE).is_file():
        return
    new = point.config.model_dump(mode="json")
    try:
        diff = config_difference(run_dir, new)
    except ConfigError:  # a config.yaml that no longer loads differs from the first key on
        diff = first_config_difference({}, new)
    if diff is not None:
        key, was, now = diff
        raise ConfigError(
            f"{run_dir} was made with {key}={was!r}, this sweep has {key}={now!r}; "
            "use another --out folder or delete that run folder"
        )


# --- running -----------------------------------------------------------------------------------


def run_args(spec: SweepSpec, point: SweepPoint, run_dir: Path) -> list[str]:
    """The ``fedmerge run`` arguments that start one point afresh."""
    args = [*([spec.config] if spec.config else []), *point.overrides]
    if spec.tuned:
        args += ["--tuned", spec.tuned]
    return [*args, "--out", str(run_dir)]


def run_command(spec: SweepSpec, point: SweepPoint, run_dir: Path) -> list[str]:
    """The ``fedmerge run`` process of one point: a new run, or the continuation of a stopped one."""
    return RunJob(point.key, tuple(run_args(spec, point, run_dir)), run_dir, Path(os.devnull)).command()


class SweepRunner:
    """Runs the points of a prepared sweep, ``jobs`` at a time, and records each attempt
    ([`Launcher`][fedmerge.sweep.launch.Launcher])."""

    def __init__(self, spec: SweepSpec, sweep_dir: Path, points: list[SweepPoint], jobs: int | LaunchOptions) -> None:
        self.spec, self.dir, self.points = spec, sweep_dir, points
        options = jobs if isinstance(jobs, LaunchOptions) else LaunchOptions(jobs=jobs)
        self.launcher = make_launcher(options, status_file=sweep_dir / STATUS_FILE, work_dir=sweep_dir / SLURM_DIR)
        self.jobs, self.cores_each = self.launcher.jobs, self.launcher.cores_each

    @property
    def running(self) -> set[str]:
        return self.launcher.running

    def run_dir(self, point: SweepPoint) -> Path:
        return self.dir / RUNS_DIR / point.key

    def todo(self) -> list[SweepPoint]:
        return [p for p in self.points if not (self.run_dir(p) / SUMMARY_FILE).is_file()]

    def job(self, point: SweepPoint) -> RunJob:
        run_dir = self.run_dir(point)
        args = run_args(self.spec, point, run_dir)
        return RunJob(point.key, tuple(args), run_dir, self.dir / LOGS_DIR / f"{point.key}.log")

    def execute(self, point: SweepPoint) -> Outcome:
        return self.launcher.execute(self.job(point))

    def stop(self) -> None:
        """Interrupt the running processes: each keeps its last checkpoint for the next sweep."""
        self.launcher.stop()

    def rounds_done(self, point: SweepPoint) -> int:
        path = self.run_dir(point) / METRICS_FILE
        try:
            return path.read_bytes().count(b"\n")
        except OSError:
            return 0

    def run(self, on_update: Callable[[SweepRunner, list[Outcome]], None] | None = None) -> list[Outcome]:
        jobs = [self.job(p) for p in self.todo()]
        return self.launcher.run(jobs, None if on_update is None else lambda outcomes: on_update(self, outcomes))


# --- reading a sweep back ----------------------------------------------------------------------


def read_status(sweep_dir: Path) -> dict[str, dict[str, Any]]:
    """The last recorded attempt of each run."""
    path = sweep_dir / STATUS_FILE
    last: dict[str, dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash
            last[entry["key"]] = entry
    return last


def sweep_records(sweep_dir: str | Path) -> list[RunRecord]:
    sweep_dir = Path(sweep_dir)
    index = json.loads((sweep_dir / INDEX_FILE).read_text())
    status = read_status(sweep_dir)
    records = []
    for p in index:
        run_dir = sweep_dir / RUNS_DIR / p["key"]
        summary, error, state = None, None, PENDING
        if (run_dir / SUMMARY_FILE).is_file():
            summary, state = read_summary(run_dir / SUMMARY_FILE), DONE
        elif status.get(p["key"], {}).get("status") == FAILED:
            state, error = FAILED, status[p["key"]].get("error")
        elif (run_dir / CONFIG_FILE).is_file():
            state = INCOMPLETE
        folder = run_dir if run_dir.is_dir() else None
        records.append(RunRecord(p["key"], p["method"], p["setting"], p["seed"], state, folder, summary, error))
    return records
