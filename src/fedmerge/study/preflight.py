"""What is checked before any run of a study starts, and what ``fedmerge study --dry-run`` prints.

The device: a study whose runs ask for CUDA (``device: cuda``) is refused in one line, before any run folder
exists, when the launcher cannot give them a GPU (no CUDA here for ``--launcher local``; no GPU in the Ray
cluster or no ``--gpus-per-run`` for ``ray`` and ``slurm``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fedmerge.config.schema import ConfigError, load_config
from fedmerge.study.spec import Study, run_key, run_overrides
from fedmerge.sweep.clusters import LaunchOptions
from fedmerge.sweep.launch import cores

GPU_HOURS = re.compile(r"about ([0-9][0-9,]*(?:\.[0-9]+)?) GPU hours(?: on ([^.;()]+))?")


class PreflightError(ConfigError):
    """A study that cannot run with these launch options, found before any run starts."""


@dataclass(frozen=True)
class Plan:
    """The runs a study asks for: every tuning run (key, overrides), then per row its chosen point on every
    other seed (row label, seed), which tuning decides."""

    tuning: list[tuple[str, list[str]]]
    seeds: list[tuple[str, int]]

    @property
    def count(self) -> int:
        return len(self.tuning) + len(self.seeds)


def plan(study: Study) -> Plan:
    seed = study.tuning_seed
    tuning = [
        (run_key(m.label, i, seed), run_overrides(m, point, seed))
        for m in study.methods
        for i, point in enumerate(m.points())
    ]
    seeds = [(m.label, s) for m in study.methods for s in study.seeds if s != seed]
    return Plan(tuning, seeds)


def devices(study: Study) -> set[str]:
    """The devices the study's runs ask for (each tuning run's config; the seeds' runs differ only in seed)."""
    return {load_config(study.base, [*overrides, f"name={key}"]).device for key, overrides in plan(study).tuning}


def stated_gpu_hours(study: Study) -> tuple[float, str] | None:
    """(hours, on what) when the study's description states its cost ("about N GPU hours on one H100")."""
    found = GPU_HOURS.search(study.description or "")
    if found is None:
        return None
    return float(found.group(1).replace(",", "")), (found.group(2) or "").strip()


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def check_device(study: Study, options: LaunchOptions, cluster_gpus: float | None = None) -> None:
    """Refuse, in one line, a CUDA study that the launcher cannot give a GPU. ``cluster_gpus``: the Ray
    cluster's GPUs (asked for when None and the launcher is ray)."""
    wanted = sorted(d for d in devices(study) if d.startswith("cuda"))
    if not wanted:
        return
    needs = f"its runs ask for device: {wanted[0]}"
    if options.launcher == "local":
        if not cuda_available():
            raise PreflightError(
                f"{needs}, and this machine has no CUDA (torch.cuda.is_available() is False); "
                "run it on a GPU machine or a cluster (--launcher ray|slurm --gpus-per-run N)"
            )
        return
    if options.gpus_per_run <= 0:
        raise PreflightError(f"{needs}: give each run a GPU (--gpus-per-run, e.g. 1 or 0.5 on Ray)")
    if options.launcher == "ray":
        if cluster_gpus is None:
            from fedmerge.sweep.clusters import RayLauncher

            cluster_gpus = RayLauncher(options).total_gpus()
        if cluster_gpus < options.gpus_per_run:
            raise PreflightError(
                f"{needs}, --gpus-per-run {options.gpus_per_run:g}, and the Ray cluster has {cluster_gpus:g} GPU(s)"
            )


def dry_run(study: Study, options: LaunchOptions) -> list[str]:
    """The lines of ``--dry-run``: every run, its resources, the count, and the GPU hours the study states."""
    p = plan(study)
    each = options.resources(max(1, cores() // max(1, options.jobs)))
    lines = [f"tuning (seed {study.tuning_seed}): {key}: {' '.join(ov)}" for key, ov in p.tuning]
    lines += [f"seeds: {label}, its chosen point, seed {seed}" for label, seed in p.seeds]
    lines.append(f"each run: {each}")
    refs = f"; then {len(study.seeds)} central reference(s), trained in this process"
    lines.append(f"{p.count} runs ({len(p.tuning)} tuning, {len(p.seeds)} seeds){refs}")
    hours = stated_gpu_hours(study)
    if hours is not None:
        on = f" on {hours[1]}" if hours[1] else ""
        lines.append(f"the study states about {hours[0]:g} GPU hours{on}")
    return lines
