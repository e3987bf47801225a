"""``fedmerge report`` and ``fedmerge plot``: pages and figures from run folders."""

from __future__ import annotations

from pathlib import Path

import typer

from fedmerge.cli.app import (
    app,
    fail,
    new_typer,
    notice,
    out,
    reason,
)


@app.command()
def report(
    paths: list[Path] = typer.Argument(..., help="run folders, sweep folders, or folders holding them"),
    out_path: Path = typer.Option(Path("report.html"), "--out", "-o", help="the HTML file to write"),
    title: str | None = typer.Option(None, "--title", help="page title"),
) -> None:
    """One self-contained HTML page: tables, curves, partitions, budgets, merge weights, commands."""
    from fedmerge.report.data import NoRuns
    from fedmerge.report.html import build_report

    try:
        path = build_report(paths, out_path, title, notify=notice)
    except NoRuns as exc:
        fail(str(exc), 2)
    except OSError as exc:  # an unwritable -o
        fail(f"{out_path}: {exc.strerror or exc}", 2)
    out.print(f"report written to {path}", soft_wrap=True, highlight=False)


plot_app = new_typer(no_args_is_help=True, help="Plots drawn from run folders.")


app.add_typer(plot_app, name="plot")


@plot_app.command("figures")
def plot_figures_cmd(
    run_dir: Path = typer.Argument(..., help="a finished run folder"),
    out_dir: Path | None = typer.Option(None, "--out", help="folder for the PNGs (default: RUN_DIR)"),
) -> None:
    """Every figure the run's method declares, as OUT/NAME.png (FedMerge: merge_weights; a plugin's own)."""
    from fedmerge.report.method_figures import draw_figures

    try:
        paths = draw_figures(run_dir, out_dir)
    except (OSError, ValueError) as exc:  # ValueError: no figure for this run, a plugin that cannot be imported
        fail(_plot_error(exc, out_dir), 2)
    for path in paths:
        out.print(f"plot saved to {path}", soft_wrap=True, highlight=False)


@plot_app.command("merge-weights")
def plot_merge_weights_cmd(
    run_dir: Path = typer.Argument(..., help="a FedMerge run folder"),
    out_path: Path | None = typer.Option(None, "--out", help="PNG path (default RUN_DIR/merge_weights.png)"),
    rounds: list[int] | None = typer.Option(None, "--round", help="round to show (repeatable; default: spread)"),
    panels: int = typer.Option(4, "--panels", min=1, help="number of rounds shown when --round is not given"),
) -> None:
    """Heatmaps of the merge weights (clients x global models) at several rounds, as the paper's Fig. 5."""
    from fedmerge.report.plot_merge_weights import plot_merge_weights

    if not (run_dir / "metrics.jsonl").exists():
        fail(f"{run_dir}: no metrics.jsonl; is it a run folder?", 2)
    try:
        path = plot_merge_weights(run_dir, out_path, rounds or None, panels)
    except (OSError, ValueError) as exc:
        fail(reason(exc), 2)
    out.print(f"plot saved to {path}", soft_wrap=True, highlight=False)


def _plot_error(exc: Exception, out_path: Path | None) -> str:
    """One line; it names ``--out`` only when writing there failed (a run folder that cannot be read is
    no fault of --out, which the user may not even have given)."""
    failed = getattr(exc, "filename", None)
    out = Path(out_path) if out_path is not None else None
    if isinstance(exc, OSError) and out is not None and failed is not None and Path(failed) in (out, *out.parents):
        return f"--out {out_path}: {reason(exc)}"
    return reason(exc)


@plot_app.command("lambda")
def plot_lambda_cmd(
    run_dir: Path = typer.Argument(..., help="a SuPerFed run folder"),
    out_path: Path | None = typer.Option(None, "--out", help="PNG path (default: in RUN_DIR)"),
    split: str = typer.Option("test", "--split", help="test or val"),
) -> None:
    """Accuracy along SuPerFed's line between the federated (0) and local (1) model (Fig. 3 / A2)."""
    from fedmerge.report.plot_lambda import plot_lambda

    try:
        path = plot_lambda(run_dir, out_path, split=split)
    except (OSError, ValueError) as exc:  # OSError: an unwritable --out
        fail(_plot_error(exc, out_path), 2)
    out.print(f"plot saved to {path}", soft_wrap=True, highlight=False)


@plot_app.command("budget")
def plot_budget_cmd(
    run_dirs: list[Path] = typer.Argument(..., help="finished run folders"),
    out_path: Path = typer.Option(Path("budget.png"), "--out", help="PNG path"),
) -> None:
    """Accuracy against server / communicated / per-client parameters (FedMerge Figs. 3-4)."""
    from fedmerge.report.plot_budget import plot_budget

    try:
        path = plot_budget(run_dirs, out_path)
    except (OSError, ValueError) as exc:  # OSError: an unwritable --out
        fail(_plot_error(exc, out_path), 2)
    out.print(f"plot saved to {path}", soft_wrap=True, highlight=False)


@plot_app.command("privacy")
def plot_privacy_cmd(
    paths: list[Path] = typer.Argument(..., help="run folders, or folders holding them (a study's runs folder)"),
    out_path: Path = typer.Option(Path("privacy.png"), "--out", help="PNG path"),
    table: Path | None = typer.Option(None, "--table", help="also write the figure's numbers here (Markdown)"),
    selection: str = typer.Option("last", "--round", help="last (the released model) or best_val"),
) -> None:
    """Privacy-utility curves: epsilon spent against accuracy, per method, mean ± std over seeds."""
    from fedmerge.report.data import NoRuns, find_runs
    from fedmerge.report.plot_privacy import SELECTIONS, plot_privacy

    if selection not in SELECTIONS:
        fail(f"--round {selection}: one of {', '.join(SELECTIONS)}", 2)
    try:
        run_dirs = [r.run_dir for r in find_runs(paths) if r.run_dir is not None]
        path = plot_privacy(run_dirs, out_path, table, selection)
    except NoRuns as exc:
        fail(str(exc), 2)
    except (OSError, ValueError) as exc:  # OSError: an unwritable --out or --table
        fail(reason(exc), 2)
    out.print(f"plot saved to {path}" + (f", numbers in {table}" if table else ""), soft_wrap=True, highlight=False)
