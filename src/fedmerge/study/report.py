"""A study's report (Markdown, from ``templates/study.md.j2``) and its numbers (JSON, for the index of
reproductions). Both are rebuilt from the run folders alone: the commands shown come from each run's
``provenance.jsonl``, never from today's study file. The report is generated; readings belong in a
separate, hand-written file."""

from __future__ import annotations

import json
import os
import shlex
import statistics
from pathlib import Path
from typing import Any

from fedmerge.run.provenance import read_provenance
from fedmerge.study.protocol import Conducted, extra_score, score_on_test, summary_of, val_score
from fedmerge.study.regime import FEDAVG_GAP, LOCAL_GAP, regime_check
from fedmerge.study.spec import Study, run_key
from fedmerge.sweep.launch import finished_run

TEMPLATE_DIR = Path(__file__).parent / "templates"
GENERATOR = "fedmerge study"  # named in the report's second paragraph
WHAT = {"acc": "top-1", "top5": "top-5", "rouge1": "ROUGE-1"}


def pct(values: list[float]) -> str:
    """Fractions as percent: one value, or mean ± std (NaNs left out)."""
    vals = [100 * v for v in values if v == v]
    if not vals:
        return "-"
    if len(vals) == 1:
        return f"{vals[0]:.1f}"
    return f"{statistics.mean(vals):.1f} ± {statistics.stdev(vals):.1f}"


def ari_of(summary: dict[str, Any]) -> float | None:
    """Adjusted Rand index of the method's client-to-model assignment vs. the true groups, if any."""
    return (summary.get("cluster_recovery") or {}).get("ari")


def ari_text(rr: list[tuple[int, dict[str, Any], Path]]) -> str:
    values = [a for _, s, _ in rr if (a := ari_of(s)) is not None]
    if not values:
        return "-"
    return f"{values[0]:.2f}" if len(values) == 1 else f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def commits_of(folders: list[Path]) -> set[str]:
    return {
        (seg.get("commit") or "?")[:8] + ("+dirty" if seg.get("dirty") else "")
        for f in folders
        for seg in read_provenance(f)
    }


def row_runs(study: Study, runs: Path, label: str, point: int) -> list[tuple[int, dict[str, Any], Path]]:
    """(seed, summary, run folder) of every finished seed of one row's grid point."""
    out = []
    for seed in study.seeds:
        folder = finished_run(runs / run_key(label, point, seed))
        if folder is not None:
            out.append((seed, json.loads((folder / "summary.json").read_text()), folder))
    return out


def point_text(point: dict[str, Any]) -> str:
    return ", ".join(f"{k.split('.')[-1]}={v}" for k, v in point.items())


def reference_settings_text(study: Study) -> str:
    """How this study's central reference was trained, as the report states it."""
    lrs, grid = study.regime.lrs, study.local_lrs()
    epochs = f"The reference trains for at most {study.regime.max_epochs} epochs; its learning rate"
    if lrs is None and grid is None:
        return f"{epochs} is the base config's."
    source = "the Local row's grid" if lrs is None or lrs == grid else "{" + ", ".join(f"{lr:g}" for lr in lrs) + "}"
    return f"{epochs} is chosen per group from {source} by validation loss."


def shown_command(command: str) -> str:
    """A run's command with absolute paths inside the repository shown relative to it (runs made from
    another checkout, or copied from an earlier revision's folder, record absolute run-folder paths)."""
    root = os.getcwd() + os.sep
    words = shlex.split(command)
    return shlex.join(os.path.relpath(w) if w.startswith(root) else w for w in words)


def budget_total(history: list[Study]) -> dict[str, int]:
    """Per row, every distinct setting tried in any revision up to this one (its overrides and grid
    point; the tuning seed is the same in all): the budget a row really had, counted across revisions."""
    tried: dict[str, set[str]] = {}
    for study in history:
        for m in study.methods:
            for point in m.points():
                tried.setdefault(m.label, set()).add(json.dumps([m.overrides, point], sort_keys=True))
    return {label: len(settings) for label, settings in tried.items()}


def _regime_checks(done: Conducted) -> list[dict[str, Any]]:
    """Per seed with both tuned rows finished: the reference and the check's gaps and verdict."""
    study, runs, chosen, ref = done.study, done.runs, done.chosen, done.reference
    labels = {m.label for m in study.methods}
    checks = []
    for seed in study.seeds:
        loc, fed = (
            summary_of(runs, run_key(r, chosen[r], seed)) if r in labels else None
            for r in (study.local_row, study.fedavg_row)
        )
        if loc is None or fed is None:
            continue
        metric = f"test_{ref[seed].get('metric', 'acc')}"  # the reference's own metric (top-1 or ROUGE-1)
        score = [x["best_val"]["clients"][metric]["mean"] for x in (loc, fed)]
        checks.append({"seed": seed, "ref": ref[seed], **regime_check(ref[seed]["mean"], *score)})
    return checks


def results_json(done: Conducted) -> dict[str, Any]:
    """The study's numbers for the cross-study index (``scripts/reproductions_index.py``)."""
    study, runs, chosen = done.study, done.runs, done.chosen
    totals = budget_total(done.history)
    rows = {}
    for m in study.methods:
        rr = row_runs(study, runs, m.label, chosen[m.label])
        rows[m.label] = {
            "chosen": m.points()[chosen[m.label]],
            "seeds": [seed for seed, _, _ in rr],
            "best_val": [score_on_test(study, s) for _, s, _ in rr],
            "last": [score_on_test(study, s, "last") for _, s, _ in rr],
            **{c: [extra_score(s, c) for _, s, _ in rr] for c in study.columns},
            "ari": [a for _, s, _ in rr if (a := ari_of(s)) is not None],
            "budget_total": totals[m.label],
        }
    checks = [{k: v for k, v in c.items() if k != "ref"} for c in _regime_checks(done)]
    metric = f"{study.metric.scope} test {study.metric.name}"
    return {"title": study.title, "metric": metric, "regime": checks, "rows": rows}


def _results_rows(done: Conducted) -> list[dict[str, Any]]:
    study, runs, chosen = done.study, done.runs, done.chosen
    rows = []
    for m in study.methods:
        rr = row_runs(study, runs, m.label, chosen[m.label])
        if not rr:
            rows.append({"label": m.label, "runs": 0})
            continue
        budget = rr[0][1].get("parameter_budget", {})
        commits = sorted(commits_of([f for _, _, f in rr]))
        rows.append(
            {
                "label": m.label,
                "runs": len(rr),
                "chosen": point_text(m.points()[chosen[m.label]]) or "-",
                "best": pct([score_on_test(study, s) for _, s, _ in rr]),
                "last": pct([score_on_test(study, s, "last") for _, s, _ in rr]),
                "extra": [pct([extra_score(s, c) for _, s, _ in rr]) for c in study.columns],
                "ari": ari_text(rr),
                "server": budget.get("server_stored", 0),
                "down": budget.get("down_per_client_round", 0),
                "up": budget.get("up_per_client_round", 0),
                "commits": ", ".join(commits) + (" (mixed)" if len(commits) > 1 else ""),
            }
        )
    return rows


def _tuning_rows(done: Conducted) -> list[dict[str, Any]]:
    study, runs, chosen = done.study, done.runs, done.chosen
    rows = []
    for m in study.methods:
        for i, point in enumerate(m.points()):
            s = summary_of(runs, run_key(m.label, i, study.tuning_seed))
            rows.append(
                {
                    "label": m.label,
                    "point": point_text(point),
                    "chosen": i == chosen[m.label],
                    "score": tuning_score_text(s, study),
                }
            )
    return rows


def tuning_score_text(summary: dict[str, Any] | None, study: Study) -> str:
    """A tuning run's score as the tuning table shows it: validation metric in %, or the validation loss."""
    if not summary:
        return "failed"
    score = val_score(summary, study)
    return pct([score]) if study.select == "val_metric" else f"{-score:.4f}"


def _commands(done: Conducted, shown: str) -> list[str]:
    lines = []
    for m in done.study.methods:
        for _, _, folder in row_runs(done.study, done.runs, m.label, done.chosen[m.label]):
            for seg in read_provenance(folder):
                lines.append(shown_command(seg["command"].replace(str(done.runs.resolve()), shown)))
    return lines


def report(done: Conducted) -> str:
    import jinja2

    study = done.study
    checks = _regime_checks(done)
    shown = os.path.relpath(done.runs.resolve())
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        autoescape=False,  # Markdown, not HTML
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["fmt"] = format  # {{ x|fmt(",.0f") }}
    env.filters["pts"] = lambda fraction: f"{100 * fraction:.1f}" if fraction == fraction else "-"  # NaN: none
    return env.get_template("study.md.j2").render(
        study=study,
        generator=GENERATOR,
        description=study.description.strip(),
        local_gap=LOCAL_GAP,
        fedavg_gap=FEDAVG_GAP,
        reference_text=reference_settings_text(study),
        checks=checks,
        kept=all(c["passes"] for c in checks),
        mean_gaps=(
            (statistics.mean(c["local_gap"] for c in checks), statistics.mean(c["fedavg_gap"] for c in checks))
            if checks
            else None
        ),
        what=WHAT[study.metric.name],
        budget=len(study.methods[0].points()),
        rows=_results_rows(done),
        tuning=_tuning_rows(done),
        shown=shown,
        commands=_commands(done, shown),
    )


def write(done: Conducted, out: Path) -> None:
    """The report at ``out`` and its numbers next to it (``.json``)."""
    out.write_text(report(done))
    out.with_suffix(".json").write_text(json.dumps(results_json(done), indent=1))
