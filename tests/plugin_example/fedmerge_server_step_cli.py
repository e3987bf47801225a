"""``fedmerge server-step``: the example plugin's command group, which fedmerge finds through the entry point
``fedmerge.cli`` of this package.

A module of its own, apart from the method's: ``fedmerge --help`` imports it to list the group, so it imports
typer only at the top, and ``fedmerge.api`` (torch and every method) inside the command that needs it.
"""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, help="Tools of fedavg_server_lr, FedAvg with a server step (example plugin).")


@app.command("steps")
def steps(run_dir: Path = typer.Argument(..., help="a run folder of fedavg_server_lr")) -> None:
    """The length of the server's step at every round of a run."""
    from fedmerge_server_step import logged_steps  # the method's module: torch and fedmerge, only when run

    from fedmerge.api import read_run_folder

    try:
        rows = read_run_folder(run_dir).rows
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    logged = logged_steps(rows)
    if not logged:
        typer.echo(f"error: {run_dir}: no server steps logged (not a fedavg_server_lr run?)", err=True)
        raise typer.Exit(2)
    for rnd, norm in logged:
        typer.echo(f"round {rnd}: {norm!r}")
