"""``fedmerge partition`` and ``fedmerge export-clients``: how a config splits the data, one file per client."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from fedmerge.cli.app import (
    CONFIG_AND_OVERRIDES,
    app,
    err,
    fail,
    notice,
    out,
    reason,
    split_args,
    user_errors,
)


@app.command()
def partition(
    args: list[str] = CONFIG_AND_OVERRIDES,
    plot: Path | None = typer.Option(None, "--plot", help="save a per-client class histogram (PNG)"),
) -> None:
    """Print (and optionally plot) how a config splits the data among clients."""
    from fedmerge.config.schema import load_config
    from fedmerge.run.prepare import data_warnings, load_data

    config_path, overrides = split_args(args)
    try:
        with data_warnings(notice):
            data = load_data(load_config(config_path, overrides))
    except user_errors() as exc:
        fail(str(exc), 2)
    out.print(data.summary_table(), highlight=False)
    if plot is not None:
        try:
            data.plot_summary(plot)
        except (OSError, ValueError) as exc:  # an unwritable folder, an unknown image format
            fail(f"--plot {plot}: {reason(exc)}", 2)
        out.print(f"plot saved to {plot}", soft_wrap=True, highlight=False)


@app.command("export-clients")
def export_clients_cmd(
    args: list[str] = typer.Argument(
        None, metavar="[CONFIG] [KEY=VALUE...] OUT_DIR", help="a config and overrides as for run, then the folder"
    ),
    force: bool = typer.Option(False, "--force", help="write into a non-empty folder, replacing its client files"),
    pooled_test: bool = typer.Option(
        False, "--pooled-test", help="also write pooled-test.safetensors (every client's test split) for the server"
    ),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="progress bar"),
) -> None:
    """Write one file per client (its train/val/test tensors), so that each node holds only its own data.

    Each file is self-contained: it also names the classes and the input shape."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from fedmerge.config.schema import defaults_left_out, load_config
    from fedmerge.data.client_files import POOLED_FILE, check_out_dir, export_clients, source_digest, write_pooled_test
    from fedmerge.run.prepare import load_data

    args = list(args or [])
    if not args or "=" in args[-1]:
        fail("missing OUT_DIR: fedmerge export-clients [CONFIG] [KEY=VALUE...] OUT_DIR", 2)
    config_path, overrides = split_args(args[:-1])
    out_dir = Path(args[-1])
    try:
        cfg = load_config(config_path, overrides)
        check_out_dir(out_dir, force=force)  # before the (slow) data build
        data = load_data(cfg)
        sections = {"dataset", "partition", "split", "noise", "seed"}
        data_config = cfg.model_dump(mode="json", include=sections, exclude=defaults_left_out(cfg))
        digest = source_digest(data_config)
        data_config["dataset"].pop("data_dir", None)  # where the data sat is no part of it
        source = json.dumps(data_config, sort_keys=True)
        columns = (TextColumn("export-clients"), BarColumn(), MofNCompleteColumn())
        with Progress(*columns, console=err, transient=True, disable=not progress) as bar:
            task = bar.add_task("", total=data.num_clients)
            paths = export_clients(
                data, out_dir, source_digest=digest, source=source, force=force, on_written=lambda _: bar.advance(task)
            )
        if pooled_test:
            write_pooled_test(data, out_dir / POOLED_FILE, digest)
    except user_errors() as exc:
        fail(str(exc), 2)
    shape = "x".join(map(str, data.input_shape))
    out.print(
        f"wrote {len(paths)} client files{' and ' + POOLED_FILE if pooled_test else ''} to {out_dir} "
        f"({data.name}, {data.num_classes} classes, input {shape})",
        highlight=False,
        soft_wrap=True,
    )
