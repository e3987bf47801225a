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

from fedmerge.config.schema import ConfigError
from fedmerge.metrics.intervals import paired_t_interval
from fedmerge.run.provenance import read_provenance
from fedmerge.run.results import SUMMARY_FILE
from fedmerge.run.run_records import ParameterBudget, RunSummary, as_summary, read_summary
from fedmerge.study.claims import count_text, git_root, late_declarations, mark_late, paper_claims
from fedmerge.study.evidence import (
    BOOTSTRAP_RESAMPLES,
    MIN_BOOTSTRAP_CLIENTS,
    client_values,
    judge,
    noise_floor,
    row_interval,
)
from fedmerge.study.protocol import Conducted, extra_score, score_on_test, summary_of, val_score
from fedmerge.study.regime import (
    FEDAVG_GAP,
    LOCAL_GAP,
    MIN_KEPT_SEEDS,
    TEST,
    reference_means,
    reference_split,
    regime_check,
)
from fedmerge.study.spec import Study, explored_history, run_key
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


def ari_of(summary: RunSummary) -> float | None:
    """Adjusted Rand index of the method's client-to-model assignment vs. the true groups, if any (the
    ``cluster_recovery`` that the clustering methods' hooks add to the summary)."""
    return (summary.extras.get("cluster_recovery") or {}).get("ari")


def ari_text(rr: list[tuple[int, RunSummary, Path]]) -> str:
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


def row_runs(study: Study, runs: Path, label: str, point: int) -> list[tuple[int, RunSummary, Path]]:
    """(seed, summary, run folder) of every finished seed of one row's grid point."""
    out = []
    for seed in study.seeds:
        folder = finished_run(runs / run_key(label, point, seed))
        if folder is not None:
            out.append((seed, read_summary(folder / SUMMARY_FILE), folder))
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
    """A run's command with absolute paths inside the repository, and every run folder, shown relative to
    the repository (runs made from another checkout, or copied from an earlier revision's folder, record
    absolute run-folder paths, which name the machine they ran on)."""
    root = os.getcwd() + os.sep
    words = shlex.split(command)
    shown = [
        os.path.relpath(w) if w.startswith(root) or (i and words[i - 1] == "--output-dir" and os.path.isabs(w)) else w
        for i, w in enumerate(words)
    ]
    return shlex.join(shown)


def budget_total(history: list[Study]) -> dict[str, int]:
    """Per row, every distinct setting tried in any revision up to this one (its overrides and grid
    point; the tuning seed is the same in all): the budget a row really had, counted across revisions."""
    tried: dict[str, set[str]] = {}
    for study in history:
        for m in study.methods:
            for point in m.points():
                tried.setdefault(m.label, set()).add(json.dumps([m.overrides, point], sort_keys=True))
    return {label: len(settings) for label, settings in tried.items()}


def budget_history(done: Conducted) -> tuple[list[Study], str | None]:
    """The revisions whose settings count in each row's budget, and a note where they could not be read:
    a confirmation study's rows spent theirs in the exploration it confirms."""
    if done.study.confirms is None:
        return done.history, None
    try:
        return explored_history(done.study), None
    except ConfigError as exc:
        return done.history, f"the exploration study could not be read ({exc}); the budgets are this study's own"


def _regime_checks(done: Conducted) -> list[dict[str, Any]]:
    """Per seed with both tuned rows finished: the reference and the check's gaps and verdict, on the
    validation split where the stored reference allows it (``split``), else on the test split."""
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
        split = reference_split(ref[seed])
        reference, prior = reference_means(ref[seed], split)
        metric = f"{split}_{ref[seed].get('metric', 'acc')}"  # the reference's own metric (top-1 or ROUGE-1)
        score = [extra_score(x, metric) for x in (loc, fed)]
        check = regime_check(reference, *score)
        checks.append({"seed": seed, "ref": ref[seed], "prior": prior, **check, "split": split})
    return checks


def regime_split_text(checks: list[dict[str, Any]]) -> tuple[str, str]:
    """Which split the check read (the word the bars' sentence uses) and the note that says why."""
    test_seeds = [c["seed"] for c in checks if c["split"] == TEST]
    if not test_seeds:
        return "validation", (
            "The check reads validation data only: the reference's epoch and learning rate and the rows' round are "
            "chosen on validation loss, and their validation accuracies are compared; no test sample is read "
            "before the results."
        )
    word = "test" if len(test_seeds) == len(checks) else "validation (test on some seeds)"
    return word, (
        f"**The check read the test split** on seeds {test_seeds}: their central references were computed before "
        "references kept validation accuracies, and the reports of that time read test. Running the study again "
        "(without --report-only) recomputes them, and the check then reads validation data only."
    )


def budget_text(totals: dict[str, int], note: str | None, confirmation: bool) -> str:
    """Every row's budget across the table's revisions, and by how much they differ."""
    where = "in the exploration it confirms, over all its revisions" if confirmation else "over all its revisions"
    sizes = sorted(set(totals.values()))
    if len(sizes) == 1:
        text = f"every row tried {sizes[0]} settings {where}: equal budgets."
    else:
        rows = ", ".join(f"{label} {n}" for label, n in totals.items())
        text = (
            f"the settings each row tried {where}: {rows}. They differ, from {sizes[0]} to {sizes[-1]} settings "
            f"({sizes[-1] / sizes[0]:.1f}x); each claim shows the budgets of its two rows."
        )
    return text + (f" ({note})" if note else "")


def late_claims(done: Conducted) -> dict[tuple[str, str], str]:
    """Per comparison declared after its runs, the note with the times (``fedmerge.study.claims``): not in
    the study file, nor in the study it confirms, at the earliest commit the runs recorded."""
    if done.study_path is None or not done.study.claims:
        return {}
    root = git_root(done.study_path.resolve())
    if root is None:
        return {}
    files = [os.path.relpath(done.study_path.resolve(), root)]
    if done.study.confirms:
        files.append(done.study.confirms.split()[0])
    folders = [
        f for m in done.study.methods for _, _, f in row_runs(done.study, done.runs, m.label, done.chosen[m.label])
    ]
    commits = sorted({seg["commit"] for f in folders for seg in read_provenance(f) if seg.get("commit")})
    pairs = [(c.higher, c.lower) for c in done.study.claims]
    return late_declarations(root, files, commits, pairs)


def _claims(done: Conducted, totals: dict[str, int]) -> list[dict[str, Any]]:
    late = late_claims(done)
    return [
        {
            **judge(done.study, done.runs, done.chosen, claim),
            "budgets": [totals[claim.higher], totals[claim.lower]],
            # only where late: a claim declared before its runs keeps its JSON as published
            **({"declared_after": note} if (note := late.get((claim.higher, claim.lower))) else {}),
        }
        for claim in done.study.claims
    ]


def paper_claims_line(claims: list[dict[str, Any]]) -> str:
    """The report's count: ``N of M paper claims reproduced`` with the failed ones and the late ones named."""
    grouped = mark_late(
        paper_claims(claims),
        {(c["higher"], c["lower"]): c["declared_after"] for c in claims if c.get("declared_after")},
    )
    return count_text(grouped)


def _noise_floors(done: Conducted) -> dict[str, float | None]:
    return {m.label: noise_floor(done.study, done.runs, m.label, done.chosen[m.label]) for m in done.study.methods}


def noise_floor_text(floors: dict[str, float | None]) -> str:
    known = [f for f in floors.values() if f is not None]
    if not known:
        return (
            "Noise floor: not known (the run folders hold no per-client test sizes, or the metric is not a "
            "proportion of test samples)."
        )
    lo, hi = 100 * min(known), 100 * max(known)
    span = f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f} to {hi:.2f}"
    return (
        f"Noise floor: a row's mean has a standard error of {span} points from its test sets alone (binomial, at "
        "the row's accuracy and its clients' test sizes; mean over seeds); differences under about twice that "
        "cannot be told apart on one seed."
    )


def results_json(done: Conducted) -> dict[str, Any]:
    """The study's numbers for the cross-study index (``scripts/reproductions_index.py``)."""
    study, runs, chosen = done.study, done.runs, done.chosen
    totals = budget_total(budget_history(done)[0])
    floors = _noise_floors(done)
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
            "noise_floor": floors[m.label],
            # the 95% t interval of the best-val mean over the seeds (fractions); None on one seed
            "interval": row_interval([score_on_test(study, s) for _, s, _ in rr]),
            # only where true: a private row's JSON stays as published before the mark existed
            **({"not_private": True} if not_private(rr) else {}),
        }
    checks = [{k: v for k, v in c.items() if k not in ("ref", "prior")} for c in _regime_checks(done)]
    metric = f"{study.metric.part} test {study.metric.name}"
    return {
        "title": study.title,
        "metric": metric,
        "regime": checks,
        "rows": rows,
        "seeds": study.seeds,
        "explored_on": study.explored_on,
        "confirms": study.confirms,
        "claims": _claims(done, totals),
        # only where the study file gives the paper's values: older reports keep their JSON as published
        **({"paper": paper} if (paper := paper_comparison(done)) else {}),
    }


def paper_values(study: Study, rr: list[tuple[int, dict[str, Any], Path]], key: str) -> list[float]:
    """A row's values (percent, one per finished seed) of what a ``paper:`` key names: the table's metric or an
    extra column."""
    if key == study.metric.name:
        return [100 * score_on_test(study, s) for _, s, _ in rr]
    column = next(c for c in study.columns if c.removeprefix("test_") == key.removeprefix("test_"))
    return [100 * extra_score(s, column) for _, s, _ in rr]


def paper_comparison(done: Conducted) -> list[dict[str, Any]]:
    """Per row and ``paper:`` value: the paper's value, ours (mean over seeds), ours minus the paper's and its
    95% interval (Student's t over the seeds' differences; none on one seed), and where ours lies: ``above``
    or ``below`` the paper where the interval excludes zero, else ``consistent``."""
    study = done.study
    out = []
    for m in study.methods:
        rr = row_runs(study, done.runs, m.label, done.chosen[m.label]) if m.paper else []
        for key, published in m.paper.items():
            ours = [v for v in paper_values(study, rr, key) if v == v]
            entry: dict[str, Any] = {"label": m.label, "value": key, "paper": published, "seeds": len(ours)}
            if ours:
                entry["ours"] = statistics.mean(ours)
                entry["difference"] = entry["ours"] - published
            if len(ours) >= 2:
                _, low, high = paired_t_interval([v - published for v in ours])
                where = "above" if low > 0 else "below" if high < 0 else "consistent"
                entry.update(low=low, high=high, verdict=where)
            out.append(entry)
    return out


def not_private(rr: list[tuple[int, RunSummary | dict[str, Any], Path]]) -> bool:
    """Whether a row's runs used ``privacy.reproducible_noise`` (DP noise from the seed: not private)."""
    return any(as_summary(s).private is False for _, s, _ in rr)


def _results_rows(done: Conducted) -> list[dict[str, Any]]:
    study, runs, chosen = done.study, done.runs, done.chosen
    rows = []
    for m in study.methods:
        rr = row_runs(study, runs, m.label, chosen[m.label])
        if not rr:
            rows.append({"label": m.label, "runs": 0})
            continue
        budget = rr[0][1].parameter_budget or ParameterBudget()
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
                "server": budget.server_stored or 0,
                "down": budget.down_per_client_round or 0,
                "up": budget.up_per_client_round or 0,
                "commits": ", ".join(commits) + (" (mixed)" if len(commits) > 1 else ""),
                "not_private": not_private(rr),
            }
        )
    return rows


def _uncertainty_rows(done: Conducted) -> list[dict[str, Any]]:
    """Per row with a finished seed: its best-val mean (%), the 95% t interval over the seeds, the seeds'
    standard deviation and the one-seed noise floor (points), and how many floors the spread is."""
    study, floors = done.study, _noise_floors(done)
    rows = []
    for m in study.methods:
        values = [
            100 * score_on_test(study, s) for _, s, _ in row_runs(study, done.runs, m.label, done.chosen[m.label])
        ]
        if not values:
            continue
        interval = row_interval(values)
        spread = statistics.stdev(values) if len(values) > 1 else None
        floor = 100 * floors[m.label] if floors[m.label] is not None else None
        rows.append(
            {
                "label": m.label,
                "seeds": len(values),
                "mean": f"{statistics.mean(values):.1f}",
                "interval": f"[{interval[0]:.1f}, {interval[1]:.1f}]" if interval else "- (one seed)",
                "spread": f"{spread:.2f}" if spread is not None else "-",
                "floor": f"{floor:.2f}" if floor is not None else "-",
                "ratio": f"{spread / floor:.1f}x" if spread is not None and floor else "-",
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


def tuning_score_text(summary: RunSummary | None, study: Study) -> str:
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
    history, note = budget_history(done)
    totals = budget_total(history)
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
        provisional=sum(c["passes"] for c in checks) < MIN_KEPT_SEEDS,
        min_kept_seeds=MIN_KEPT_SEEDS,
        mean_gaps=(
            (statistics.mean(c["local_gap"] for c in checks), statistics.mean(c["fedavg_gap"] for c in checks))
            if checks
            else None
        ),
        what=WHAT[study.metric.name],
        budget=len(study.methods[0].points()),
        rows=_results_rows(done),
        uncertainty=_uncertainty_rows(done),
        tuning=_tuning_rows(done),
        shown=shown,
        commands=_commands(done, shown),
        split=regime_split_text(checks) if checks else ("validation", ""),
        noise_text=noise_floor_text(_noise_floors(done)),
        budget_text=budget_text(totals, note, study.confirms is not None),
        paper=paper_comparison(done),
        claims=(claims := _claims(done, totals)),
        paper_claims=paper_claims_line(claims) if claims else "",
        min_clients=MIN_BOOTSTRAP_CLIENTS,
        resamples=BOOTSTRAP_RESAMPLES,
    )


def clients_path(out: Path) -> Path:
    """Where a report's per-client values go: ``REPORT.clients.json`` beside ``REPORT.json``."""
    return out.with_suffix(".clients.json")


def clients_json(done: Conducted) -> str:
    """The per-client values (``fedmerge.study.evidence.client_values``) as a compact JSON text: one line
    per row and seed, so that a change to one client shows as one changed line."""
    data = client_values(done.study, done.runs, done.chosen)
    rows = data.pop("rows")
    head = json.dumps(data)[:-1]
    lines = []
    for label, seeds in rows.items():
        inner = ",\n".join(f"  {json.dumps(seed)}: {json.dumps(values)}" for seed, values in seeds.items())
        lines.append(f" {json.dumps(label)}: {{\n{inner}\n }}" if seeds else f" {json.dumps(label)}: {{}}")
    return head + ', "rows": {\n' + ",\n".join(lines) + "\n}}\n"


def write(done: Conducted, out: Path) -> None:
    """The report at ``out``, its numbers next to it (``.json``) and the per-client values every interval
    is recomputed from (``.clients.json``, read by ``python -m fedmerge.study.recompute``)."""
    out.write_text(report(done))
    out.with_suffix(".json").write_text(json.dumps(results_json(done), indent=1))
    clients_path(out).write_text(clients_json(done))
