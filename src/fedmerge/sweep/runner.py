"""``fedmerge sweep``: run every point of a grid in parallel worker processes, resumably.

SWEEP_DIR/sweep.yaml      the sweep (base config, fixed overrides, grid, methods, tuned file)
SWEEP_DIR/index.json      every point: its folder key, method, setting, seed and overrides
SWEEP_DIR/runs/KEY/       one ordinary run folder per point (config.yaml, metrics.jsonl, provenance.jsonl, ...)
SWEEP_DIR/logs/KEY.log    what each attempt of that run printed
SWEEP_DIR/status.jsonl    one line per finished attempt: done, failed (with its error line) or interrupted
SWEEP_DIR/results.md|csv  the comparison tables (``fedmerge.report.compare``)

Each run is one ``fedmerge run ... --out SWEEP_DIR/runs/KEY`` process, so its provenance holds
a command that reproduces it alone. Running the sweep again skips finished runs, continues
stopped ones from their checkpoints (``fedmerge run --resume``) and retries failed ones. A worker
gets ``threads = cores // jobs`` (unless the config file or an override sets ``threads``) so that
the processes neither oversubscribe the cores nor leave them idle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fedmerge.config.schema import ConfigError, first_config_difference, load_config, make_folder, read_yaml
from fedmerge.core.checkpoint import atomic_write_bytes
from fedmerge.run.results import CONFIG_FILE, DONE, FAILED, INCOMPLETE, METRICS_FILE, PENDING, SUMMARY_FILE, RunRecord
from fedmerge.sweep.spec import SweepPoint, SweepSpec, expand

SPEC_FILE = "sweep.yaml"
INDEX_FILE = "index.json"
STATUS_FILE = "status.jsonl"
RUNS_DIR = "runs"
LOGS_DIR = "logs"
INTERRUPTED = "interrupted"

Notify = Callable[[str], None]


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


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
    try:
        old = load_config(run_dir / CONFIG_FILE).model_dump(mode="json")
    except ConfigError:
        old = {}
    new = point.config.model_dump(mode="json")
    diff = first_config_difference(old, new)
    if diff is not None:
        key, was, now = diff
        raise ConfigError(
            f"{run_dir} was made with {key}={was!r}, this sweep has {key}={now!r}; "
            "use another --out folder or delete that run folder"
        )


# --- running -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    key: str
    status: str  # DONE, FAILED or INTERRUPTED
    error: str | None
    seconds: float


def threads_chosen(spec: SweepSpec, point: SweepPoint) -> bool:
    """Whether the user set ``threads`` (to a number) for this point, in the config file or an override;
    else the sweep gives each run its share of the cores (the schema's default of 1 would leave cores idle)."""
    if point.config.threads is None:
        return False
    if any(o.partition("=")[0].strip() == "threads" for o in point.overrides):
        return True
    return spec.config is not None and "threads" in read_yaml(Path(spec.config))


def run_command(spec: SweepSpec, point: SweepPoint, run_dir: Path, threads: int) -> list[str]:
    """The ``fedmerge run`` process of one point: a new run, or the continuation of a stopped one."""
    base = [sys.executable, "-m", "fedmerge", "run"]
    if (run_dir / CONFIG_FILE).is_file():
        return [*base, "--resume", str(run_dir), "--no-progress"]
    overrides = list(point.overrides)
    if not threads_chosen(spec, point):
        overrides.append(f"threads={threads}")
    cmd = [*base, *([spec.config] if spec.config else []), *overrides]
    if spec.tuned:
        cmd += ["--tuned", spec.tuned]
    return [*cmd, "--out", str(run_dir), "--no-progress"]


class SweepRunner:
    """Runs the points of a prepared sweep, ``jobs`` at a time, and records each attempt."""

    def __init__(self, spec: SweepSpec, sweep_dir: Path, points: list[SweepPoint], jobs: int) -> None:
        self.spec, self.dir, self.points, self.jobs = spec, sweep_dir, points, max(1, jobs)
        self.threads = max(1, cores() // self.jobs)
        self._lock = threading.Lock()
        self._procs: dict[str, subprocess.Popen] = {}
        self.running: set[str] = set()

    def run_dir(self, point: SweepPoint) -> Path:
        return self.dir / RUNS_DIR / point.key

    def todo(self) -> list[SweepPoint]:
        return [p for p in self.points if not (self.run_dir(p) / SUMMARY_FILE).is_file()]

    def execute(self, point: SweepPoint) -> Outcome:
        run_dir = self.run_dir(point)
        cmd = run_command(self.spec, point, run_dir, self.threads)
        env = {**os.environ, **{v: str(self.threads) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}}
        log = self.dir / LOGS_DIR / f"{point.key}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with self._lock:
            self.running.add(point.key)
        try:
            with open(log, "a", encoding="utf-8") as fh:
                fh.write(f"$ {' '.join(cmd)}\n")
                fh.flush()
                proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
                with self._lock:
                    self._procs[point.key] = proc
                code = proc.wait()
        finally:
            with self._lock:
                self.running.discard(point.key)
                self._procs.pop(point.key, None)
        done = code == 0 and (run_dir / SUMMARY_FILE).is_file()
        status = DONE if done else INTERRUPTED if code in (130, -2, -15) else FAILED
        outcome = Outcome(point.key, status, None if done else _error_line(log, code), time.perf_counter() - start)
        self._record(outcome, code)
        return outcome

    def _record(self, outcome: Outcome, code: int) -> None:
        line = {
            "key": outcome.key,
            "status": outcome.status,
            "returncode": code,
            "error": outcome.error,
            "seconds": round(outcome.seconds, 3),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        with self._lock, open(self.dir / STATUS_FILE, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\n")

    def stop(self) -> None:
        """Interrupt the running processes: each keeps its last checkpoint for the next sweep."""
        with self._lock:
            procs = list(self._procs.values())
        for proc in procs:
            proc.send_signal(2)  # SIGINT: `fedmerge run` stops cleanly
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()

    def rounds_done(self, point: SweepPoint) -> int:
        path = self.run_dir(point) / METRICS_FILE
        try:
            return path.read_bytes().count(b"\n")
        except OSError:
            return 0

    def run(self, on_update: Callable[[SweepRunner, list[Outcome]], None] | None = None) -> list[Outcome]:
        outcomes: list[Outcome] = []
        todo = self.todo()
        pool = ThreadPoolExecutor(self.jobs)
        futures: set[Future] = {pool.submit(self.execute, p) for p in todo}
        try:
            while futures:
                finished, futures = wait(futures, timeout=0.5, return_when=FIRST_COMPLETED)
                outcomes += [f.result() for f in finished]
                if on_update is not None:
                    on_update(self, outcomes)
        except KeyboardInterrupt:
            pool.shutdown(wait=False, cancel_futures=True)
            self.stop()
            raise
        pool.shutdown()
        return outcomes


def _error_line(log: Path, code: int) -> str:
    """The run's one-line error (``error: ...``), else the last line it printed."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    line = errors[-1].removeprefix("error:").strip() if errors else (lines[-1] if lines else "")
    return f"{line} (exit {code})" if line else f"exit {code}"


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
            summary, state = json.loads((run_dir / SUMMARY_FILE).read_text()), DONE
        elif status.get(p["key"], {}).get("status") == FAILED:
            state, error = FAILED, status[p["key"]].get("error")
        elif (run_dir / CONFIG_FILE).is_file():
            state = INCOMPLETE
        folder = run_dir if run_dir.is_dir() else None
        records.append(RunRecord(p["key"], p["method"], p["setting"], p["seed"], state, folder, summary, error))
    return records
