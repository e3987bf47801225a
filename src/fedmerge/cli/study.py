"""``fedmerge study``: a reproduction study (tuning, seeds, regime check) and its report."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from fedmerge.cli import launching as lo
from fedmerge.cli.app import app, fail, notice, out, reason, user_errors


@app.command()
def study(
    study_file: Path = typer.Argument(
        ..., metavar="STUDY", help="a study file (studies/*.yaml), or a packaged study's name (fedmerge list study)"
    ),
    runs: Path | None = typer.Option(
        None, "--runs", help="run folders (default runs/repro/STUDY_NAME; a revision's: the same name + _REVISION)"
    ),
    out_path: Path | None = typer.Option(
        None, "--out", help="the report's path; its numbers go next to it (.json) (default: print the report)"
    ),
    jobs: int = typer.Option(
        2, "--jobs", "-j", min=1, help="runs at a time, each in its own process on its share of the cores"
    ),
    report_only: bool = typer.Option(False, "--report-only", help="write the report from the runs that exist"),
    regime_only_flag: bool = typer.Option(
        False, "--regime-only", help="only the Local and FedAvg rows: check the regime before the table"
    ),
    reuse: list[Path] = typer.Option(
        [],
        "--reuse",
        help="another study's run folders: copy the runs whose config is exactly one this study asks for, "
        "and central references trained the same way (repeatable)",
    ),
    revision: str | None = typer.Option(
        None, "--revision", help="which revision of the study (default: the latest; first: the study as first written)"
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="print the runs, their resources, their count and GPU hours, and stop"
    ),
    status: bool = typer.Option(
        False, "--status", help="per row: its runs done, running (where, which round) or stopped, and stop"
    ),
    launcher: str = lo.LAUNCHER,
    ray_address: str | None = lo.RAY_ADDRESS,
    cpus_per_run: float = lo.CPUS_PER_RUN,
    gpus_per_run: float = lo.GPUS_PER_RUN,
    slurm_partition: str | None = lo.SLURM_PARTITION,
    slurm_time: int = lo.SLURM_TIME,
    slurm_cluster: str | None = lo.SLURM_CLUSTER,
) -> None:
    """Run a reproduction study (tune every row on the tuning seed, run the chosen points on every seed,
    check the regime) and write its report; finished runs are reused, stopped ones resumed."""
    from fedmerge.study.packaged import find_study
    from fedmerge.study.preflight import PreflightError, preflight
    from fedmerge.study.preflight import dry_run as dry_run_lines
    from fedmerge.study.protocol import conduct, regime_only
    from fedmerge.study.report import report, write
    from fedmerge.study.spec import LATEST, load_study_file, runs_dir
    from fedmerge.sweep.clusters import LaunchOptions

    if out_path is not None:  # found out now, not after hours of runs
        try:
            out_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            fail(f"--out: cannot create the folder of {out_path} ({reason(exc)})", 2)
    try:
        path, named = find_study(study_file)
        if named is not None:
            if revision is not None and revision != named:
                fail(f"{study_file} is revision {named!r} of {path}; it takes no --revision {revision}", 2)
            notice(f"{study_file} is now revision {named!r} of {path}")
        spec = load_study_file(path)
        launch = LaunchOptions(
            launcher, jobs, ray_address, cpus_per_run, gpus_per_run, slurm_partition, slurm_time, slurm_cluster
        )
        launch.check()
        the_study = spec.history(named or revision or LATEST)[-1]
        the_study = regime_only(the_study) if regime_only_flag else the_study
        if status:
            from fedmerge.study.status import status_lines

            for line in status_lines(the_study, runs_dir(path, the_study.revision, runs)):
                out.print(line, highlight=False, soft_wrap=True)
            return
        if dry_run:
            for line in dry_run_lines(the_study, launch, path):
                out.print(line, highlight=False, soft_wrap=True)
            return
        if not report_only:  # before any run folder exists
            try:
                preflight(the_study, launch, runs_dir(path, the_study.revision, runs))
            except PreflightError as exc:
                fail(f"{path.name}: {exc}", 2)
        done = conduct(
            spec,
            path,
            named or revision or LATEST,
            runs=runs,
            jobs=launch,
            report_only=report_only,
            only_regime=regime_only_flag,
            notify=notice,
            reuse=tuple(reuse),
        )
        if out_path is not None:
            write(done, out_path)
            notice(
                f"report in {out_path} (numbers in {out_path.with_suffix('.json')}, "
                f"per-client values in {out_path.with_suffix('.clients.json')})"
            )
        else:
            sys.stdout.write(report(done))
    except user_errors() as exc:
        fail(str(exc), 2)
    except KeyboardInterrupt:
        fail("interrupted; run the same command again to continue the study (finished runs are kept)", 130)
