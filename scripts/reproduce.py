"""Run one reproduction study (regime check, equal-budget tuning, seeds) and write its report.

    python scripts/reproduce.py STUDY.yaml [--runs RUNS_DIR] [--out REPORT.md] [--jobs 2] [--report-only]
    python scripts/reproduce.py STUDY_wide.yaml --share-runs-from STUDY.yaml ...   # reuse unchanged runs

A study file names a base config, the seeds, and the methods (rows), each with fixed overrides and a
tuning grid (a product of values, plus optional ``extra_points``: explicit points appended after it).
The protocol, the same for every row:

1. Regime check first: a central reference (one model per ground-truth group, or on all data for
   label-skew partitions; ``fedmerge.study.regime``) per seed, against the tuned Local and FedAvg.
   ``regime: {scope, max_epochs, lrs}`` sets how the reference trains: at most ``max_epochs`` epochs
   (default 40; a cap above the federated rows' rounds x local epochs can open gaps that measure only
   the longer training: ``studies/livar_wordnet_beta05_budget.yaml`` checks one such study at its
   budget), at the learning rates ``lrs`` (default: the Local row's grid), chosen by validation loss.
2. Tuning: every grid point of every method runs on ``tune_seed``; the point with the best mean
   client *validation* top-1 (at the best-validation-loss round) is chosen. Every method's grid must
   have the same number of points (the equal budget); the study is refused otherwise.
3. The chosen point runs on every seed; rows report mean +- std over seeds at the best-validation
   round (the papers' model selection) and at the last round.

Each run is one ``fedmerge run`` process, in a folder of its own named by the row, grid point and
seed: finished runs are skipped, unfinished ones resumed, so the script can be re-run at will. A run
folder whose config is not what the study now asks for (a grid, override or base config changed since
it ran) is refused with the first difference, rather than reused under its old name. The
report rebuilds nothing: the commands it prints come from each run's ``provenance.jsonl``. The report
is generated; readings belong in a separate, hand-written file.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from fedmerge.config.schema import ConfigError, first_config_difference, load_config
from fedmerge.run.prepare import load_data
from fedmerge.run.provenance import read_provenance, source_commit
from fedmerge.study.regime import FEDAVG_GAP, LOCAL_GAP, central_reference, regime_check

# --- the study ---------------------------------------------------------------------------------


def load_study(path: Path) -> dict[str, Any]:
    study = yaml.safe_load(path.read_text())
    slugs = [slug(m["label"]) for m in study["methods"]]
    if len(set(slugs)) < len(slugs):  # rows would share run folders
        raise SystemExit(f"{path}: row labels {[m['label'] for m in study['methods']]} collide as folder names")
    sizes = {m["label"]: len(grid_points(m)) for m in study["methods"]}
    if len(set(sizes.values())) > 1:
        raise SystemExit(f"{path}: unequal tuning budgets {sizes}; give every method the same number of grid points")
    # Every grid point must be a valid config before anything runs: a point the config refuses (Ditto's
    # lr x lam >= 2, say) would otherwise fail as a run, or stop a --share-runs-from with a traceback.
    for m in study["methods"]:
        for point in grid_points(m):
            try:
                load_config(study["base"], base_overrides(m, point, study.get("tune_seed", study["seeds"][0])))
            except ConfigError as exc:
                first = str(exc).strip().splitlines()[0]
                raise SystemExit(f"error: {path}: row {m['label']!r}, grid point {point}: {first}") from None
    return study


def grid_points(method: dict[str, Any]) -> list[dict[str, Any]]:
    """The row's tuning points: the product of its ``grid``, then its ``extra_points`` in order.

    Extra points tune a knob coordinate-wise (at the learning rate a narrower grid chose) without the
    cost of a full product; listed last, they leave the grid's points (and their run folders) where
    they were, so a study that adds them can share the earlier study's runs."""
    grid = method.get("grid") or {}
    keys = list(grid)
    points = [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]
    return points + [dict(p) for p in method.get("extra_points") or []]


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower().replace("+", " plus ")).strip("-")


def run_key(label: str, point: int, seed: int) -> str:
    return f"{slug(label)}-g{point}-s{seed}"


# --- running -----------------------------------------------------------------------------------


def run_folder(runs: Path, key: str) -> Path | None:
    parent = runs / key
    found = sorted(p for p in parent.glob("*") if (p / "config.yaml").exists()) if parent.exists() else []
    return found[-1] if found else None


def finished(folder: Path | None) -> bool:
    return folder is not None and (folder / "summary.json").exists()


def launch(study: dict[str, Any], runs: Path, key: str, overrides: list[str]) -> tuple[str, bool]:
    folder = run_folder(runs, key)
    if finished(folder):
        return key, True
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if folder is not None:  # killed earlier: continue from its checkpoint
        cmd = ["fedmerge", "run", "--resume", str(folder), "--no-progress"]
    else:
        cmd = ["fedmerge", "run", study["base"], *overrides, f"name={key}", "--output-dir", str(runs / key)]
        cmd.append("--no-progress")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        (runs / key).mkdir(parents=True, exist_ok=True)
        (runs / key / "error.txt").write_text(proc.stdout[-4000:] + proc.stderr[-4000:])
    return key, proc.returncode == 0


def stale(folder: Path, study: dict[str, Any], key: str, overrides: list[str]) -> str | None:
    """Why the run in ``folder`` is not the one the study asks for now (its grid, overrides or base
    config changed since it ran), or None. Runs are found by name, so without this check a changed
    study would silently reuse runs made with other settings."""
    want = load_config(study["base"], [*overrides, f"name={key}"]).model_dump(mode="json")
    try:
        have = load_config(folder / "config.yaml").model_dump(mode="json")
    except ConfigError as exc:
        return f"its config.yaml no longer loads ({exc})"
    diff = first_config_difference(have, want)
    return None if diff is None else f"{diff[0]}: study {diff[2]!r}, run {diff[1]!r}"


def run_all(jobs: list[tuple[str, list[str]]], study: dict[str, Any], runs: Path, workers: int) -> None:
    todo = []
    for key, overrides in jobs:
        folder = run_folder(runs, key)
        why = stale(folder, study, key, overrides) if folder is not None else None
        if why:
            raise SystemExit(
                f"error: {folder} was made with other settings ({why}); delete it, or restore the study file"
            )
        if not finished(folder):
            todo.append((key, overrides))
    if not todo:
        return
    t0 = time.time()
    print(f"{len(todo)} runs to do ({len(jobs) - len(todo)} done)", flush=True)
    with ThreadPoolExecutor(workers) as pool:
        for i, (key, ok) in enumerate(pool.map(lambda j: launch(study, runs, *j), todo), 1):
            eta = (time.time() - t0) / i * (len(todo) - i)
            print(f"[{i}/{len(todo)}] {key}: {'ok' if ok else 'FAILED'}  (eta {eta / 60:.0f} min)", flush=True)


def share_runs(study: dict[str, Any], runs: Path, old_study: dict[str, Any], old_runs: Path) -> int:
    """Copy into ``runs`` the finished runs of another study (a grid widened for some rows) that are
    exactly runs this study asks for: same row, grid point and seed, and a config that passes the
    staleness check. Its central references come too when the regime settings match. Returns the
    number of run folders copied; each keeps its own provenance (command, commit)."""
    copied = 0
    for method in study["methods"]:
        for gi, point in enumerate(grid_points(method)):
            for seed in study["seeds"]:
                key = run_key(method["label"], gi, seed)
                src = run_folder(old_runs, key)
                if run_folder(runs, key) is not None or not finished(src):
                    continue
                if stale(src, study, key, base_overrides(method, point, seed)) is None:
                    shutil.copytree(old_runs / key, runs / key, symlinks=True)
                    copied += 1

    def reference_settings(s: dict[str, Any]) -> tuple:
        opts = dict(s.get("regime", {}))
        return s["base"], opts.pop("lrs", None) or local_lrs(s), opts

    same_ref = reference_settings(study) == reference_settings(old_study)
    if same_ref:
        for seed in study["seeds"]:
            ref = old_runs / f"regime-seed{seed}.json"
            if ref.exists() and not (runs / ref.name).exists():
                runs.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ref, runs / ref.name)
    return copied


def base_overrides(method: dict[str, Any], point: dict[str, Any], seed: int) -> list[str]:
    return [*method.get("overrides", []), *(f"{k}={v}" for k, v in point.items()), f"seed={seed}"]


def summary_of(runs: Path, key: str) -> dict[str, Any] | None:
    folder = run_folder(runs, key)
    return json.loads((folder / "summary.json").read_text()) if finished(folder) else None


def metric_of(study: dict[str, Any]) -> tuple[str, str]:
    """The table's metric: ``metric: {scope: clients|global, name: acc|top5}`` (default: mean client top-1).

    ``global`` is the server model on the pooled test split (LIVAR's metric); tuning always reads the
    clients' validation split for the same name, since the test split is withheld.
    """
    m = study.get("metric") or {}
    return m.get("scope", "clients"), m.get("name", "acc")


def test_score(study: dict[str, Any], summary: dict[str, Any], when: str = "best_val") -> float:
    scope, name = metric_of(study)
    # A method without a server model (Local) falls back to the mean over its clients.
    part = summary[when].get(scope) or summary[when]["clients"]
    value = part.get(f"test_{name}", float("nan"))
    return value["mean"] if isinstance(value, dict) else value


def extra_score(summary: dict[str, Any], column: str) -> float:
    return summary["best_val"]["clients"][column]["mean"]


def val_score(summary: dict[str, Any] | None, study: dict[str, Any] | None = None) -> float:
    name = metric_of(study or {})[1]
    return summary["best_val"]["clients"][f"val_{name}"]["mean"] if summary else float("-inf")


def tune(study: dict[str, Any], runs: Path, workers: int) -> dict[str, int]:
    seed = study.get("tune_seed", study["seeds"][0])
    jobs = [
        (run_key(m["label"], i, seed), base_overrides(m, pt, seed))
        for m in study["methods"]
        for i, pt in enumerate(grid_points(m))
    ]
    run_all(jobs, study, runs, workers)
    return choose(study, runs)


def choose(study: dict[str, Any], runs: Path) -> dict[str, int]:
    """Per row, the grid point with the best validation top-1 on the tuning seed."""
    seed = study.get("tune_seed", study["seeds"][0])
    chosen = {}
    for m in study["methods"]:
        scores = [val_score(summary_of(runs, run_key(m["label"], i, seed)), study) for i in range(len(grid_points(m)))]
        chosen[m["label"]] = max(range(len(scores)), key=lambda i: scores[i])
    return chosen


def run_seeds(study: dict[str, Any], runs: Path, chosen: dict[str, int], workers: int) -> None:
    jobs = []
    for m in study["methods"]:
        i = chosen[m["label"]]
        for seed in study["seeds"]:
            jobs.append((run_key(m["label"], i, seed), base_overrides(m, grid_points(m)[i], seed)))
    run_all(jobs, study, runs, workers)


REFERENCE_MAX_EPOCHS = 40  # a study's regime.max_epochs when it sets none


def local_lrs(study: dict[str, Any]) -> list[float] | None:
    """The reference is tuned over the Local row's learning-rate grid (the same budget)."""
    for m in study["methods"]:
        if m["label"] == study.get("local_row", "Local"):
            return (m.get("grid") or {}).get("algorithm.lr")
    return None


def reference_settings_text(study: dict[str, Any]) -> str:
    """How this study's central reference was trained, as the report states it."""
    opts = study.get("regime", {})
    lrs, grid = opts.get("lrs"), local_lrs(study)
    cap = opts.get("max_epochs", REFERENCE_MAX_EPOCHS)
    epochs = f"The reference trains for at most {cap} epochs; its learning rate"
    if lrs is None and grid is None:
        return f"{epochs} is the base config's."
    source = "the Local row's grid" if lrs is None or lrs == grid else "{" + ", ".join(f"{lr:g}" for lr in lrs) + "}"
    return f"{epochs} is chosen per group from {source} by validation loss."


def regime(study: dict[str, Any], runs: Path) -> dict[int, dict[str, Any]]:
    out = {}
    opts = study.get("regime", {})
    for seed in study["seeds"]:
        file = runs / f"regime-seed{seed}.json"
        if not file.exists():
            cfg = load_config(study["base"], [*opts.get("overrides", []), f"seed={seed}"])
            ref = central_reference(
                load_data(cfg),
                cfg.model,
                cfg.algorithm,
                seed,
                scope=opts.get("scope", "auto"),
                max_epochs=opts.get("max_epochs", REFERENCE_MAX_EPOCHS),
                lrs=opts.get("lrs", local_lrs(study)),
            )
            runs.mkdir(parents=True, exist_ok=True)
            commit, dirty = source_commit()
            file.write_text(json.dumps({**ref.to_json(), "commit": commit, "dirty": dirty}))
        out[seed] = json.loads(file.read_text())
    return out


# --- the report --------------------------------------------------------------------------------


def pct(values: list[float]) -> str:
    vals = [100 * v for v in values if v == v]
    if not vals:
        return "-"
    if len(vals) == 1:
        return f"{vals[0]:.1f}"
    return f"{statistics.mean(vals):.1f} ± {statistics.stdev(vals):.1f}"


def row_runs(study: dict[str, Any], runs: Path, label: str, point: int) -> list[tuple[int, dict[str, Any], Path]]:
    out = []
    for seed in study["seeds"]:
        key = run_key(label, point, seed)
        s = summary_of(runs, key)
        if s is not None:
            out.append((seed, s, run_folder(runs, key)))
    return out


def ari_of(summary: dict[str, Any]) -> float | None:
    """Adjusted Rand index of the method's client-to-model assignment vs. the true groups, if any."""
    return (summary.get("cluster_recovery") or {}).get("ari")


def ari_text(rr: list[tuple[int, dict[str, Any], Path]]) -> str:
    values = [a for _, s, _ in rr if (a := ari_of(s)) is not None]
    if not values:
        return "-"
    return f"{values[0]:.2f}" if len(values) == 1 else f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def commits_of(folders: list[Path]) -> set[str]:
    return {(seg.get("commit") or "?")[:8] + ("+dirty" if seg.get("dirty") else "") for f in folders for seg in
            read_provenance(f)}  # fmt: skip


def results_json(study: dict[str, Any], runs: Path, chosen: dict[str, int], ref: dict[int, dict[str, Any]]) -> dict:
    """The study's numbers for the cross-study index (``scripts/reproductions_index.py``)."""
    local, fedavg = study.get("local_row", "Local"), study.get("fedavg_row", "FedAvg")
    rows, checks = {}, []
    for m in study["methods"]:
        rr = row_runs(study, runs, m["label"], chosen[m["label"]])
        rows[m["label"]] = {
            "chosen": grid_points(m)[chosen[m["label"]]],
            "seeds": [seed for seed, _, _ in rr],
            "best_val": [test_score(study, s) for _, s, _ in rr],
            "last": [test_score(study, s, "last") for _, s, _ in rr],
            **{c: [extra_score(s, c) for _, s, _ in rr] for c in study.get("columns", [])},
            "ari": [a for _, s, _ in rr if (a := ari_of(s)) is not None],
        }
    for seed in study["seeds"]:
        loc, fed = (summary_of(runs, run_key(r, chosen[r], seed)) for r in (local, fedavg))
        if loc and fed:
            acc = [x["best_val"]["clients"]["test_acc"]["mean"] for x in (loc, fed)]
            checks.append({"seed": seed, **regime_check(ref[seed]["mean"], *acc)})
    scope, name = metric_of(study)
    return {"title": study["title"], "metric": f"{scope} test {name}", "regime": checks, "rows": rows}


def report(study: dict[str, Any], runs: Path, chosen: dict[str, int], ref: dict[int, dict[str, Any]]) -> str:
    labels = {m["label"]: m for m in study["methods"]}
    local, fedavg = study.get("local_row", "Local"), study.get("fedavg_row", "FedAvg")
    lines = [f"# {study['title']}", "", study.get("description", "").strip(), ""]
    lines += [
        "Generated by `scripts/reproduce.py` from the run folders; do not edit (readings live in a separate file).",
        "",
        "## Regime check (before any result)",
        "",
        f"Bars: Local at least {LOCAL_GAP:.0f} points and FedAvg at least {FEDAVG_GAP:.0f} points below a central "
        "reference (one model trained centrally on the pooled training data of each ground-truth group, or of all "
        "clients for label-skew settings; epochs chosen on the pooled validation split), all evaluated on each "
        "client's own test split (mean over clients). " + reference_settings_text(study) + " Local and FedAvg are "
        "the tuned rows below, best-validation round.",
        "",
        "The column *with client prior* is the same central model with each client's training-label frequencies "
        "added to its log-probabilities: what a model that knows the client's label distribution reaches. It is "
        "shown for context; the bars use the plain reference.",
        "",
        "| seed | reference scope | central reference | with client prior | Local | FedAvg | Local gap | FedAvg gap "
        "| regime kept |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    checks = []
    for seed in study["seeds"]:
        loc = summary_of(runs, run_key(local, chosen[local], seed)) if local in labels else None
        fed = summary_of(runs, run_key(fedavg, chosen[fedavg], seed)) if fedavg in labels else None
        if loc is None or fed is None:
            continue
        c = regime_check(
            ref[seed]["mean"],
            loc["best_val"]["clients"]["test_acc"]["mean"],
            fed["best_val"]["clients"]["test_acc"]["mean"],
        )
        checks.append(c)
        lines.append(
            f"| {seed} | {ref[seed]['scope']} | {100 * c['reference']:.1f} | {100 * ref[seed]['mean_prior']:.1f} | "
            f"{100 * c['local']:.1f} | "
            f"{100 * c['fedavg']:.1f} | {c['local_gap']:.1f} | {c['fedavg_gap']:.1f} | "
            f"{'yes' if c['passes'] else 'NO'} |"
        )
    if checks:
        kept = all(c["passes"] for c in checks)
        mean_gap = statistics.mean(c["local_gap"] for c in checks), statistics.mean(c["fedavg_gap"] for c in checks)
        lines += [
            "",
            f"**Regime {'kept' if kept else 'NOT kept'}**: both bars met on {sum(c['passes'] for c in checks)} of "
            f"{len(checks)} seeds (mean gaps: Local {mean_gap[0]:.1f}, FedAvg {mean_gap[1]:.1f} points).",
        ]
    scope, name = metric_of(study)
    columns = study.get("columns", [])
    what = {"acc": "top-1", "top5": "top-5"}[name]
    metric_txt = f"Mean client test {what}" if scope == "clients" else f"Server model's {what} on the pooled test split"
    extra_txt = (
        f" Extra columns ({', '.join(columns)}): mean over clients at the best-validation round, ×100."
        if columns
        else ""
    )
    lines += [
        "",
        "## Results",
        "",
        f"{metric_txt} (%), mean ± std over seeds {study['seeds']}.{extra_txt} Each row's hyper-parameters were "
        f"chosen on the validation split of seed {study.get('tune_seed', study['seeds'][0])} from "
        f"{len(grid_points(study['methods'][0]))} grid points (the same budget for every row). ARI: adjusted Rand "
        "index of each client's argmax merge weight (IFCA: cluster; FedEM: argmax of its mixture weights) against "
        "its true group, at the last round.",
        "",
        "| method | chosen | seeds | best-val round | last round |"
        + "".join(f" {c} |" for c in columns)
        + " ARI | server params | per-client comm (down/up) | commits |",
        "|---|---|---|---|---|" + "---|" * len(columns) + "---|---|---|---|",
    ]
    for label, m in labels.items():
        point = grid_points(m)[chosen[label]]
        rr = row_runs(study, runs, label, chosen[label])
        if not rr:
            lines.append(f"| {label} | - | 0 | - | - |{' - |' * len(columns)} - | - | - | - |")
            continue
        best = [test_score(study, s) for _, s, _ in rr]
        last = [test_score(study, s, "last") for _, s, _ in rr]
        extra = "".join(f" {pct([extra_score(s, c) for _, s, _ in rr])} |" for c in columns)
        b = rr[0][1].get("parameter_budget", {})
        commits = commits_of([f for _, _, f in rr])
        chosen_txt = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in point.items()) or "-"
        lines.append(
            f"| {label} | {chosen_txt} | {len(rr)} | {pct(best)} | {pct(last)} |{extra} {ari_text(rr)} | "
            f"{b.get('server_stored', 0):,.0f} | "
            f"{b.get('down_per_client_round', 0):,.0f} / {b.get('up_per_client_round', 0):,.0f} | "
            f"{', '.join(sorted(commits))}{' (mixed)' if len(commits) > 1 else ''} |"
        )
    lines += ["", f"## Tuning (validation {what} %, tuning seed)", ""]
    lines += [f"| method | grid point | val {what} |", "|---|---|---|"]
    seed = study.get("tune_seed", study["seeds"][0])
    for label, m in labels.items():
        for i, pt in enumerate(grid_points(m)):
            s = summary_of(runs, run_key(label, i, seed))
            mark = " (chosen)" if i == chosen[label] else ""
            txt = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in pt.items())
            lines.append(f"| {label} | {txt}{mark} | {pct([val_score(s, study)]) if s else 'failed'} |")
    shown = os.path.relpath(runs.resolve())
    lines += ["", "## Commands (from each run's provenance.jsonl)", ""]
    lines += [f"Run-folder paths are shown relative to the repository root (`{shown}`).", "", "```"]
    for label in labels:
        for _, _, folder in row_runs(study, runs, label, chosen[label]):
            for seg in read_provenance(folder):
                lines.append(shown_command(seg["command"].replace(str(runs.resolve()), shown)))
    lines += ["```", ""]
    return "\n".join(lines)


def shown_command(command: str) -> str:
    """A run's command with absolute paths inside the repository shown relative to it (runs made from
    another checkout, or shared from another study's folder, record absolute run-folder paths)."""
    root = os.getcwd() + os.sep
    words = shlex.split(command)
    return shlex.join(os.path.relpath(w) if w.startswith(root) else w for w in words)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", type=Path)
    ap.add_argument("--runs", type=Path, help="run folders (default: runs/repro/STUDY_NAME)")
    ap.add_argument("--out", type=Path, help="report path (default: print)")
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel (each with one thread)")
    ap.add_argument("--report-only", action="store_true", help="write the report from the runs that exist")
    ap.add_argument(
        "--regime-only", action="store_true", help="only the Local and FedAvg rows: check the regime before the table"
    )
    ap.add_argument(
        "--share-runs-from",
        type=Path,
        metavar="OLD_STUDY",
        help="first copy the finished runs of OLD_STUDY (runs/repro/OLD_STUDY_NAME) that this study asks for "
        "unchanged (e.g. after widening some rows' grids)",
    )
    args = ap.parse_args()
    study = load_study(args.study)
    if args.regime_only:
        keep = {study.get("local_row", "Local"), study.get("fedavg_row", "FedAvg")}
        study["methods"] = [m for m in study["methods"] if m["label"] in keep]
        study["title"] += " (regime check only)"
    runs = args.runs or Path("runs/repro") / args.study.stem
    if args.share_runs_from:
        old = args.share_runs_from
        n = share_runs(study, runs, load_study(old), Path("runs/repro") / old.stem)
        print(f"{n} finished runs copied from {Path('runs/repro') / old.stem}", flush=True)
    if args.report_only:
        chosen = choose(study, runs)
    else:
        chosen = tune(study, runs, args.jobs)
        run_seeds(study, runs, chosen, args.jobs)
    ref = regime(study, runs)
    text = report(study, runs, chosen, ref)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(results_json(study, runs, chosen, ref), indent=1))
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
