"""The options that say where a study's or sweep's runs execute (``--launcher local|ray|slurm``)."""

from __future__ import annotations

import typer

LAUNCHER = typer.Option(
    "local", "--launcher", help="where each run executes: local (processes here), ray (a Ray cluster), slurm (submitit)"
)
RAY_ADDRESS = typer.Option(None, "--ray-address", help="--launcher ray: the cluster's address, or auto")
CPUS_PER_RUN = typer.Option(1.0, "--cpus-per-run", help="--launcher ray|slurm: CPUs of each run")
GPUS_PER_RUN = typer.Option(
    0.0, "--gpus-per-run", help="--launcher ray|slurm: GPUs of each run (fractions share a GPU on Ray)"
)
SLURM_PARTITION = typer.Option(None, "--slurm-partition", help="--launcher slurm: the partition")
SLURM_TIME = typer.Option(
    60, "--slurm-time", min=1, help="--launcher slurm: minutes per job; a job that times out is requeued and resumes"
)
SLURM_CLUSTER = typer.Option(
    None, "--slurm-cluster", hidden=True, help="submitit's executor: local or debug stand in for SLURM (tests)"
)
