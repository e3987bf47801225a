"""What a method knows about its own outputs, declared next to it: the optional hooks of an algorithm's registry entry.

A method registers them with itself
(``@ALGORITHMS.register(name, config=..., description=..., hooks=MethodHooks(...))``) and the floors that write and
read run folders call them by the run's algorithm name, so that no generic floor names a method:

- ``summary_extras(rows, info) -> dict``: fields added to ``summary.json`` when a run ends (FedMerge, IFCA and
  FedEM: ``cluster_recovery``), from the run's metric rows and the summary's run-wide fields so far (``info``:
  ``algorithm``, ``num_clients``, ``client_groups``, ...); ``summary_lines(summary) -> list[str]``: their lines in
  ``summary.md`` and after ``fedmerge run``;
- ``report_figures``: [`ReportFigure`][fedmerge.core.method_hooks.ReportFigure]s drawn from a finished run folder
  (FedMerge's merge weights, SuPerFed's lambda line) into the HTML report and by ``fedmerge plot figures``.

Config warnings are the config class's own ``AlgorithmConfig.warnings(rounds)``; command groups come through the
``fedmerge.cli`` entry point (docs/api/plugins.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Rows = list[dict[str, Any]]


def _no_groups() -> list[int] | None:
    return None


@dataclass(frozen=True)
class RunFolder:
    """A run folder read back for a figure: its path, its metric rows (``metrics.jsonl``, one dict a round), its
    ``summary.json`` (empty before the run ended) and the true group of each client when the partition has groups
    (``client_groups()``: made when asked for, since an old run's groups are rebuilt from its data)."""

    path: Path
    rows: Rows
    summary: dict[str, Any]
    find_groups: Callable[[], list[int] | None] = _no_groups

    def client_groups(self) -> list[int] | None:
        return self.find_groups()


@dataclass(frozen=True)
class ReportFigure:
    """One kind of figure a method draws from a run folder.

    ``name``: a short id (the HTML section's anchor, the PNG's file name in ``fedmerge plot figures``); ``title``:
    the section heading; ``note``: a sentence under it; ``applies(run)``: whether this run logged what the figure
    shows (a figure that raises is shown as "not drawn: ..."); ``draw(run, path)``: write a PNG to ``path``.
    ``empty``: what the report's section says when no run drew it; ``order``: sections appear by it, then by
    name (the built-in figures: 10, 20, ...). Methods that log the same thing share one figure object (one report
    section).
    """

    name: str
    title: str
    draw: Callable[[RunFolder, Path], Any]
    applies: Callable[[RunFolder], bool] = lambda run: True
    note: str = ""
    empty: str = "No run drew this figure."
    order: int = 100


@dataclass(frozen=True)
class MethodHooks:
    """The optional hooks of an algorithm's registry entry (all default to nothing)."""

    summary_extras: Callable[[Rows, dict[str, Any]], dict[str, Any]] | None = None
    summary_lines: Callable[[dict[str, Any]], list[str]] | None = None
    report_figures: tuple[ReportFigure, ...] = ()

    def extras(self, rows: Rows, info: dict[str, Any]) -> dict[str, Any]:
        return dict(self.summary_extras(rows, info)) if self.summary_extras is not None else {}

    def lines(self, summary: dict[str, Any]) -> list[str]:
        return list(self.summary_lines(summary)) if self.summary_lines is not None else []


NO_HOOKS = MethodHooks()
