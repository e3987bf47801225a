"""How far FedMerge's merge weights moved, per run of a study, and the accuracy beside it: the evidence for the
default ``algorithm.logit_lr`` (docs/reproductions/fedmerge/logit_lr/).

    python benchmarks/fedmerge_logit_lr.py STUDY.yaml RUNS [STUDY.yaml RUNS ...] --csv OUT.csv \
        [--into READING.md --block NAME]

Per finished run of every row on every seed of each study, at its last round (``metrics.jsonl``'s
``server.merge_weights``): the mean over clients of the largest merge weight (uniform: 1/d), the mean normalised
entropy H(w)/log d (uniform: 1), and whether the run's warning fires (no client gives any model 1.5/d). Beside
them: the mean client validation and test accuracy at the best-validation round (``summary.json``). The markdown
gives, per study and row, the mean over seeds with a 95% paired-t interval of its difference from the row
``FedMerge logit_lr=0.01`` (Student's t over the per-seed differences: the movement is one figure per run, not a
mean over clients that a bootstrap could resample). ``--into FILE --block NAME`` writes the tables between the
lines ``<!-- generated: NAME -->`` and ``<!-- end generated: NAME -->`` of FILE, so a reading quotes them without
copying figures by hand.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path
from typing import Any

from fedmerge.metrics.intervals import paired_t_interval
from fedmerge.run.run_records import read_summary
from fedmerge.study.protocol import choose
from fedmerge.study.spec import load_study_file, run_key
from fedmerge.sweep.launch import finished_run

BASELINE = "FedMerge logit_lr=0.01"
FIELDS = ["study", "row", "seed", "d", "max_weight", "entropy", "warns", "val_acc", "test_acc"]


def movement(weights: list[list[float]]) -> dict[str, Any]:
    """The mean largest weight, the mean normalised entropy and the warning's condition of one (m, d) matrix."""
    d = len(weights[0])
    largest = [max(row) for row in weights]
    entropy = [-sum(w * math.log(w) for w in row if w > 0) / math.log(d) for row in weights]
    return {
        "d": d,
        "max_weight": sum(largest) / len(largest),
        "entropy": sum(entropy) / len(entropy),
        "warns": max(largest) < 1.5 / d,  # FedMerge.run_warnings' test
    }


def last_merge_weights(run: Path) -> list[list[float]] | None:
    last = None
    with open(run / "metrics.jsonl") as fh:
        for line in fh:
            record = json.loads(line)
            weights = (record.get("server") or {}).get("merge_weights")
            if weights is not None:
                last = weights
    return last


def study_rows(study_path: Path, runs: Path) -> list[dict[str, Any]]:
    study = load_study_file(study_path).at()
    chosen = choose(study, runs)
    out = []
    for row in study.methods:
        for seed in study.seeds:
            run = finished_run(runs / run_key(row.label, chosen[row.label], seed))
            if run is None:
                continue
            best = read_summary(run / "summary.json").best_val
            record: dict[str, Any] = {"study": study_path.stem, "row": row.label, "seed": seed}
            weights = last_merge_weights(run)
            record.update(movement(weights) if weights else {"d": "", "max_weight": "", "entropy": "", "warns": ""})
            record["val_acc"] = best.clients["val_acc"].mean
            record["test_acc"] = best.clients["test_acc"].mean
            out.append(record)
    return out


def _interval(values: dict[int, float], base: dict[int, float], scale: float) -> str:
    seeds = sorted(set(values) & set(base))
    if len(seeds) < 2:
        return "-"
    mean, low, high = paired_t_interval([(values[s] - base[s]) * scale for s in seeds])
    return f"{mean:+.2f} [{low:+.2f}, {high:+.2f}]"


def markdown(records: list[dict[str, Any]]) -> str:
    """One table per study: per row, means over seeds and the paired difference from logit_lr 0.01."""
    lines = []
    for name in dict.fromkeys(r["study"] for r in records):
        rows = [r for r in records if r["study"] == name]
        by_row: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            by_row.setdefault(r["row"], []).append(r)
        base = by_row.get(BASELINE, [])
        lines += [
            f"**{name}** (mean over seeds {sorted({r['seed'] for r in rows})}; in brackets the difference from "
            f"`{BASELINE}` with its 95% paired-t interval over seeds)",
            "",
            "| row | seeds | warning fires | max weight | max weight vs 0.01 | entropy | val acc (%) | val vs 0.01 "
            "(points) | test acc (%) | test vs 0.01 (points) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for label, rs in by_row.items():
            moved = [r for r in rs if r["d"] != ""]

            def col(key: str, of: list[dict[str, Any]], scale: float = 1.0) -> dict[int, float]:
                return {r["seed"]: r[key] * scale for r in of if r[key] != ""}

            def mean(values: dict[int, float], fmt: str) -> str:
                return format(sum(values.values()) / len(values), fmt) if values else "-"

            warns = f"{sum(bool(r['warns']) for r in moved)} of {len(moved)}" if moved else "-"
            lines.append(
                f"| {label} | {len(rs)} | {warns} | {mean(col('max_weight', moved), '.3f')} | "
                f"{_interval(col('max_weight', moved), col('max_weight', base), 1.0) if moved else '-'} | "
                f"{mean(col('entropy', moved), '.3f')} | {mean(col('val_acc', rs, 100), '.1f')} | "
                f"{_interval(col('val_acc', rs), col('val_acc', base), 100.0)} | "
                f"{mean(col('test_acc', rs, 100), '.1f')} | "
                f"{_interval(col('test_acc', rs), col('test_acc', base), 100.0)} |"
            )
        lines.append("")
    return "\n".join(lines)


def rule(records: list[dict[str, Any]], margin: float = 0.5) -> str:
    """The choice rule of docs/reproductions/fedmerge/logit_lr/HISTORY.md, on exploration runs: among the logit_lr
    values whose warning is silent on every run, the highest mean validation accuracy (mean over seeds, then over
    studies); values within ``margin`` points of it go to the smallest; the default changes to it only if it is no
    more than ``margin`` points below 0.01's. Returns a markdown table and the pick."""
    values: dict[float, dict[str, Any]] = {}
    for r in records:
        if not r["row"].startswith("FedMerge logit_lr="):
            continue
        v = values.setdefault(float(r["row"].split("=", 1)[1]), {"warns": 0, "runs": 0, "val": {}})
        v["warns"] += bool(r["warns"])
        v["runs"] += 1
        v["val"].setdefault(r["study"], []).append(100 * r["val_acc"])
    for v in values.values():
        v["mean"] = sum(sum(x) / len(x) for x in v["val"].values()) / len(v["val"])
    lines = [
        "| logit_lr | runs | warning fires | val acc (%), mean over seeds then studies |",
        "|---|---|---|---|",
        *(f"| {lr:g} | {v['runs']} | {v['warns']} | {v['mean']:.2f} |" for lr, v in sorted(values.items())),
        "",
    ]
    silent = {lr: v["mean"] for lr, v in values.items() if v["warns"] == 0}
    if not silent:
        return "\n".join([*lines, "No value silences the warning on every run: the default stays 0.01."])
    best = max(silent.values())
    pick = min(lr for lr, mean in silent.items() if mean >= best - margin)
    if 0.01 in values and silent[pick] < values[0.01]["mean"] - margin:
        return "\n".join(
            [*lines, f"The rule's value {pick:g} is more than {margin} points below 0.01: the default stays."]
        )
    return "\n".join(
        [
            *lines,
            f"Best silent value: {best:.2f}; the smallest within {margin} points of it: **{pick:g}** "
            f"({silent[pick]:.2f}).",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pairs", nargs="+", help="STUDY.yaml RUNS, repeated")
    ap.add_argument("--csv", type=Path, required=True)
    ap.add_argument("--into", type=Path, help="a markdown file with the block's marker lines")
    ap.add_argument("--block", default="merge-weights")
    ap.add_argument("--rule", action="store_true", help="also apply the choice rule (exploration studies)")
    args = ap.parse_args(argv)
    if len(args.pairs) % 2:
        ap.error("give each study file with its runs folder")
    records = []
    for study, runs in zip(args.pairs[::2], args.pairs[1::2]):
        records += study_rows(Path(study), Path(runs))
    with open(args.csv, "w", newline="") as fh:
        writer = csv.DictWriter(fh, FIELDS, lineterminator="\n")
        writer.writeheader()
        for r in records:
            writer.writerow({k: (f"{v:.6f}" if isinstance(v, float) else v) for k, v in r.items()})
    text = markdown(records) + ("\n" + rule(records) + "\n" if args.rule else "")
    if args.into:
        args.into.write_text(into_block(args.into.read_text(), args.block, text))
    print(text)


def into_block(page: str, block: str, text: str) -> str:
    """``page`` with the lines between its ``block`` markers replaced by ``text``."""
    begin, end = f"<!-- generated: {block} -->", f"<!-- end generated: {block} -->"
    if page.count(begin) != 1 or page.count(end) != 1:
        raise SystemExit(f"error: the page needs one line {begin!r} and one line {end!r}")
    head, rest = page.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{text.rstrip()}\n{end}{tail}"


if __name__ == "__main__":
    main()
