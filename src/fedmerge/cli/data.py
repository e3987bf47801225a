"""``fedmerge data``: fetch the papers' datasets (verified) and list what is known and cached."""

from __future__ import annotations

from pathlib import Path

import typer

from fedmerge.cli.app import app, fail, lazy_help, new_typer

# fedmerge.data is imported when a command runs or shows its help (importing it imports torch): `fedmerge --help`
# and the other commands start without it

data_app = new_typer(
    help="Download the papers' datasets (checksums verified, resumable) and list them.", no_args_is_help=True
)
app.add_typer(data_app, name="data")


def dir_help() -> str:
    from fedmerge.data.download import DATA_DIR_ENV

    return f"cache root (default: ${DATA_DIR_ENV}, else ~/.cache/fedmerge/data)"


def name_help() -> str:
    from fedmerge.data.catalog import CATALOG

    return f"one of: {', '.join(CATALOG.names())}"


def human(size: int | None) -> str:
    if size is None:
        return "?"
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def mirror_help() -> str:
    from fedmerge.data.download import MIRROR_ENV

    return f"a mirror tried first (repeatable): a base URL or folder holding NAME/FILE (default: ${MIRROR_ENV})"


@data_app.command("fetch", cls=lazy_help(name=name_help, dir=dir_help, mirror=mirror_help))
def fetch(
    name: str = typer.Argument(...),
    dir: Path | None = typer.Option(None, "--data-dir", "--dir"),  # noqa: A002
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bars, no download messages"),
    mirror: list[str] | None = typer.Option(None, "--mirror"),
) -> None:
    """Download NAME's files, verify each against its pinned checksum, keep them in the cache."""
    from fedmerge.data.catalog import CATALOG, fetch_dataset
    from fedmerge.data.errors import DataUnavailable

    known_dataset(name)
    try:
        folder = fetch_dataset(name, dir, progressbar=not quiet, mirrors=mirror or None)
    except DataUnavailable as exc:
        fail(str(exc), 1)
    entry = CATALOG.get(name)
    typer.echo(f"{name}: {len(entry.files)} file(s) verified in {folder} ({human(folder_size(folder))})")


def known_dataset(name: str) -> None:
    from fedmerge.data.catalog import CATALOG

    if name not in CATALOG.names():  # an input error (2), unlike a failed download (1)
        from fedmerge.config.schema_docs import did_you_mean

        close = did_you_mean(name, CATALOG.names())
        fail(f"no downloadable dataset {name!r}{close or '; known: ' + ', '.join(CATALOG.names())}", 2)


@data_app.command("add", cls=lazy_help(name=name_help, dir=dir_help))
def add(
    name: str = typer.Argument(...),
    file: Path = typer.Argument(..., help="your copy of one of NAME's files (an institute's archive, a mirror's)"),
    checksum: str = typer.Option(..., "--checksum", help="its SHA-256 (hex, or sha256:HEX), which FILE must match"),
    as_: str | None = typer.Option(None, "--as", help="which of NAME's files it is (default: FILE's own name)"),
    dir: Path | None = typer.Option(None, "--data-dir", "--dir"),  # noqa: A002
) -> None:
    """Register a local copy of one of NAME's files with its own checksum: it is copied into the cache and
    every later use is checked against that checksum instead of the published one."""
    from fedmerge.data.catalog import CATALOG, register_file
    from fedmerge.data.errors import DataUnavailable

    known_dataset(name)
    try:
        target, own = register_file(CATALOG.get(name), file, checksum, as_, dir)
    except (DataUnavailable, ValueError) as exc:
        fail(str(exc).splitlines()[0], 1)
    note = "registered with its own checksum (the publisher's differs)" if own else "the published file"
    typer.echo(f"{name}: {target.name} verified and added to {target.parent}: {note}")


@data_app.command("list", cls=lazy_help(dir=dir_help))
def list_(
    dir: Path | None = typer.Option(None, "--data-dir", "--dir"),  # noqa: A002
    verify: bool = typer.Option(False, "--verify", help="also check every cached file's checksum (reads them all)"),
) -> None:
    """Known datasets: cached or not, size, where, licence."""
    from fedmerge.data.catalog import CATALOG, check_dataset
    from fedmerge.data.download import resolve_data_dir

    root = resolve_data_dir(dir)
    typer.echo(f"data dir: {root}")
    typer.echo(f"{'name':<18} {'status':<10} {'on disk':>9} {'download':>9}  papers; licence")
    for entry in CATALOG.entries():
        folder = entry.folder(dir)
        present = [f for f in entry.files if (folder / f.name).is_file()]
        status = "cached" if len(present) == len(entry.files) else ("partial" if present else "-")
        if verify and present and check_dataset(entry.name, dir):
            status = "DAMAGED"
        disk = human(folder_size(folder)) if present else "-"
        typer.echo(
            f"{entry.name:<18} {status:<10} {disk:>9} {human(entry.download_size):>9}  {entry.papers}; {entry.licence}"
        )
    typer.echo(f"fetch one with `fedmerge data fetch NAME` (files go to {root}/NAME)")
