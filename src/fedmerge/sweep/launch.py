"""Starting ``fedmerge run`` processes, ``jobs`` at a time: the one launcher that sweeps and studies share.

Each run is its own ``fedmerge run`` process, so its provenance holds a command that reproduces it
alone. A job names the folder of its run (``fedmerge run --out``: the run folder itself) or the folder
in which its run folder is made (``--output-dir``); a run already started there continues from its
checkpoint (``--resume``), a finished one is not started again. A folder made with other settings is
named by [`config_difference()`][fedmerge.sweep.launch.config_difference], for the caller to refuse before anything
runs. Each attempt's output
is appended to its log and its outcome to a status file (one JSON line). Every process gets its share of
the cores, ``cores // jobs``, so that parallel runs neither oversubscribe the cores nor leave them idle: as
``FEDMERGE_CORES``, which a run's ``workers: auto`` uses for worker processes of one thread each (the numbers
of a plain ``fedmerge run``), and as ``OMP_NUM_THREADS`` for a run that asks for ``threads: null``.
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

from fedmerge.config.schema import first_config_difference, load_config
from fedmerge.engines.workers import CORES_ENV
from fedmerge.run.results import CONFIG_FILE, DONE, FAILED, SUMMARY_FILE

INTERRUPTED = "interrupted"


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def started_run(where: Path) -> Path | None:
    """The run at ``where``: the folder itself when it holds a run (``--out``), else the newest run folder
    inside it (``--output-dir``, where each run folder is named NAME-TIMESTAMP); None before any start."""
    if (where / CONFIG_FILE).is_file():
        return where
    found = sorted(p for p in where.glob("*") if (p / CONFIG_FILE).exists()) if where.is_dir() else []
    return found[-1] if found else None


def finished_run(where: Path) -> Path | None:
    """The run at ``where`` if it has finished (written its summary), else None."""
    run = started_run(where)
    return run if run is not None and (run / SUMMARY_FILE).is_file() else None


def config_difference(run_dir: Path, want: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """(key, the run's value, the wanted value) of the first setting in which the run in ``run_dir`` is
    not the wanted one (``want``: a config's JSON dump), None when it is. Runs are found by folder name,
    so without this check a changed grid or base config would silently reuse runs made with other
    settings. Raises ConfigError when the run's config.yaml no longer loads."""
    have = load_config(run_dir / CONFIG_FILE).model_dump(mode="json")
    return first_config_difference(have, want)


@dataclass(frozen=True)
class RunJob:
    """One run to bring to its end: ``args`` start it afresh (config, overrides, ``--out`` or
    ``--output-dir``), ``where`` is that output folder, ``log`` where its attempts' output goes, ``cwd`` the
    folder its relative paths are relative to (None: the current one)."""

    key: str
    args: tuple[str, ...]
    where: Path
    log: Path
    cwd: str | None = None

    def anywhere(self) -> RunJob:
        """The same job with absolute paths, for a process started in another folder (a cluster worker)."""
        cwd = Path(self.cwd or Path.cwd()).absolute()
        return RunJob(self.key, self.args, cwd / self.where, cwd / self.log, str(cwd))

    def command(self) -> list[str]:
        """A new run, or the continuation of one stopped earlier."""
        run = started_run(self.where)
        args = ["--resume", str(run)] if run is not None else list(self.args)
        return [sys.executable, "-m", "fedmerge", "run", *args, "--no-progress"]


@dataclass
class Outcome:
    key: str
    status: str  # DONE, FAILED or INTERRUPTED
    error: str | None
    seconds: float


class Launcher:
    """Runs jobs ``jobs`` at a time, each process on ``cores_each`` cores, and records each attempt."""

    def __init__(self, jobs: int, status_file: Path | None = None) -> None:
        self.jobs = max(1, jobs)
        self.cores_each = max(1, cores() // self.jobs)
        self.status_file = status_file
        self._lock = threading.Lock()
        self._procs: dict[str, subprocess.Popen] = {}
        self.running: set[str] = set()

    def env(self) -> dict[str, str]:
        """What each run process gets on top of its environment: its share of the cores."""
        share = str(self.cores_each)
        return {CORES_ENV: share, **dict.fromkeys(("OMP_NUM_THREADS", "MKL_NUM_THREADS"), share)}

    def execute(self, job: RunJob) -> Outcome:
        start = time.perf_counter()
        with self._lock:
            self.running.add(job.key)
        try:
            code = run_process(job, self.env(), self._started)
        finally:
            with self._lock:
                self.running.discard(job.key)
                self._procs.pop(job.key, None)
        return self.finish(job, code, time.perf_counter() - start)

    def _started(self, job: RunJob, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs[job.key] = proc

    def finish(self, job: RunJob, code: int, seconds: float, error: str | None = None) -> Outcome:
        """The outcome of one attempt (read from the run folder, which the caller must see), recorded."""
        done = code == 0 and finished_run(job.where) is not None
        status = DONE if done else INTERRUPTED if code in (130, -2, -15) else FAILED
        if not done and error is None:
            error = error_line(job.log, code) if job.log.is_file() else f"exit {code}"
        outcome = Outcome(job.key, status, None if done else error, seconds)
        self._record(outcome, code)
        return outcome

    def _record(self, outcome: Outcome, code: int) -> None:
        if self.status_file is None:
            return
        line = {
            "key": outcome.key,
            "status": outcome.status,
            "returncode": code,
            "error": outcome.error,
            "seconds": round(outcome.seconds, 3),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        self.status_file.parent.mkdir(parents=True, exist_ok=True)
        with self._lock, open(self.status_file, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\n")

    def stop(self) -> None:
        """Interrupt the running processes: each keeps its last checkpoint for the next attempt."""
        with self._lock:
            procs = list(self._procs.values())
        for proc in procs:
            proc.send_signal(2)  # SIGINT: `fedmerge run` stops cleanly
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()

    def run(self, jobs: list[RunJob], on_update: Callable[[list[Outcome]], None] | None = None) -> list[Outcome]:
        """Every job, ``self.jobs`` at a time; ``on_update`` sees the outcomes so far about twice a second."""
        outcomes: list[Outcome] = []
        pool = ThreadPoolExecutor(self.jobs)
        futures: set[Future] = {pool.submit(self.execute, job) for job in jobs}
        try:
            while futures:
                finished, futures = wait(futures, timeout=0.5, return_when=FIRST_COMPLETED)
                outcomes += [f.result() for f in finished]
                if on_update is not None:
                    on_update(outcomes)
        except KeyboardInterrupt:
            pool.shutdown(wait=False, cancel_futures=True)
            self.stop()
            raise
        pool.shutdown()
        return outcomes


def run_process(
    job: RunJob,
    env: dict[str, str],
    started: Callable[[RunJob, subprocess.Popen], None] | None = None,
    die_with_parent: bool = False,
    ignore_usr2: bool = False,
) -> int:
    """Bring ``job`` one attempt further in a ``fedmerge run`` process here, its output appended to its log;
    its exit code. The command is made here and now
    ([`RunJob.command()`][fedmerge.sweep.launch.RunJob.command]), so an attempt after one that stopped
    continues from its checkpoint wherever it runs. ``die_with_parent``: the process is killed when
    the one that started it dies (Linux), so that no orphan keeps writing the run folder after a lost
    cluster worker, whose retry resumes the same folder. ``ignore_usr2``: the process ignores SIGUSR2, which
    SLURM sends to a whole job before its time-out or preemption, for submitit to stop the run cleanly instead
    ([`SlurmRun`][fedmerge.sweep.clusters.SlurmRun])."""
    cmd = job.command()
    job.log.parent.mkdir(parents=True, exist_ok=True)
    with open(job.log, "a", encoding="utf-8") as fh:
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            cwd=job.cwd,
            preexec_fn=_preexec(die_with_parent and sys.platform == "linux", ignore_usr2),
        )
        if started is not None:
            started(job, proc)
        try:
            return proc.wait()
        except BaseException:  # interrupted here (Ctrl-C, a cancelled task): stop the run at its checkpoint
            proc.send_signal(2)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise


def _preexec(die_with_parent: bool, ignore_usr2: bool) -> Callable[[], None] | None:
    if not (die_with_parent or ignore_usr2):
        return None

    def setup() -> None:
        import ctypes
        import signal

        if die_with_parent:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if ignore_usr2:
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)

    return setup


def error_line(log: Path, code: int) -> str:
    """The run's one-line error (``error: ...``), else the last line it printed."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    line = errors[-1].removeprefix("error:").strip() if errors else (lines[-1] if lines else "")
    return f"{line} (exit {code})" if line else f"exit {code}"
