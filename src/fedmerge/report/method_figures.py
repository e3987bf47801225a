"""The figures a run's method declares (its registry hooks' ``report_figures``), drawn from the run folder: the HTML
report's method sections and ``fedmerge plot figures``. No method is named here; a plugin's figures come the same
way, its module imported from the run's ``plugins:`` key (or its installed entry point) first."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from fedmerge.algorithms import ALGORITHMS
from fedmerge.core.method_hooks import ReportFigure, RunFolder
from fedmerge.core.plugins import import_plugins, load_installed
from fedmerge.report.plot_merge_weights import client_groups
from fedmerge.run.records import read_lines
from fedmerge.run.results import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE
from fedmerge.run.run_records import read_summary


def _config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / CONFIG_FILE
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def method_of(run_dir: Path) -> str | None:
    """The run's algorithm name (summary.json, else config.yaml), its plugins imported so that its hooks are known;
    a plugin that cannot be imported is a one-line ``PluginError``."""
    config = _config(run_dir)
    load_installed()
    import_plugins(config.get("plugins") or (), f"{run_dir}: plugins")
    summary = run_dir / SUMMARY_FILE
    name = read_summary(summary).algorithm if summary.is_file() else None
    return name or (config.get("algorithm") or {}).get("name")


def read_run_folder(run_dir: str | Path) -> RunFolder:
    """A run folder read back (metric rows, summary, the clients' true groups when asked for), as figures and
    a plugin's commands read it; a folder without ``metrics.jsonl`` is a one-line ``ValueError``."""
    run_dir = Path(run_dir)
    if not (run_dir / METRICS_FILE).is_file():
        raise ValueError(f"{run_dir}: no {METRICS_FILE}; is it a run folder?")
    summary = run_dir / SUMMARY_FILE
    return RunFolder(
        path=run_dir,
        rows=read_lines(run_dir / METRICS_FILE)[0],  # the rows written whole
        summary=read_summary(summary).to_dict() if summary.is_file() else {},  # plugins read the JSON object
        find_groups=lambda: client_groups(run_dir),
    )


def figures_of(run: RunFolder) -> list[ReportFigure]:
    """The figures of the run's method that apply to this run (it logged what they show)."""
    return [f for f in ALGORITHMS.hooks(method_of(run.path)).report_figures if f.applies(run)]


def figure_kinds(methods: Iterable[str] = ()) -> list[ReportFigure]:
    """The figures that fedmerge's own methods and ``methods`` (those of a page's runs) declare, once each (methods
    may share one), by ``order`` then name: a plugin's section is on a page only when one of its runs is."""
    wanted = set(methods)
    kinds: dict[str, ReportFigure] = {}
    for entry in ALGORITHMS.entries():
        if entry.name not in wanted and not entry.obj.__module__.startswith("fedmerge."):
            continue
        for figure in ALGORITHMS.hooks(entry.name).report_figures:
            kinds.setdefault(figure.name, figure)
    return sorted(kinds.values(), key=lambda f: (f.order, f.name))


def draw_figures(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Every figure the run's method declares for it, as ``OUT_DIR/<name>.png`` (default: the run folder)."""
    run = read_run_folder(run_dir)
    run_dir = run.path
    figures = figures_of(run)
    if not figures:
        raise ValueError(f"{run_dir}: its method ({method_of(run_dir)}) declares no figure for this run")
    out_dir = run_dir if out_dir is None else Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for figure in figures:
        path = out_dir / f"{figure.name}.png"
        figure.draw(run, path)
        paths.append(path)
    return paths
