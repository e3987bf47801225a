"""``fedmerge run``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from fedmerge.cli.app import (
    CONFIG_AND_OVERRIDES,
    app,
    fail,
    notice,
    out,
    split_args,
    stopped_run,
    system_problem,
    user_errors,
)


@app.command()
def run(
    args: list[str] = CONFIG_AND_OVERRIDES,
    resume: Path | None = typer.Option(None, "--resume", help="continue the run in this folder"),
    checkpoint: str | None = typer.Option(
        None, "--checkpoint", help="with --resume: continue from this file of RUN_DIR/checkpoints, not latest.json's"
    ),
    device: str | None = typer.Option(None, "--device", help="cpu, cuda, cuda:N or auto"),
    data_dir: str | None = typer.Option(None, "--data-dir", help="folder holding the dataset files"),
    out_dir: str | None = typer.Option(None, "--output-dir", help="where run folders are created"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="live progress display"),
    run_dir: Path | None = typer.Option(None, "--out", help="create the run in exactly this folder"),
    # the name before --out (runs of earlier sweeps record it in their provenance): still accepted
    old_run_dir: Path | None = typer.Option(None, "--run-dir", hidden=True),
    tuned: Path | None = typer.Option(None, "--tuned", help="apply this fedmerge tune file's values"),
) -> None:
    """Run an experiment (the built-in FedAvg on UCI digits when no config is given)."""
    from fedmerge.core.checkpoint import CheckpointError
    from fedmerge.core.loop import RoundFailed
    from fedmerge.core.state_store import StateStoreError
    from fedmerge.run.runner import run_from_files

    config_path, overrides = split_args(args)
    if old_run_dir is not None and run_dir is not None:
        fail("--run-dir is the former name of --out; give one of them", 2)
    run_dir = run_dir or old_run_dir
    if device:
        overrides.append(f"device={device}")
    if data_dir:
        overrides.append(f"dataset.data_dir={data_dir}")
    if out_dir:
        overrides.append(f"output_dir={out_dir}")
    try:
        result = run_from_files(
            config_path,
            overrides,
            resume_dir=str(resume) if resume else None,
            checkpoint=checkpoint,
            show_progress=progress,
            notify=notice,
            run_dir=str(run_dir) if run_dir else None,
            tuned=str(tuned) if tuned else None,
        )
    except (*user_errors(), CheckpointError, StateStoreError) as exc:  # a damaged checkpoint is an input too
        fail(str(exc), 2)
    except RoundFailed as exc:
        fail(str(exc), 1)
    except KeyboardInterrupt as exc:
        fail(stopped_run(exc if resume is None else _in(exc, resume), "interrupted"), 130)
    except OSError as exc:
        if (problem := system_problem(exc)) is None:
            raise
        fail(stopped_run(exc if resume is None else _in(exc, resume), problem), 2)
    print_summary(result.summary)
    out.print(f"results in [bold]{result.run_dir}[/]", soft_wrap=True, highlight=False)


def _in(exc: BaseException, run_dir: Path) -> BaseException:
    """``exc`` with the folder of the run being resumed, which exists whatever the point of failure."""
    exc.run_dir = run_dir  # type: ignore[attr-defined]
    return exc


def print_summary(summary: dict[str, Any]) -> None:
    from fedmerge.run.run_records import as_summary  # imported by the run already

    typed = as_summary(summary)
    table = Table(title=f"{typed.algorithm} on {typed.dataset} ({typed.num_clients} clients)")
    for col in ("selection", "round", "metric", "mean", "weighted", "std", "worst 10%"):
        table.add_column(col, justify="right" if col not in ("selection", "metric") else "left")
    for label in ("last", "best_val"):
        part = typed.selection(label)
        if part is None:
            continue
        clients = part.clients or {}
        for key in ("test_acc", "test_top5", "test_nll", "test_ece", "test_mce"):
            if (s := clients.get(key)) is not None:
                figures = (s.mean, s.weighted_mean, s.std, s.worst10)
                table.add_row(label, str(part.round), key, *(f"{v:.4f}" for v in figures))
        if part.pooled:
            table.add_row(label, str(part.round), "global test_acc", f"{part.pooled['test_acc']:.4f}", "", "", "")
    out.print(table)
    comm, params = typed.communication_per_client_per_round, typed.parameters or {}
    if comm is not None:
        out.print(
            f"parameters: model {params.get('model', 0):,.0f}, server {params.get('server_state', 0):,.0f}, "
            f"per client state {params.get('client_state_mean', 0):,.0f}; "
            f"communicated per client per round: down {comm.down:,.0f}, up {comm.up:,.0f}",
            soft_wrap=True,
        )
    gap = typed.local_gap
    if gap is not None:
        out.print(f"local-global gap (train loss received - trained): mean {gap.mean:.4f}, last {gap.last:.4f}")
    from fedmerge.algorithms import ALGORITHMS  # imported by the run already

    for line in ALGORITHMS.hooks(typed.algorithm).lines(summary):  # e.g. FedMerge's cluster recovery
        if line:
            out.print(line, soft_wrap=True, highlight=False, markup=False)
