"""What is checked before any run of a study starts, and what ``fedmerge study --dry-run`` prints.

Each problem is refused in one line (``PreflightError``), before any run folder exists:

- the device: runs that ask for CUDA (``device: cuda``) when the launcher cannot give them a GPU (no CUDA
  here for ``--launcher local``; no GPU in the Ray cluster or no ``--gpus-per-run`` for ``ray`` and ``slurm``);
- the datasets: a fetched dataset (``fedmerge data fetch``) whose files are not in its data folder, unless
  ``dataset.download`` fetches them; a dataset read from a path (``dataset.path``) that does not exist;
- the pretrained weights (and tokenizers): a Hub name that is neither a local folder nor in the Hugging Face
  cache while ``HF_HUB_OFFLINE`` forbids downloading it;
- the Ray cluster's nodes: runs no single node can hold (``--cpus-per-run`` CPUs and ``--gpus-per-run`` GPUs),
  which Ray would queue forever;
- the disk: less free room where the run folders go than the runs' allowance (``RUN_DISK``) plus the
  datasets still to download.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from fedmerge.config.schema import ConfigError, ExperimentConfig, load_config
from fedmerge.study.spec import Study, run_key, run_overrides
from fedmerge.sweep.clusters import LaunchOptions
from fedmerge.sweep.launch import cores

# A run folder's room on disk, at least: its logs, metrics and last checkpoint (the global models and the clients'
# states). An allowance, not a measurement: the refusal is for a disk that is clearly too small.
RUN_DISK = 256 * 2**20
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


def configs(study: Study) -> list[ExperimentConfig]:
    """Each tuning run's config (the seeds' runs differ only in seed)."""
    return [load_config(study.base, [*overrides, f"name={key}"]) for key, overrides in plan(study).tuning]


def devices(study: Study) -> set[str]:
    """The devices the study's runs ask for."""
    return {cfg.device for cfg in configs(study)}


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


def missing_datasets(cfgs: list[ExperimentConfig]) -> tuple[list[str], int]:
    """The problems with the runs' datasets (one line each), and the bytes still to download."""
    from fedmerge.data.catalog import CATALOG, fetch_command
    from fedmerge.data.sources.fetched import FetchedConfig

    problems: list[str] = []
    to_fetch: dict[str, int] = {}
    for ds in {cfg.dataset.model_dump_json(): cfg.dataset for cfg in cfgs}.values():
        path = getattr(ds, "path", None)  # a user's file: a field of those loaders' configs only
        if path:
            if not Path(path).expanduser().exists():
                problems.append(f"dataset {ds.name!r}: {path} does not exist (dataset.path)")
            continue
        if ds.name not in CATALOG.names() or not isinstance(ds, FetchedConfig):
            continue  # built in or read by its own loader: it says what is missing
        entry = CATALOG.get(ds.name)
        folder = entry.folder(ds.data_dir)
        absent = [f for f in entry.files if not (folder / f.name).is_file()]
        if absent and ds.download:
            to_fetch[ds.name] = sum(f.size or 0 for f in absent)
        elif absent:
            problems.append(
                f"dataset {ds.name!r} is not in {folder} ({absent[0].name} missing): run `{fetch_command(ds.name)}` "
                "or set dataset.download=true"
            )
    return problems, sum(to_fetch.values())


def hub_names(cfg: ExperimentConfig) -> set[str]:
    """The Hugging Face names a run loads weights or a tokenizer from (a local folder is not one)."""
    from fedmerge.models.vit import DEFAULT_MODEL, ViTLoRAConfig

    # by key, not by class: the pretrained models' and text datasets' configs (a plugin's too) name them so
    names = {getattr(cfg.model, "model", None), getattr(cfg.dataset, "tokenizer", None)}
    if isinstance(cfg.model, ViTLoRAConfig) and cfg.model.backend == "hf" and cfg.model.model is None:
        names.add(DEFAULT_MODEL["hf"])
    return {n for n in names if isinstance(n, str) and n and not Path(n).expanduser().exists()}


def in_hf_cache(name: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(name, "config.json"), str) or isinstance(
        try_to_load_from_cache(name, "tokenizer_config.json"), str
    )


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def missing_weights(cfgs: list[ExperimentConfig]) -> list[str]:
    """Weights or tokenizers neither on disk nor in the Hugging Face cache, when nothing may be downloaded."""
    names = sorted(set().union(*(hub_names(cfg) for cfg in cfgs)) if cfgs else set())
    absent = [n for n in names if not in_hf_cache(n)]
    if not absent or not hub_offline():
        return []  # downloaded on first use into the Hugging Face cache
    return [
        f"model weights {n!r} are neither a local folder nor in the Hugging Face cache, and HF_HUB_OFFLINE forbids "
        f"downloading them: `hf download {n}` where the Hub is reachable (HF_HOME selects the cache)"
        for n in absent
    ]


def free_bytes(folder: Path) -> int:
    """Free room on the disk that holds ``folder`` (its nearest existing parent: nothing is created)."""
    here = folder.absolute()
    while not here.exists() and here != here.parent:
        here = here.parent
    return shutil.disk_usage(here).free


def check_disk(runs: Path, count: int, download: int) -> None:
    need = count * RUN_DISK + download
    free = free_bytes(runs)
    if free < need:
        fetch = f" and {download / 2**30:.1f} GiB of datasets to download" if download else ""
        raise PreflightError(
            f"the disk of {runs} has {free / 2**30:.1f} GiB free; {count} runs need at least {need / 2**30:.1f} GiB "
            f"({RUN_DISK // 2**20} MiB each{fetch}): free some room or give --runs on a larger disk"
        )


def check_ray_nodes(options: LaunchOptions, nodes: list[dict[str, float]] | None = None) -> None:
    """Refuse, in one line, runs no node of the Ray cluster can hold (Ray would queue them forever): each
    run's task needs --cpus-per-run CPUs and --gpus-per-run GPUs on one node. ``nodes``: each live node's
    resources (asked of the cluster when None)."""
    if options.launcher != "ray":
        return
    if nodes is None:
        from fedmerge.sweep.clusters import RayLauncher

        nodes = RayLauncher(options).node_resources()
    need = {"CPU": options.cpus_per_run, "GPU": options.gpus_per_run}
    if any(all(node.get(k, 0.0) >= v for k, v in need.items() if v > 0) for node in nodes):
        return
    largest = max(nodes, key=lambda n: (n.get("GPU", 0.0), n.get("CPU", 0.0)), default={})
    raise PreflightError(
        f"each run asks for {options.cpus_per_run:g} CPU(s) and {options.gpus_per_run:g} GPU(s) on one node, and "
        f"no node of the Ray cluster has them ({len(nodes)} node(s); the largest: {largest.get('CPU', 0.0):g} "
        f"CPU(s), {largest.get('GPU', 0.0):g} GPU(s)); lower --cpus-per-run/--gpus-per-run or add a node"
    )


def preflight(study: Study, options: LaunchOptions, runs: Path) -> None:
    """Everything checked before any run starts (the module's list), the first problem refused in one line."""
    check_device(study, options)
    check_ray_nodes(options)
    cfgs = configs(study)
    problems, download = missing_datasets(cfgs)
    problems += missing_weights(cfgs)
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise PreflightError(problems[0] + more)
    check_disk(runs, plan(study).count, download)


def dry_run(study: Study, options: LaunchOptions, path: Path | None = None) -> list[str]:
    """The lines of ``--dry-run``: every run, its resources, the count, the GPU-hour arithmetic of the study
    file (``path``) with one run's steps recomputed, and the GPU hours the study states."""
    from fedmerge.study.cost import cost_lines

    p = plan(study)
    each = options.resources(max(1, cores() // max(1, options.jobs)))
    lines = [f"tuning (seed {study.tuning_seed}): {key}: {' '.join(ov)}" for key, ov in p.tuning]
    lines += [f"seeds: {label}, its chosen point, seed {seed}" for label, seed in p.seeds]
    lines.append(f"each run: {each}")
    refs = f"; then {len(study.seeds)} central reference(s), trained in this process"
    lines.append(f"{p.count} runs ({len(p.tuning)} tuning, {len(p.seeds)} seeds){refs}")
    if path is not None and path.is_file():
        lines += cost_lines(path)
    hours = stated_gpu_hours(study)
    if hours is not None:
        on = f" on {hours[1]}" if hours[1] else ""
        lines.append(f"the study states about {hours[0]:g} GPU hours{on}")
    return lines
