"""``fedmerge report RUN_DIR_OR_SWEEP... -o report.html``: one self-contained HTML page.

No network and no scripts: the CSS is inline and every figure is a matplotlib PNG inlined as base64.
The page shows the comparison tables, learning curves per method (seeds as a +- std band), per-client
accuracy distributions, the partition of each setting, the parameter budget, the figures each run's method
declares (its registry hooks: FedMerge's merge-weight heatmaps, SuPerFed's lambda curves), privacy-utility
curves (epsilon against accuracy) where runs used differential privacy, the failures, and per run its resolved
config and the commands that made it (from ``provenance.jsonl``).
"""

from __future__ import annotations

import base64
import io
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedmerge.report.compare import COLUMNS, DONE, FAILED, RunRecord, SettingTable, columns, compare, row_cells
from fedmerge.report.data import (
    band,
    client_accuracies,
    find_runs,
    in_progress_notes,
    learning_curve,
)
from fedmerge.report.method_figures import figure_kinds, figures_of, method_of, read_run_folder
from fedmerge.run.provenance import package_version, read_provenance
from fedmerge.run.results import CONFIG_FILE

TEMPLATE_DIR = Path(__file__).parent / "templates"


@dataclass
class Figure:
    title: str
    png: str | None  # base64; None when it could not be drawn
    note: str = ""


@dataclass
class MethodSection:
    """The figures of one kind that the runs' methods declare (``ReportFigure``), one per method and setting."""

    anchor: str
    title: str
    note: str
    empty: str
    figures: list[Figure] = field(default_factory=list)


@dataclass
class Report:
    title: str
    generated: str
    version: str
    counts: dict[str, int]
    tables: list[SettingTable]
    columns: tuple[str, ...] = COLUMNS
    curves: list[Figure] = field(default_factory=list)
    clients: list[Figure] = field(default_factory=list)
    partitions: list[Figure] = field(default_factory=list)
    budget: Figure | None = None
    method_sections: list[MethodSection] = field(default_factory=list)
    privacy: list[Figure] = field(default_factory=list)
    not_private: list[str] = field(default_factory=list)  # runs whose DP noise follows from the seed
    runs: list[dict[str, Any]] = field(default_factory=list)
    problems: list[RunRecord] = field(default_factory=list)

    def cells(self, table: SettingTable, row: Any) -> list[str]:
        return row_cells(table, row)

    def table_columns(self, table: SettingTable) -> tuple[str, ...]:
        return columns(table)


def build_report(
    paths: list[Path], out: Path, title: str | None = None, notify: Callable[[str], None] | None = None
) -> Path:
    """Write the page for the runs found under ``paths``; raises ``NoRuns`` when there are none.
    ``notify``: one line per run that a live process is still writing."""
    records = find_runs(paths)
    for line in in_progress_notes(records):
        (notify or (lambda message: None))(line)
    report = Report(
        title=title or "fedmerge report: " + ", ".join(p.name or str(p) for p in paths),
        generated=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        version=package_version(),
        counts={s: sum(r.status == s for r in records) for s in dict.fromkeys(r.status for r in records)},
        tables=compare(records),
    )
    colors = {m: f"C{i % 10}" for i, m in enumerate(dict.fromkeys(r.method for r in records))}
    settings = list(dict.fromkeys(r.setting for r in records))
    drawn: dict[str, list[Figure]] = {}  # figure name -> one per method and setting
    methods: set[str] = set()  # the algorithms of the runs drawn from
    for setting in settings:
        mine = [r for r in records if r.setting == setting and r.run_dir is not None]
        report.curves.append(_safe(f"{setting}", lambda m=mine: _curves_figure(m, colors)))
        report.clients.append(_safe(f"{setting}", lambda m=mine: _clients_figure(m, colors)))
        first = min((r for r in mine if (r.run_dir / CONFIG_FILE).is_file()), key=lambda r: r.seed, default=None)
        if first is not None:
            report.partitions.append(_safe(f"{setting} (seed {first.seed})", lambda r=first: _partition_png(r)))
        for method in dict.fromkeys(r.method for r in mine):
            run = next((r for r in mine if r.method == method and r.status == DONE), None)
            if run is None:
                continue
            try:
                folder = read_run_folder(run.run_dir)
                figures = figures_of(folder)
                methods.add(method_of(run.run_dir) or "")
            except ValueError as exc:  # a plugin that cannot be imported (PluginError): its figures are left out
                (notify or (lambda message: None))(f"warning: {exc}")
                continue
            for figure in figures:
                drawn.setdefault(figure.name, []).append(
                    _safe(f"{setting}: {run.key}", lambda f=figure, r=folder: _png_file(lambda path: f.draw(r, path)))
                )
        done_here = [r.run_dir for r in mine if r.status == DONE]
        if any(r.summary is not None and r.summary.has("privacy") for r in mine if r.status == DONE):
            report.privacy.append(_safe(f"{setting}", lambda d=done_here: _privacy_png(d)))
    report.method_sections = [
        MethodSection(f.name.replace("_", "-"), f.title, f.note, f.empty, drawn.get(f.name, []))
        for f in figure_kinds(methods)
    ]
    done = [r for r in records if r.status == DONE]
    if done:
        report.budget = _safe("mean over seeds of each method and setting", lambda: _budget_png(done))
    report.not_private = [r.key for r in records if r.summary is not None and r.summary.private is False]
    report.runs = [_run_details(r) for r in records]
    report.problems = [r for r in records if r.status != DONE]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(report), encoding="utf-8")
    return out


def render(report: Report) -> str:
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR), autoescape=True, undefined=jinja2.StrictUndefined
    )
    return env.get_template("report.html.j2").render(r=report, FAILED=FAILED)


# --- figures -----------------------------------------------------------------------------------


def _safe(title: str, draw: Callable[[], str]) -> Figure:
    """A figure that fails to draw (data gone, an old run) becomes a note, not a broken page."""
    try:
        return Figure(title, draw())
    except Exception as exc:  # noqa: BLE001
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return Figure(title, None, f"not drawn: {first}")


def _new_figure(width: float, height: float, cols: int = 1) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure as MplFigure

    fig = MplFigure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # no pyplot: nothing global changes
    return fig, fig.subplots(1, cols, squeeze=False)[0]


def png_of(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _png_file(draw: Callable[[Path], Any]) -> str:
    """Run a plot function that writes a PNG file and return the file as base64."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "figure.png"
        draw(path)
        return base64.b64encode(path.read_bytes()).decode("ascii")


def _curves_figure(records: list[RunRecord], colors: dict[str, str]) -> str:
    fig, (acc_ax, loss_ax) = _new_figure(11, 3.6, cols=2)
    for method in dict.fromkeys(r.method for r in records):
        curves = [learning_curve(r.run_dir) for r in records if r.method == method]
        n = len(curves)
        for ax, x, y in ((acc_ax, "eval_rounds", "test_acc"), (loss_ax, "rounds", "train_loss")):
            rounds, mean, std = band([(c[x], c[y]) for c in curves if c[x]])
            if len(rounds) == 0:
                continue
            ax.plot(
                rounds, mean, "o-" if len(rounds) < 15 else "-", ms=3, color=colors[method], label=f"{method} ({n})"
            )
            if n > 1:
                ax.fill_between(rounds, mean - std, mean + std, color=colors[method], alpha=0.2)
    if not acc_ax.lines and not loss_ax.lines:
        raise ValueError("no round finished")
    acc_ax.set(xlabel="round", ylabel="mean client test accuracy", title="test accuracy (mean ± std over seeds)")
    loss_ax.set(xlabel="round", ylabel="train loss", title="train loss (mean ± std over seeds)")
    for ax in (acc_ax, loss_ax):
        ax.grid(alpha=0.3)
    (acc_ax if acc_ax.lines else loss_ax).legend(fontsize="small", title="method (seeds)", title_fontsize="small")
    return png_of(fig)


def _clients_figure(records: list[RunRecord], colors: dict[str, str]) -> str:
    methods = list(dict.fromkeys(r.method for r in records))
    data = [[a for r in records if r.method == m for a in client_accuracies(r)] for m in methods]
    keep = [(m, d) for m, d in zip(methods, data) if d]
    if not keep:
        raise ValueError("no evaluated round yet")
    fig, (ax,) = _new_figure(max(5.0, 1.3 * len(keep) + 2), 3.6)
    parts = ax.boxplot([d for _, d in keep], patch_artist=True, widths=0.6)
    for patch, (m, _) in zip(parts["boxes"], keep):
        patch.set_facecolor(colors[m])
        patch.set_alpha(0.45)
    for i, (m, d) in enumerate(keep, start=1):  # every client (of every seed) as a dot
        jitter = [i + 0.18 * ((k * 0.618) % 1 - 0.5) for k in range(len(d))]
        ax.scatter(jitter, d, s=8, color=colors[m], alpha=0.7, zorder=3)
    ax.set_xticks(range(1, len(keep) + 1), [m for m, _ in keep], rotation=20 if len(keep) > 4 else 0)
    ax.set(ylabel="client test accuracy", title="clients at the best-validation round")
    ax.grid(alpha=0.3, axis="y")
    return png_of(fig)


def _partition_png(record: RunRecord) -> str:
    from fedmerge.config.schema import load_config
    from fedmerge.run.prepare import load_data

    data = load_data(load_config(record.run_dir / CONFIG_FILE))
    return png_of(data.summary_figure())


def _budget_png(records: list[RunRecord]) -> str:
    """``fedmerge plot budget``'s figure with one point per method and setting: the seeds' mean."""
    from fedmerge.report.plot_budget import AXES, budget_figure, budget_point

    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        point = {**budget_point(r.run_dir), "label": r.method}
        key = repr([point[k] for k in ("label", "dataset", "setting", *(a for a, _ in AXES))])
        groups.setdefault(key, []).append(point)
    points = [{**g[0], "accuracy": sum(p["accuracy"] for p in g) / len(g)} for g in groups.values()]
    return png_of(budget_figure(points))


def _privacy_png(run_dirs: list[Path]) -> str:
    from fedmerge.report.plot_privacy import privacy_figure, read_curves

    return png_of(privacy_figure(read_curves(run_dirs)))


# --- runs --------------------------------------------------------------------------------------


def _run_details(record: RunRecord) -> dict[str, Any]:
    config = ""
    segments: list[dict[str, Any]] = []
    if record.run_dir is not None:
        path = record.run_dir / CONFIG_FILE
        config = path.read_text() if path.is_file() else ""
        segments = read_provenance(record.run_dir)
    return {
        "record": record,
        "config": config,
        "segments": segments,
        "not_private": record.summary is not None and record.summary.private is False,
        "commits": sorted({(s.get("commit") or "?")[:10] + ("+dirty" if s.get("dirty") else "") for s in segments}),
    }
