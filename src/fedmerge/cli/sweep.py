"""``fedmerge sweep`` and ``fedmerge tune``: many runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from fedmerge.cli import launching as lo
from fedmerge.cli.app import (
    app,
    err,
    fail,
    notice,
    out,
    split_args,
    user_errors,
)

SWEEP_ARGS = typer.Argument(
    None,
    metavar="[SWEEP.yaml | CONFIG] KEY=VALUE | KEY=[V1,V2]...",
    help="a sweep file or a config, then overrides; a list value is a grid axis (seed=[0,1,2])",
)


@app.command()
def sweep(
    args: list[str] = SWEEP_ARGS,
    jobs: int = typer.Option(1, "--jobs", "-j", min=1, help="runs at a time, each in its own process"),
    out_dir: Path | None = typer.Option(None, "--out", help="create the sweep in exactly this folder"),
    output_dir: str | None = typer.Option(
        None, "--output-dir", help="the folder in which the sweep folder is named (OUTPUT_DIR/sweeps/NAME)"
    ),
    resume: Path | None = typer.Option(None, "--resume", help="continue the sweep in this folder"),
    tuned: Path | None = typer.Option(None, "--tuned", help="apply this fedmerge tune file's values per algorithm"),
    dry_run: bool = typer.Option(False, "--dry-run", help="list the runs and stop"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="live progress display"),
    launcher: str = lo.LAUNCHER,
    ray_address: str | None = lo.RAY_ADDRESS,
    cpus_per_run: float = lo.CPUS_PER_RUN,
    gpus_per_run: float = lo.GPUS_PER_RUN,
    slurm_partition: str | None = lo.SLURM_PARTITION,
    slurm_time: int = lo.SLURM_TIME,
    slurm_cluster: str | None = lo.SLURM_CLUSTER,
) -> None:
    """Run a grid of runs (methods x settings x seeds) in parallel and compare them per setting."""
    from fedmerge.report.compare import RESULTS_CSV, RESULTS_MD, write_results
    from fedmerge.sweep import runner as sw
    from fedmerge.sweep.clusters import LaunchOptions
    from fedmerge.sweep.progress import SweepProgress
    from fedmerge.sweep.spec import spec_from_args

    try:
        if resume is not None:
            if args or tuned or output_dir:
                fail("--resume SWEEP_DIR takes no other arguments: the sweep is read from its sweep.yaml", 2)
            spec, out_dir = sw.load_spec(resume), resume
        else:
            extra = [f"output_dir={output_dir}"] if output_dir else []
            spec = spec_from_args([*(args or []), *extra], str(tuned) if tuned else None)
        launch = LaunchOptions(
            launcher, jobs, ray_address, cpus_per_run, gpus_per_run, slurm_partition, slurm_time, slurm_cluster
        )
        launch.check()
        points = sw.expand(spec)
        out_dir = out_dir or sw.default_sweep_dir(spec, points)
        if dry_run:
            for p in points:
                out.print(f"{p.key}: {' '.join(p.overrides)}", highlight=False, soft_wrap=True)
            each = launch.resources(max(1, sw.cores() // jobs))
            out.print(f"each run: {each}", highlight=False, soft_wrap=True)
            out.print(f"{len(points)} runs in {out_dir}", highlight=False, soft_wrap=True)
            return
        check_sweep_device([p.config.device for p in points], launch)
        points = sw.prepare(spec, out_dir)
    except user_errors() as exc:
        fail(str(exc), 2)
    runner = sw.SweepRunner(spec, out_dir, points, launch)
    # each run's workers: auto uses its share for worker processes (the numbers of the same run alone)
    each = f"{runner.cores_each} core(s) each, for the runs' worker processes (workers: auto)"
    if launcher != "local":
        each = launch.resources(runner.cores_each)
    notice(f"sweep of {len(points)} runs in {out_dir} ({jobs} at a time, {each})")
    if launcher == "local" and jobs > sw.cores():
        notice(f"warning: -j {jobs} runs more processes at a time than the {sw.cores()} cores; they slow each other")
    try:
        with SweepProgress(runner, live=progress and err.is_terminal, console=err) as display:
            outcomes = runner.run(display.update)
    except KeyboardInterrupt:
        fail(f"interrupted; continue with: fedmerge sweep --resume {out_dir}", 130)
    tables = write_results(out_dir)
    _print_tables(tables)
    out.print(f"tables in {out_dir / RESULTS_MD} and {out_dir / RESULTS_CSV}", soft_wrap=True, highlight=False)
    out.print(f"the page: fedmerge report {out_dir} -o report.html", soft_wrap=True, highlight=False)
    failed = sum(t.status == "failed" for t in outcomes)
    if failed:
        fail(f"{failed} of {len(outcomes)} runs failed; their errors are in the tables and in {out_dir / 'logs'}", 1)


def check_sweep_device(devices: list[str], launch: Any) -> None:
    """Refuse a sweep that asks for CUDA where the launcher cannot give it, before any run folder exists."""
    from fedmerge.study.preflight import PreflightError, cuda_available

    cuda = sorted(d for d in devices if d.startswith("cuda"))
    if not cuda:
        return
    if launch.launcher == "local" and not cuda_available():
        raise PreflightError(f"the runs ask for device: {cuda[0]}, and this machine has no CUDA")
    if launch.launcher != "local" and launch.gpus_per_run <= 0:
        raise PreflightError(f"the runs ask for device: {cuda[0]}: give each run a GPU (--gpus-per-run)")


def _print_tables(tables: list[Any]) -> None:
    from fedmerge.report.compare import columns, row_cells

    for t in tables:
        table = Table(title=escape(t.setting), title_justify="left")
        for i, col in enumerate(columns(t, short=True)):
            table.add_column(col, justify="left" if i == 0 else "right")
        for row in t.rows:
            table.add_row(*(escape(c) for c in row_cells(t, row)))
        out.print(table)
        for r in t.failures:
            out.print(f"failed: {r.key}: {escape(r.error or '')}", highlight=False, soft_wrap=True)
        for r in t.diverged:
            diverged = r.summary.diverged if r.summary is not None else None
            out.print(f"warning: {r.key}: {escape(diverged or '')}", highlight=False, soft_wrap=True)


@app.command()
def tune(
    args: list[str] = typer.Argument(
        None,
        metavar="[CONFIG] KEY=VALUE... [algorithm.name=[M1,M2]]",
        help="a config and overrides; a list of algorithm names tunes each with the same budget",
    ),
    trials: int = typer.Option(20, "--trials", min=1, help="finished trials per method (the same for all)"),
    out_dir: Path | None = typer.Option(None, "--out", help="create the study in exactly this folder"),
    output_dir: str | None = typer.Option(
        None, "--output-dir", help="the folder in which the study folder is named (OUTPUT_DIR/tune/NAME)"
    ),
    metric: str = typer.Option("val_acc", "--metric", help="val_acc (maximised) or val_nll (minimised)"),
    space: Path | None = typer.Option(None, "--space", help="YAML: METHOD or '*': {KEY: {low, high, log}}"),
    show_space: bool = typer.Option(False, "--show-space", help="print each method's search space and stop"),
) -> None:
    """Tune each method on the validation split with Optuna (resumable; test split withheld)."""
    from fedmerge.config.schema import ConfigError, load_config, parse_override
    from fedmerge.sweep import tune as tu

    config_path, overrides = split_args(args)
    overrides += [f"output_dir={output_dir}"] if output_dir else []
    if metric not in tu.METRICS:
        fail(f"--metric: expected one of {', '.join(tu.METRICS)}, got {metric!r}", 2)
    methods: list[str] = []
    try:
        fixed = []
        for text in overrides:
            path, value = parse_override(text)
            if isinstance(value, list):
                if path != ["algorithm", "name"]:
                    raise ConfigError(f"{text.partition('=')[0]}: tune takes a list only for algorithm.name")
                methods = [str(v) for v in value]
            else:
                fixed.append(text)
        cfg = load_config(config_path, fixed)
        methods = methods or [cfg.algorithm.name]
        if show_space:
            user = tu.load_space_file(space) if space else {}
            for method in methods:
                mcfg = load_config(config_path, [*fixed, f"algorithm.name={method}"])
                for key, param in tu.space_for(mcfg, user, config_path).items():
                    out.print(f"{method}: {key} {tu.describe_space(param)}", highlight=False, soft_wrap=True)
            return
        name = Path(config_path).stem if config_path else "tune"
        folder = out_dir or Path(cfg.output_dir) / "tune" / name
        tu.tune(
            config_path, fixed, methods, trials, folder, metric=metric,
            space_file=str(space) if space else None, notify=notice,
        )  # fmt: skip
    except user_errors() as exc:
        fail(str(exc), 2)
    except KeyboardInterrupt:
        fail("interrupted; run the same command again to continue the study", 130)
    out.print(f"best values in {folder / tu.BEST_FILE} (use: fedmerge run --tuned FILE)", soft_wrap=True)
