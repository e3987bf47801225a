"""``fedmerge data``: fetch the papers' datasets (verified) and list what is known and cached."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from fedmerge.cli.app import app, fail, lazy_help, new_typer

if TYPE_CHECKING:
    from fedmerge.data.catalog import DatasetFiles

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


def download_text(entry: DatasetFiles) -> str:
    """A dataset's download size; "~" where some file's size is only approximately known."""
    text = human(entry.download_size)
    return f"~{text}" if entry.size_is_approximate and entry.download_size is not None else text


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
        present = entry.locate(dir)  # in NAME/ or where torchvision keeps them
        status = "cached" if len(present) == len(entry.files) else ("partial" if present else "-")
        if verify and present and check_dataset(entry.name, dir):
            status = "DAMAGED"
        disk = human(sum(p.stat().st_size for p in present.values())) if present else "-"
        typer.echo(
            f"{entry.name:<18} {status:<10} {disk:>9} {download_text(entry):>9}  {entry.papers}; {entry.licence}"
        )
    typer.echo(f"fetch one with `fedmerge data fetch NAME` (files go to {root}/NAME)")


@data_app.command("instructions", cls=lazy_help(dir=dir_help))
def instructions(
    name: str = typer.Argument(..., help="xnli or xquad (fetched first with `fedmerge data fetch NAME`)"),
    out: Path = typer.Option(..., "--out", "-o", help="the JSON file to write (dataset.path of `instructions`)"),
    per_language: int | None = typer.Option(
        None,
        "--per-language",
        help="a seeded draw of this many items, the same in every language (default: all; "
        "FedMerge: 500 for XNLI, 300 train + 200 evaluation)",
    ),
    languages: str | None = typer.Option(None, "--languages", help="comma-separated codes (default: all)"),
    split: str = typer.Option("test", "--split", help="XNLI's release split: test (5,010 pairs) or dev (2,490)"),
    seed: int = typer.Option(0, "--seed", help="seed of the --per-language draw"),
    dir: Path | None = typer.Option(None, "--data-dir", "--dir"),  # noqa: A002
    download: bool = typer.Option(False, "--download", help="fetch the files first when missing"),
) -> None:
    """Write XNLI or XQuAD as Alpaca-format instruction records (category = language), FedMerge Table 5's
    data, for `dataset.name=instructions`."""
    import json

    from fedmerge.data.errors import DataUnavailable
    from fedmerge.data.sources.multilingual import build_instructions

    if name not in ("xnli", "xquad"):
        fail(f"instruction records are built for xnli and xquad, not {name!r}", 2)
    if split not in ("test", "dev"):
        fail(f"--split: test or dev, not {split!r}", 2)
    langs = [s.strip() for s in languages.split(",") if s.strip()] if languages else None
    try:
        records = build_instructions(name, dir, download, split, langs, per_language, seed)
    except DataUnavailable as exc:
        fail(str(exc), 1)
    except ValueError as exc:
        fail(str(exc), 2)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    count = len({r["category"] for r in records})
    typer.echo(f"{name}: {len(records)} records in {count} languages written to {out}")
