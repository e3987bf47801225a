"""``fedmerge plot budget RUN_DIRS...``: accuracy against parameter budgets (FedMerge Figs. 3-4, 7).

One point per run: the last evaluated round's mean personalised test accuracy against three budgets
(float values, from each run's summary.json), the paper's Appendix "Server / Communicate / Client":

- server: what the server stores (``parameters.server_state``);
- communicated: sent to plus received from one client per round (``communication_per_client_per_round``
  down + up; IFCA and FedEM send k or M models down);
- client: what a client stores, its persistent state plus the model(s) it receives
  (``parameter_budget.client_stored`` when the summary has it, else computed the same way).

Runs are grouped by dataset and setting (partition and label noise, from config.yaml): one row of
three panels per group. Within a group, runs of one algorithm are joined by a line in order of the x
value, so varying the number of global models or the architecture draws one curve per method. One
legend serves every panel: an algorithm has the same colour throughout.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from fedmerge.run.results import CONFIG_FILE, SUMMARY_FILE
from fedmerge.run.run_records import RunSummary, read_summary

AXES = (
    ("server", "server parameters"),
    ("communicated", "communicated parameters per client per round"),
    ("client", "parameters stored per client"),
)


def budget_point(run_dir: str | Path) -> dict[str, Any]:
    """{label, accuracy, server, communicated, client, dataset, setting} of one finished run."""
    path = Path(run_dir) / SUMMARY_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; is {run_dir} a finished run folder?")
    summary = read_summary(path)
    params, comm = summary.parameters, summary.communication_per_client_per_round
    accuracy = (summary.last.clients or {}).get("test_acc") if summary.last is not None else None
    if accuracy is None or params is None or comm is None:
        raise ValueError(f"{path}: no last test accuracy, parameters or communication (a run with no evaluated round?)")
    budget = summary.parameter_budget
    client = budget.client_stored if budget is not None else float(params.get("client_state_mean", 0.0)) + comm.down
    return {
        "label": str(summary.algorithm if summary.has("algorithm") else Path(run_dir).name),
        "accuracy": float(accuracy.mean),
        "server": float(params.get("server_state", math.nan)),
        "communicated": float(comm.down) + float(comm.up),
        "client": float(client),
        "dataset": str(summary.dataset if summary.has("dataset") else "?"),
        "setting": run_setting(Path(run_dir), summary),
    }


def run_setting(run_dir: Path, summary: RunSummary | None) -> dict[str, Any]:
    """The partition (and label noise, when there is any) the run was made under."""
    config = run_dir / CONFIG_FILE
    data = yaml.safe_load(config.read_text()) if config.exists() else None
    if not isinstance(data, dict):
        return {"partition": {"name": summary.partition if summary is not None and summary.has("partition") else "?"}}
    setting = {"partition": data.get("partition") or {}}
    noise = data.get("noise") or {}
    if noise.get("kind", "none") != "none":
        setting["noise"] = noise
    return setting


def setting_labels(settings: list[dict[str, Any]]) -> list[str]:
    """Short names for settings: the partition's name, plus the values that differ between settings
    with that partition (``dirichlet, alpha=0.1``), plus label noise when there is any."""
    flat = [{f"{part}.{k}": v for part, section in s.items() for k, v in section.items()} for s in settings]
    labels = []
    for f in flat:
        same = [g for g in flat if g.get("partition.name") == f.get("partition.name")]
        varying = [k for k in f if k != "partition.name" and len({repr(g.get(k)) for g in same}) > 1]
        varying += [k for k in ("noise.kind", "noise.rate") if k in f and k not in varying]
        extra = [f"{k.removeprefix('partition.')}={f[k]}" for k in varying]
        labels.append(", ".join([str(f.get("partition.name", "?")), *extra]))
    return labels


def group_points(points: list[dict[str, Any]]) -> list[tuple[tuple[str, str], list[dict[str, Any]]]]:
    """Runs grouped by (dataset, setting label), sorted; runs of different groups are never joined."""
    settings: list[dict[str, Any]] = []
    for p in points:
        if p["setting"] not in settings:
            settings.append(p["setting"])
    names = dict(zip(map(repr, settings), setting_labels(settings)))
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for p in points:
        groups.setdefault((p["dataset"], names[repr(p["setting"])]), []).append(p)
    return sorted(groups.items())


def budget_figure(points: list[dict[str, Any]]) -> Any:
    """The figure: one row of panels (server, communicated, client) per group, one shared legend."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    groups = group_points(points)
    labels = sorted({p["label"] for p in points})
    color = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    fig = Figure(figsize=(4.2 * len(AXES), 0.6 + 2.9 * len(groups)), layout="constrained")
    FigureCanvasAgg(fig)  # no pyplot: the caller's backend and open figures are untouched
    axes = fig.subplots(len(groups), len(AXES), sharey="row", squeeze=False)
    for row, ((dataset, setting), mine) in zip(axes, groups):
        for ax, (key, title) in zip(row, AXES):
            for label in labels:
                pts = sorted((p[key], p["accuracy"]) for p in mine if p["label"] == label)
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", color=color[label], markersize=5)
            _budget_axis(ax, [p[key] for p in mine])
            ax.grid(alpha=0.3)
            ax.set_xlabel(title, fontsize="small")
        row[0].set_title(f"{dataset}, {setting}", loc="left", fontsize="medium")
        row[0].set_ylabel("mean test accuracy")
    handles = [Line2D([], [], color=color[label], marker="o", label=label) for label in labels]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(labels), 6), frameon=False)
    return fig


def plot_budget(run_dirs: list[Path], out: Path) -> Path:
    """Draw accuracy against each budget (see [`budget_figure()`][fedmerge.report.plot_budget.budget_figure]); returns
    ``out`` (a PNG)."""
    if not run_dirs:
        raise ValueError("plot_budget needs at least one run folder")
    fig = budget_figure([budget_point(d) for d in run_dirs])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out


def _budget_axis(ax: Any, values: list[float]) -> None:
    """A log axis with at most about five ticks in engineering notation (10k, 1M); symmetric-log when
    some run has a budget of 0 (Local communicates nothing), so that 0 keeps its own place."""
    from matplotlib.ticker import EngFormatter, NullLocator

    positive = [v for v in values if v > 0 and math.isfinite(v)]
    if not positive:
        return
    lo, hi = min(positive), max(positive)
    ticks = log_ticks(lo, hi)
    if len(positive) < len(values):
        ax.set_xscale("symlog", linthresh=lo / 2, linscale=0.5)
        ticks = [0.0, *ticks]
        ax.set_xlim(-lo / 4, hi * 1.6)
    else:
        ax.set_xscale("log")
        ax.set_xlim(lo / 1.6, hi * 1.6)
    ax.set_xticks(ticks)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(EngFormatter(sep=""))


def log_ticks(lo: float, hi: float, most: int = 5) -> list[float]:
    """Round values (1, 2 or 5 times a power of ten) in [lo/1.6, hi*1.6]: powers of ten alone when at
    least two fit, else finer ones, at most ``most``."""
    first, last = math.floor(math.log10(lo / 1.6)), math.ceil(math.log10(hi * 1.6))
    for mantissas in ((1,), (1, 3), (1, 2, 5), (1, 1.5, 2, 3, 5, 7)):
        ticks = [m * 10.0**e for e in range(first, last + 1) for m in mantissas if lo / 1.6 <= m * 10.0**e <= hi * 1.6]
        if len(ticks) >= 2:
            return ticks[:: math.ceil(len(ticks) / most)]
    return [lo] if lo == hi else [lo, hi]
