"""Recompute a study report's intervals from its published per-client values alone, and say whether each
equals the report.

    python -m fedmerge.study.recompute docs/reproductions/FAMILY/TABLE/STUDY.json

Reads ``STUDY.clients.json`` beside the report's JSON (written by ``fedmerge study`` with the report; or
``--clients FILE``) and, applying the interval rule of docs/guide/studies.md ("The interval rule") from
these values only, recomputes: each row's per-seed means (the mean of its clients' values), its 95% t
interval over the seeds and its noise floor; each claim's per-seed differences, its interval (paired t over
the seeds; on one seed the bootstrap over its clients), its verdict, and the two-level bootstrap shown as
its detail. Every figure is compared with the report's JSON within ``TOLERANCE`` points (the published
values are rounded; one client's value changed by one test sample moves a seed's mean by far more).
Exit status 0 when every figure equals the report, 1 when one differs, 2 on unreadable input.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from fedmerge.metrics.intervals import bootstrap_interval, paired_t_interval, verdict
from fedmerge.metrics.noise import mean_accuracy_standard_error

TOLERANCE = 1e-3  # points: the published values' rounding moves a figure by < 1e-4
BINOMIAL = {"acc", "top5"}


def clients_file(report: Path) -> Path:
    """``STUDY.clients.json`` beside ``STUDY.json``."""
    return report.with_suffix(".clients.json")


def seed_value(entry: dict[str, Any]) -> float:
    """A row's value on one seed: the mean of its clients' values, or the value published for it where the
    seed has no per-client values (the server model's metric)."""
    return statistics.fmean(entry["values"]) if "values" in entry else float(entry["value"])


def t_interval(values: list[float]) -> tuple[float, float, float] | None:
    return paired_t_interval(values) if len(values) >= 2 else None


def claim_figures(claim: dict[str, Any], rows: dict[str, Any], boot: dict[str, int]) -> dict[str, Any]:
    """A claim's figures (points) as the rule gives them from the per-client values of its two rows."""
    high, low = rows[claim["higher"]], rows[claim["lower"]]
    seeds = [str(s) for s in claim["seeds"]]
    diffs = [seed_value(high[s]) - seed_value(low[s]) for s in seeds]
    groups = []
    for s in seeds:
        a, b = high[s], low[s]
        if "values" not in a or "values" not in b:
            groups.append([])
            continue
        lower = dict(zip(b["clients"], b["values"], strict=True))
        groups.append([v - lower[c] for c, v in zip(a["clients"], a["values"], strict=True) if c in lower])
    enough = bool(groups) and min(len(g) for g in groups) >= boot["min_clients"]
    out: dict[str, Any] = {"per_seed": [100 * d for d in diffs]}
    detail = None
    if enough:
        detail = bootstrap_interval(groups, resamples=boot["resamples"], seed=boot["seed"])
    if len(seeds) >= 2:
        estimate, lo, hi = paired_t_interval(diffs)
        if detail is not None:
            out.update(bootstrap_low=100 * detail[1], bootstrap_high=100 * detail[2])
    elif detail is not None:
        estimate, lo, hi = detail
    else:
        return {"verdict": None}
    return {**out, "difference": 100 * estimate, "low": 100 * lo, "high": 100 * hi, "verdict": verdict(lo, hi)}


def _shown(x: float | None) -> str:
    return "none" if x is None else f"{x:+.4f}"


def compare(report: dict[str, Any], published: dict[str, Any]) -> list[tuple[bool, str]]:
    """(equal, line) for every recomputed figure of the report."""
    rows, boot = published["rows"], published["bootstrap"]
    binomial = published["metric"]["name"] in BINOMIAL
    lines: list[tuple[bool, str]] = []

    def check(what: str, ours: float | None, theirs: float | None) -> None:
        if ours is None or theirs is None:
            same = ours is None and theirs is None
        else:
            same = abs(ours - theirs) <= TOLERANCE
        lines.append(
            (same, f"{'ok' if same else 'DIFFERS'}  {what}: report {_shown(theirs)}, recomputed {_shown(ours)}")
        )

    for label, row in report["rows"].items():
        entries = rows.get(label, {})
        if sorted(entries, key=int) != sorted(map(str, row["seeds"]), key=int):
            lines.append((False, f"DIFFERS  row {label}: seeds {row['seeds']} in the report, {list(entries)} here"))
            continue
        values = [seed_value(entries[str(s)]) for s in row["seeds"]]
        for seed, ours, theirs in zip(row["seeds"], values, row["best_val"], strict=True):
            check(f"row {label}, seed {seed}, mean", 100 * ours, 100 * theirs)
        if "interval" in row:
            got = t_interval(values)
            want = row["interval"]
            for end, i in (("low", 1), ("high", 2)):
                check(
                    f"row {label}, 95% interval {end}",
                    None if got is None else 100 * got[i],
                    None if want is None else 100 * want[i - 1],
                )
        if binomial and row.get("noise_floor") is not None:
            floors = [
                mean_accuracy_standard_error(e["test_n"], min(max(v, 0.0), 1.0))
                for v, e in zip(values, (entries[str(s)] for s in row["seeds"]), strict=True)
                if "test_n" in e
            ]
            check(
                f"row {label}, noise floor",
                100 * statistics.fmean(floors) if floors else None,
                100 * row["noise_floor"],
            )

    for claim in report.get("claims", []):
        name = f"claim {claim['higher']} > {claim['lower']}"
        if not claim.get("verdict"):
            continue
        got = claim_figures(claim, rows, boot)
        for key in ("difference", "low", "high", "bootstrap_low", "bootstrap_high"):
            if key in got or key in claim:
                check(f"{name}, {key}", got.get(key), claim.get(key))
        for seed, ours, theirs in zip(claim["seeds"], got.get("per_seed", []), claim["per_seed"], strict=False):
            check(f"{name}, seed {seed} difference", ours, theirs)
        same = got["verdict"] == claim["verdict"]
        lines.append(
            (
                same,
                f"{'ok' if same else 'DIFFERS'}  {name}, verdict: report {claim['verdict']}, "
                f"recomputed {got['verdict']}",
            )
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", type=Path, help="the report's JSON (STUDY.json)")
    ap.add_argument("--clients", type=Path, help="the per-client values (default: STUDY.clients.json beside it)")
    ap.add_argument("--quiet", action="store_true", help="print only the figures that differ and the count")
    args = ap.parse_args(argv)
    path = args.clients or clients_file(args.report)
    try:
        report, published = json.loads(args.report.read_text()), json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"error: cannot read {args.report} or {path} ({exc})", file=sys.stderr)
        return 2
    lines = compare(report, published)
    for same, line in lines:
        if not (args.quiet and same):
            print(line)
    differ = sum(not same for same, _ in lines)
    print(
        f"{len(lines) - differ} of {len(lines)} figures equal the report"
        + (f"; {differ} differ" if differ else "")
        + f" (within {TOLERANCE:g} points, from {path.name} alone)"
    )
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
