"""Comparison tables: methods side by side per setting, mean +- std over seeds, a paired test.

For each setting and method: the mean client test accuracy at the best-validation round (the round
with the lowest mean validation loss: the model a practitioner would pick) and at the last round, the
worst-10% clients at the best-validation round, the parameter budget, and a paired t-test across seeds
(scipy's ``ttest_rel``) of each method against the best one on the seeds both finished. Failed runs
are counted and listed, never silently dropped.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedmerge.core.checkpoint import atomic_write_bytes
from fedmerge.run.results import DONE, FAILED, INCOMPLETE, PENDING, RunRecord  # noqa: F401  (re-exported)
from fedmerge.run.run_records import RunSummary, Selection, Stats
from fedmerge.sweep.runner import sweep_records


@dataclass
class Stat:
    by_seed: dict[int, float]

    @property
    def mean(self) -> float:
        return float(np.mean(list(self.by_seed.values())))

    @property
    def std(self) -> float:
        """Sample standard deviation over seeds (nan for one seed)."""
        vals = list(self.by_seed.values())
        return float(np.std(vals, ddof=1)) if len(vals) > 1 else math.nan


@dataclass
class MethodRow:
    method: str
    runs: list[RunRecord]
    best_val: Stat | None = None
    last: Stat | None = None
    worst10: Stat | None = None
    unseen: Stat | None = None  # clients that never trained (split.unseen_clients), at the best-validation round
    gap: Stat | None = None  # participation gap: participants' minus those clients' mean test accuracy
    p_value: float | None = None  # paired t-test against the best method
    n_paired: int = 0
    budget: dict[str, float] = field(default_factory=dict)

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.runs)


@dataclass
class SettingTable:
    setting: str
    rows: list[MethodRow]
    best: str | None  # the method with the highest mean at the best-validation round

    @property
    def failures(self) -> list[RunRecord]:
        return [r for row in self.rows for r in row.runs if r.status == FAILED]

    @property
    def diverged(self) -> list[RunRecord]:
        """Finished runs whose training blew up (``summary.json``'s ``diverged``): "done", but not trained."""
        return [r for row in self.rows for r in row.runs if r.status == DONE and r.summary and r.summary.diverged]

    @property
    def has_unseen(self) -> bool:
        """Whether some run of the setting had clients that never trained (two more columns then)."""
        return any(row.unseen is not None for row in self.rows)


def _stat(runs: list[RunRecord], value: Callable[[RunSummary], float | None]) -> Stat | None:
    """``value`` of each finished run's summary, by seed; None when no run has it."""
    values = {}
    for r in runs:
        v = value(r.summary) if r.status == DONE and r.summary is not None else None
        if v is not None:
            values[r.seed] = float(v)
    return Stat(values) if values else None


def _test_acc(part: Selection | None, unseen: bool = False) -> Stats | None:
    """A selection's test accuracy across the clients that trained (or, ``unseen``, those that never did)."""
    if part is None:
        return None
    return ((part.unseen if unseen else part.clients) or {}).get("test_acc")


def _best_mean(s: RunSummary) -> float | None:
    return None if (acc := _test_acc(s.best_val)) is None else acc.mean


def _last_mean(s: RunSummary) -> float | None:
    return None if (acc := _test_acc(s.last)) is None else acc.mean


def _best_worst10(s: RunSummary) -> float | None:
    return None if (acc := _test_acc(s.best_val)) is None else acc.worst10


def _unseen_mean(s: RunSummary) -> float | None:
    return None if (acc := _test_acc(s.best_val, unseen=True)) is None else acc.mean


def _gap(s: RunSummary) -> float | None:
    return ((s.best_val.participation_gap if s.best_val else None) or {}).get("test_acc")


def paired_p_value(a: dict[int, float], b: dict[int, float]) -> tuple[float | None, int]:
    """Two-sided paired t-test over the seeds both have; None when fewer than two pairs or when the
    differences are all equal (the t statistic is undefined)."""
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return None, len(seeds)
    from scipy.stats import ttest_rel

    diff = np.array([a[s] - b[s] for s in seeds])
    if np.allclose(diff, diff[0], rtol=0, atol=1e-12):
        return None, len(seeds)
    return float(ttest_rel([a[s] for s in seeds], [b[s] for s in seeds]).pvalue), len(seeds)


def budget_of(runs: list[RunRecord]) -> dict[str, float]:
    for r in runs:
        b = r.summary.parameter_budget if r.summary is not None else None
        if r.status == DONE and b:
            return {
                "client_optimized": b.client_optimized,
                "communicated": b.down_per_client_round + b.up_per_client_round,
                "server_stored": b.server_stored,
            }
    return {}


def compare(records: list[RunRecord]) -> list[SettingTable]:
    """One table per setting, in the order settings and methods first appear."""
    tables = []
    for setting in dict.fromkeys(r.setting for r in records):
        mine = [r for r in records if r.setting == setting]
        rows = []
        for method in dict.fromkeys(r.method for r in mine):
            runs = [r for r in mine if r.method == method]
            row = MethodRow(method, runs, _stat(runs, _best_mean), _stat(runs, _last_mean))
            row.worst10 = _stat(runs, _best_worst10)
            row.unseen, row.gap = _stat(runs, _unseen_mean), _stat(runs, _gap)
            row.budget = budget_of(runs)
            rows.append(row)
        ranked = [r for r in rows if r.best_val is not None]
        best = max(ranked, key=lambda r: r.best_val.mean) if ranked else None
        for row in ranked:
            if row is not best:
                row.p_value, row.n_paired = paired_p_value(row.best_val.by_seed, best.best_val.by_seed)
        tables.append(SettingTable(setting, rows, best.method if best else None))
    return tables


# --- rendering ---------------------------------------------------------------------------------

COLUMNS = (
    "method",
    "seeds",
    "test acc @ best val",
    "test acc @ last",
    "worst 10% @ best val",
    "p vs best (paired t)",
    "client params",
    "communicated / client / round",
    "server params",
)


# the same columns, short enough for a terminal
SHORT_COLUMNS = (
    "method",
    "seeds",
    "acc@best-val",
    "acc@last",
    "worst10%",
    "p vs best",
    "client params",
    "comm/round",
    "server params",
)


# added where a setting has clients that never trained (split.unseen_clients)
UNSEEN_COLUMNS = ("unseen clients' test acc @ best val", "participation gap (seen - unseen)")
SHORT_UNSEEN_COLUMNS = ("unseen acc", "gap")


def columns(table: SettingTable, short: bool = False) -> tuple[str, ...]:
    """The columns of ``table``'s rows ([`row_cells()`][fedmerge.report.compare.row_cells])."""
    base, extra = (SHORT_COLUMNS, SHORT_UNSEEN_COLUMNS) if short else (COLUMNS, UNSEEN_COLUMNS)
    return base + extra if table.has_unseen else base


def fmt_stat(stat: Stat | None, failed: bool = False) -> str:
    if stat is None:
        return "failed" if failed else "-"
    if math.isnan(stat.std):
        return f"{100 * stat.mean:.2f}"
    return f"{100 * stat.mean:.2f} ± {100 * stat.std:.2f}"


def fmt_count(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:,.0f}"


def row_cells(table: SettingTable, row: MethodRow) -> list[str]:
    """The markdown/HTML cells of one row (accuracies in %)."""
    done, failed = row.count(DONE), row.count(FAILED)
    others = len(row.runs) - done - failed
    seeds = f"{done}" + (f" ({failed} failed)" if failed else "") + (f" ({others} not finished)" if others else "")
    diverged = sum(r in table.diverged for r in row.runs)
    seeds += f" ({diverged} diverged)" if diverged else ""
    if row.method == table.best:
        p = "best"
    elif row.p_value is None:
        p = f"n/a (n={row.n_paired})" if row.best_val is not None else "-"
    else:
        p = f"{row.p_value:.3g} (n={row.n_paired})"
    all_failed = done == 0 and failed > 0
    return [
        row.method,
        seeds,
        fmt_stat(row.best_val, all_failed),
        fmt_stat(row.last, all_failed),
        fmt_stat(row.worst10, all_failed),
        p,
        fmt_count(row.budget.get("client_optimized")),
        fmt_count(row.budget.get("communicated")),
        fmt_count(row.budget.get("server_stored")),
    ] + ([fmt_stat(row.unseen, all_failed), fmt_stat(row.gap, all_failed)] if table.has_unseen else [])


def to_markdown(tables: list[SettingTable], title: str = "Comparison") -> str:
    lines = [
        f"# {title}",
        "",
        "Mean client test accuracy (%), mean ± std over seeds, at the best-validation round (lowest mean "
        "validation loss) and at the last round; p: two-sided paired t-test across seeds against the best "
        "method (highest mean at the best-validation round). Budgets in float values. Where some clients never "
        "trained (split.unseen_clients): their mean test accuracy at the participants' best-validation round, and "
        "the participation gap (participants' minus theirs, in points).",
    ]
    for table in tables:
        head = columns(table)
        lines += ["", f"## {table.setting}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row_cells(table, row)) + " |" for row in table.rows]
        if table.failures:
            lines += ["", "Failed runs:", ""]
            lines += [f"- `{r.key}` (seed {r.seed}): {r.error or 'failed'}" for r in table.failures]
        if table.diverged:
            lines += ["", "Diverged runs (done, but not trained):", ""]
            lines += [f"- `{r.key}` (seed {r.seed}): {r.summary and r.summary.diverged}" for r in table.diverged]
    return "\n".join(lines) + "\n"


CSV_COLUMNS = (
    "setting",
    "method",
    "is_best",
    "seeds_done",
    "seeds_failed",
    "seeds_not_finished",
    "best_val_mean",
    "best_val_std",
    "last_mean",
    "last_std",
    "worst10_mean",
    "worst10_std",
    "p_value_vs_best",
    "n_paired",
    "client_optimized",
    "communicated",
    "server_stored",
)


def to_csv(tables: list[SettingTable]) -> str:
    """One line per (setting, method); accuracies as fractions, empty where there is no value."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)

    def num(value: float | None) -> str:
        return "" if value is None or (isinstance(value, float) and math.isnan(value)) else repr(float(value))

    for table in tables:
        for row in table.rows:
            done, failed = row.count(DONE), row.count(FAILED)
            stats = [(s.mean, s.std) if s else (None, None) for s in (row.best_val, row.last, row.worst10)]
            writer.writerow(
                [
                    table.setting,
                    row.method,
                    int(row.method == table.best),
                    done,
                    failed,
                    len(row.runs) - done - failed,
                    *(num(v) for pair in stats for v in pair),
                    num(row.p_value),
                    row.n_paired,
                    *(num(row.budget.get(k)) for k in ("client_optimized", "communicated", "server_stored")),
                ]
            )
    return buf.getvalue()


# --- a sweep's tables ---------------------------------------------------------------------

RESULTS_MD = "results.md"
RESULTS_CSV = "results.csv"


def write_results(sweep_dir: str | Path) -> list[SettingTable]:
    sweep_dir = Path(sweep_dir)
    tables = compare(sweep_records(sweep_dir))
    atomic_write_bytes(sweep_dir / RESULTS_MD, to_markdown(tables, f"Sweep {sweep_dir.name}").encode())
    atomic_write_bytes(sweep_dir / RESULTS_CSV, to_csv(tables).encode())
    return tables
