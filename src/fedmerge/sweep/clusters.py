"""Where each ``fedmerge run`` of a study or sweep executes: here (``local``), on a Ray cluster (``ray``) or
as SLURM jobs through submitit (``slurm``). The launcher only decides where; what runs (the study protocol:
tuning, seeds, regime, report; a sweep's grid) is the same for all of them.

Every launcher runs the same [`RunJob`][fedmerge.sweep.launch.RunJob]: the ``fedmerge run`` command is made
where and when the attempt starts ([`run_process()`][fedmerge.sweep.launch.run_process]), so an attempt that follows a
stopped one (a lost Ray node, a preempted or timed-out SLURM job) continues the run from its last checkpoint
(``fedmerge run --resume``) rather than starting it again. The run folders must be on a filesystem that the
study's machine and every worker see under the same path (a shared folder): results are not copied back.
"""

from __future__ import annotations

import math
import os
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedmerge.config.schema import ConfigError
from fedmerge.engines.workers import CORES_ENV
from fedmerge.sweep.launch import Launcher, Outcome, RunJob, run_process

LAUNCHERS = ("local", "ray", "slurm")
RETRIES = 3  # further attempts of a run whose worker was lost (each continues from the checkpoint)


@dataclass(frozen=True)
class LaunchOptions:
    """Where runs execute and with what. ``jobs``: local runs at a time (a SLURM array's parallelism);
    ``cpus_per_run``/``gpus_per_run``: each run's share on a cluster (fractional GPUs on Ray only);
    ``slurm_cluster``: submitit's executor (None: the real SLURM; ``local`` or ``debug``: submitit's
    stand-ins on this machine)."""

    launcher: str = "local"
    jobs: int = 2
    ray_address: str | None = None
    cpus_per_run: float = 1.0
    gpus_per_run: float = 0.0
    slurm_partition: str | None = None
    slurm_time: int = 60
    slurm_cluster: str | None = None

    def check(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ConfigError(f"--launcher: expected one of {', '.join(LAUNCHERS)}, got {self.launcher!r}")
        if self.cpus_per_run <= 0 or self.gpus_per_run < 0:
            raise ConfigError("--cpus-per-run must be above 0 and --gpus-per-run at least 0")
        if self.launcher == "slurm" and self.gpus_per_run != int(self.gpus_per_run):
            raise ConfigError(f"--gpus-per-run {self.gpus_per_run}: SLURM gives whole GPUs (fractions: --launcher ray)")
        if self.launcher != "ray" and self.ray_address is not None:
            raise ConfigError("--ray-address is for --launcher ray")
        if self.launcher != "slurm" and self.slurm_partition is not None:
            raise ConfigError("--slurm-partition is for --launcher slurm")

    def resources(self, cores_each: int) -> str:
        """Each run's resources, in words (``--dry-run``)."""
        if self.launcher == "local":
            return f"{cores_each} core(s), {self.jobs} run(s) at a time on this machine"
        what = f"{self.cpus_per_run:g} CPU(s), {self.gpus_per_run:g} GPU(s)"
        if self.launcher == "ray":
            return f"{what} per Ray task on {self.ray_address or 'a new local Ray instance'}"
        partition = self.slurm_partition or "the default partition"
        return f"{what} per SLURM array task on {partition}, {self.slurm_time} min each before requeueing"

    def run_env(self) -> dict[str, str]:
        share = str(max(1, math.floor(self.cpus_per_run)))
        return {CORES_ENV: share, "OMP_NUM_THREADS": share, "MKL_NUM_THREADS": share}


def make_launcher(options: LaunchOptions, status_file: Path | None = None, work_dir: Path | None = None) -> Launcher:
    """The launcher of ``options``; ``work_dir``: where a SLURM launcher keeps submitit's files."""
    options.check()
    if options.launcher == "ray":
        return RayLauncher(options, status_file)
    if options.launcher == "slurm":
        return SlurmLauncher(options, status_file, work_dir or Path("slurm"))
    return Launcher(options.jobs, status_file=status_file)


# --- Ray ---------------------------------------------------------------------------------------


def _ray_attempt(job: RunJob, env: dict[str, str]) -> int:
    """One Ray task: the run's next attempt on whichever node Ray placed it (GPUs: Ray's CUDA_VISIBLE_DEVICES)."""
    return run_process(job, env, die_with_parent=True)


class RayLauncher(Launcher):
    """One Ray task per run, with ``cpus_per_run`` CPUs and ``gpus_per_run`` GPUs. A task whose node is lost
    is retried by Ray (up to [`RETRIES`][fedmerge.sweep.clusters.RETRIES] times) and its retry resumes the
    run folder."""

    def __init__(self, options: LaunchOptions, status_file: Path | None = None) -> None:
        super().__init__(1, status_file)
        self.options = options
        self.cores_each = max(1, math.floor(options.cpus_per_run))
        self._refs: list[Any] = []

    def connect(self) -> Any:
        try:
            import ray
        except ImportError:
            raise ConfigError("--launcher ray needs Ray: pip install 'fedmerge[cluster]'") from None
        # a run given no GPU sees none (Ray's CUDA_VISIBLE_DEVICES=""), as today: its notice about that is noise
        warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)
        if not ray.is_initialized():
            ray.init(address=self.options.ray_address, log_to_driver=False, logging_level="error")
        return ray

    def total_gpus(self) -> float:
        return float(self.connect().cluster_resources().get("GPU", 0))

    def node_resources(self) -> list[dict[str, float]]:
        """Each live node's resources (CPU, GPU, ...): a run's task must fit on one node."""
        return [dict(node.get("Resources", {})) for node in self.connect().nodes() if node.get("Alive")]

    def run(self, jobs: list[RunJob], on_update: Callable[[list[Outcome]], None] | None = None) -> list[Outcome]:
        ray = self.connect()
        task = ray.remote(_ray_attempt).options(
            num_cpus=self.options.cpus_per_run,
            num_gpus=self.options.gpus_per_run,
            max_retries=RETRIES,
            retry_exceptions=False,
        )
        env = self.options.run_env()
        start = time.perf_counter()
        pending = {task.remote(job.anywhere(), env): job for job in jobs}
        self._refs = list(pending)
        self.running = {job.key for job in jobs}
        outcomes: list[Outcome] = []
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
                for ref in ready:
                    job = pending.pop(ref)
                    self.running.discard(job.key)
                    try:
                        code, error = ray.get(ref), None
                    except Exception as exc:  # the task failed for good (its node lost more than RETRIES times)
                        code, error = -1, f"Ray task failed: {str(exc).strip().splitlines()[0]}"
                    outcomes.append(self.finish(job, code, time.perf_counter() - start, error))
                if on_update is not None:
                    on_update(outcomes)
        except KeyboardInterrupt:
            self.stop()
            raise
        return outcomes

    def stop(self) -> None:
        """Cancel the tasks: a running one stops its run at the last checkpoint (run_process sends SIGINT)."""
        ray = self.connect()
        for ref in self._refs:
            ray.cancel(ref)


# --- SLURM (submitit) --------------------------------------------------------------------------


class SlurmRun:
    """The callable of one SLURM array task. On preemption or time-out submitit calls
    [`checkpoint()`][fedmerge.sweep.clusters.SlurmRun.checkpoint], which stops the run at its checkpoint and
    requeues a fresh attempt that continues it."""

    def __init__(self, job: RunJob, env: dict[str, str]) -> None:
        self.job, self.env = job, env
        self._proc: Any = None

    def __call__(self) -> int:
        code = run_process(self.job, self.env, lambda _job, proc: setattr(self, "_proc", proc), ignore_usr2=True)
        if code in (-15, 143) and os.environ.get("SLURM_JOB_ID"):
            # SLURM is taking the job away (preemption, scontrol requeue, scancel) and its SIGKILL follows: no
            # result may be written as if the run had ended; a requeued job runs this again and resumes.
            while True:
                time.sleep(60)
        return code

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        import submitit

        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(2)  # `fedmerge run` stops cleanly, its checkpoint kept
            try:
                proc.wait(timeout=60)
            except Exception:
                proc.kill()
        return submitit.helpers.DelayedSubmission(SlurmRun(self.job, self.env))

    def __getstate__(self) -> dict[str, Any]:
        return {"job": self.job, "env": self.env, "_proc": None}


class SlurmLauncher(Launcher):
    """One submitit job array per call of [`run()`][fedmerge.sweep.clusters.SlurmLauncher.run] (a study
    phase), ``jobs`` array tasks at a time."""

    def __init__(self, options: LaunchOptions, status_file: Path | None, work_dir: Path) -> None:
        super().__init__(options.jobs, status_file)
        self.options, self.work_dir = options, work_dir
        self.cores_each = max(1, math.floor(options.cpus_per_run))
        self._jobs: list[Any] = []

    def executor(self) -> Any:
        try:
            import submitit
        except ImportError:
            raise ConfigError("--launcher slurm needs submitit: pip install 'fedmerge[cluster]'") from None
        o = self.options
        ex = submitit.AutoExecutor(folder=self.work_dir / "%j", cluster=o.slurm_cluster)
        params: dict[str, Any] = {
            "timeout_min": o.slurm_time,
            "cpus_per_task": max(1, math.ceil(o.cpus_per_run)),
            "slurm_array_parallelism": o.jobs,
        }
        if o.gpus_per_run:
            params["gpus_per_node"] = int(o.gpus_per_run)
        if o.slurm_partition:
            params["slurm_partition"] = o.slurm_partition
        ex.update_parameters(**params)
        return ex

    def run(self, jobs: list[RunJob], on_update: Callable[[list[Outcome]], None] | None = None) -> list[Outcome]:
        ex = self.executor()
        env = self.options.run_env()
        with ex.batch():
            submitted = [ex.submit(SlurmRun(job.anywhere(), env)) for job in jobs]
        self._jobs = submitted
        pending = dict(zip(submitted, jobs, strict=True))
        self.running = {job.key for job in jobs}
        start = time.perf_counter()
        outcomes: list[Outcome] = []
        try:
            while pending:
                for sjob in [s for s in pending if s.done()]:
                    job = pending.pop(sjob)
                    self.running.discard(job.key)
                    try:
                        code, error = sjob.result(), None
                    except Exception as exc:
                        code, error = -1, f"SLURM job {sjob.job_id} failed: {str(exc).strip().splitlines()[-1]}"
                    outcomes.append(self.finish(job, code, time.perf_counter() - start, error))
                if on_update is not None:
                    on_update(outcomes)
                if pending:
                    threading.Event().wait(0.5)
        except KeyboardInterrupt:
            self.stop()
            raise
        return outcomes

    def stop(self) -> None:
        for sjob in self._jobs:
            if not sjob.done():
                sjob.cancel(check=False)
