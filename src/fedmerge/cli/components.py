"""``fedmerge list`` / ``show``: the registered components and every option of one."""

from __future__ import annotations

from typing import Any

import typer
from rich.markup import escape
from rich.padding import Padding
from rich.table import Table

from fedmerge.cli.app import (
    app,
    fail,
    out,
)

KIND_ARG = typer.Argument(
    None,
    help="algorithm, dataset, partition, model, study (the packaged paper studies), or a section: run, split, "
    "noise, flower, log, state",
)


NAME_ARG = typer.Argument(None, help="a registered name (e.g. fedmerge): print its options")


@app.command("list")
def list_components(kind: str | None = KIND_ARG, name: str | None = NAME_ARG) -> None:
    """Show the registered components, or every option of one: fedmerge list algorithm fedmerge."""
    index = _built_in_index()
    if index is not None and (kind is None or (_INDEX_KINDS.get(kind.lower()) in index and name is None)):
        _print_listing(index, None if kind is None else _INDEX_KINDS[kind.lower()])  # nothing imported: fast
        return
    from fedmerge.config import catalog
    from fedmerge.config.schema import ConfigError, load_plugins

    try:
        load_plugins(())  # the installed plugins' components are listed too
    except ConfigError as exc:
        fail(str(exc), 2)

    if kind == "study":
        _print_studies()
        return
    if kind is None:
        _print_listing({k: [(e.name, e.description) for e in r.entries()] for k, r in catalog.REGISTRIES.items()})
        return
    resolved = catalog.kind_of(kind)
    if resolved is None:  # `fedmerge list fedmerge`: a component name on its own
        hits = catalog.find_component(kind) if name is None else []
        if len(hits) != 1:
            fail(f"unknown kind {kind!r}; expected one of {', '.join(catalog.kinds())}", 2)
        resolved, name = hits[0]
    if resolved in catalog.REGISTRIES and name is None:
        registry = catalog.REGISTRIES[resolved]
        _print_listing({resolved: [(e.name, e.description) for e in registry.entries()]}, resolved)
        return
    _print_options(resolved, name)


@app.command("show")
def show_component(kind: str = typer.Argument(..., help=KIND_ARG.help), name: str | None = NAME_ARG) -> None:
    """Every option of a component or section, with type, default and description (as list KIND NAME)."""
    list_components(kind, name)


def _print_studies() -> None:
    """The packaged paper studies: name, paper table, setting, GPU hours and downloads."""
    from fedmerge.study.paper_table import hours_text, rows, totals

    items = rows()
    table = Table(title="packaged studies (fedmerge study NAME; --dry-run: their runs and cost)", title_justify="left")
    for column in ("name", "paper, table", "setting", "GPU hours (one H100)", "downloads"):
        table.add_column(column, style="bold" if column == "name" else None, overflow="fold", no_wrap=column == "name")
    for r in items:
        table.add_row(r["name"], r["paper"], escape(r["setting"]), hours_text(r), escape(r["downloads"]))
    out.print(table)
    by_paper = totals(items)
    each = ", ".join(f"{p} {v:,.0f}" for p, v in by_paper.items())
    out.print(f"together about {sum(by_paper.values()):,.0f} GPU hours once shared runs are reused ({each})",
              highlight=False, soft_wrap=True)  # fmt: skip


# the registry kinds and the words `fedmerge list` takes for them (catalog.kind_of's, without importing it)
_INDEX_KINDS = {"algorithm": "algorithm", "algorithms": "algorithm", "dataset": "dataset", "datasets": "dataset"}
_INDEX_KINDS |= {"partition": "partition", "partitions": "partition", "partitioner": "partition"}
_INDEX_KINDS |= {"partitioners": "partition", "model": "model", "models": "model"}


def _built_in_index() -> dict[str, list[tuple[str, str]]] | None:
    """The committed index of the built-in components, or None when installed plugins may add to them (their
    components are only known once imported)."""
    import os

    from fedmerge.config.registry_index import read_index
    from fedmerge.core.plugins import AUTOLOAD_OFF, installed_plugins

    if os.environ.get(AUTOLOAD_OFF, "") in ("", "0") and installed_plugins():
        return None
    return read_index()


def _print_listing(index: dict[str, list[tuple[str, str]]], kind: str | None = None) -> None:
    """Each kind's components (name, description); with no ``kind``, every kind and the papers' other names."""
    for each, rows in index.items():
        if kind not in (None, each):
            continue
        table = Table(title=f"{each}s", show_header=False, title_justify="left")
        table.add_column("name", style="bold")
        table.add_column("description")
        for name, text in rows:
            table.add_row(name, text)
        out.print(table)
    if kind is not None:
        out.print(f"options of one: fedmerge list {kind} NAME", highlight=False)
        return
    from fedmerge.config.known_as import KNOWN_AS

    known = Table(title="known by another name", show_header=False, title_justify="left")
    known.add_column("name", style="bold")
    known.add_column("is")
    for alias, (_, text) in KNOWN_AS.items():
        known.add_row(text.split(":", 1)[0] if ":" in text else alias, text.split(": ", 1)[-1])
    out.print(known)
    out.print(
        "options of one component: fedmerge list KIND NAME (e.g. fedmerge list algorithm fedmerge); "
        "other settings: fedmerge list run | split | noise | flower | log | state | unseen",
        soft_wrap=True,
        highlight=False,
    )


_MIN_DESCRIPTION = 40  # characters the description column needs to read as phrases


def _fixed_columns_width(rows: list[Any]) -> int:
    """Width of the key, type and default columns at their longest entries, with rich's borders and padding."""
    widest = [max((len(getattr(r, field)) for r in rows), default=0) for field in ("key", "type", "default")]
    return sum(widest) + 13  # 5 vertical borders + 2 padding spaces in each of 4 columns


def _print_options(kind: str, name: str | None) -> None:
    from fedmerge.config import catalog
    from fedmerge.config.schema_docs import describe

    try:
        cls = catalog.config_class(kind, name)
    except KeyError as exc:
        fail(str(exc.args[0]), 2)
    if kind in catalog.REGISTRIES:
        registered = cls.model_fields["name"].default
        alias = catalog.KNOWN_AS.get(str(name).lower())
        if alias is not None and name != registered:
            out.print(alias[1], highlight=False)
        title = (
            f"{kind}.name={registered}: {catalog.REGISTRIES[kind].get(registered).description}\n"
            f"set a key as {kind}.KEY=VALUE"
        )
        if kind == "dataset" and (fetched := fetched_text(registered)):
            out.print(escape(fetched), highlight=False)
    elif kind == "run":
        title = "top-level settings, set as KEY=VALUE (sections: fedmerge list)"
    else:
        title = f"{kind} settings, set as {kind}.KEY=VALUE"
    rows = describe(cls)
    if out.width - _fixed_columns_width(rows) < _MIN_DESCRIPTION:  # a squeezed description column reads as noise
        out.print(escape(title), highlight=False)
        for row in rows:
            head = f"[bold]{escape(row.key)}[/bold]  {escape(row.type)}, default {escape(row.default)}"
            out.print("\n" + head, highlight=False)
            out.print(Padding(escape(row.description), (0, 0, 0, 4), expand=False), highlight=False)
        return
    table = Table(title=escape(title), title_justify="left")
    for column in ("key", "type", "default", "description"):
        table.add_column(column, style="bold" if column == "key" else None, overflow="fold", no_wrap=column == "key")
    for row in rows:
        table.add_row(row.key, escape(row.type), escape(row.default), escape(row.description))
    out.print(table)


def fetched_text(name: str) -> str:
    """For a dataset ``fedmerge data fetch`` knows: its download size, licence and the fetch command."""
    from fedmerge.cli.data import download_text
    from fedmerge.data.catalog import CATALOG

    if name not in CATALOG.names():
        return ""
    entry = CATALOG.get(name)
    return (
        f"download {download_text(entry)} ({entry.title}; {entry.licence}): fedmerge data fetch {name}, "
        f"or dataset.download=true"
    )
