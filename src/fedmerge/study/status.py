"""``fedmerge study --status``: how far each row of a study is, read from its run folders alone, so that it
shows the progress of runs on any machine that writes the (shared) run folders: a local process, a Ray task
or a SLURM job."""

from __future__ import annotations

import json
from pathlib import Path

from fedmerge.run.folder_lock import HOLDER_FILE
from fedmerge.run.results import METRICS_FILE, SUMMARY_FILE
from fedmerge.study.spec import Study, run_key
from fedmerge.sweep.launch import started_run


def run_state(runs: Path, key: str) -> str:
    """``done``, ``running on HOST (round R/N)``, ``stopped at round R/N``, or ``not started``."""
    folder = started_run(runs / key)
    if folder is None:
        return "not started"
    if (folder / SUMMARY_FILE).is_file():
        return "done"
    try:
        rounds = (folder / METRICS_FILE).read_bytes().count(b"\n")
    except OSError:
        rounds = 0
    try:
        import yaml

        planned = yaml.safe_load((folder / "config.yaml").read_text()).get("rounds", "?")
    except (OSError, ValueError, AttributeError):
        planned = "?"
    where = f"round {rounds}/{planned}"
    try:  # the holder file is there while a writer holds the folder (one left by a killed writer: stale)
        host = json.loads((folder / HOLDER_FILE).read_text()).get("host", "?")
        return f"running on {host} ({where})"
    except (OSError, ValueError):
        return f"stopped at {where}"


def status_lines(study: Study, runs: Path) -> list[str]:
    """Per row: its tuning runs, then its chosen point's runs on the other seeds once tuning has ended."""
    from fedmerge.study.protocol import choose

    seed = study.tuning_seed
    tuning = {m.label: [run_key(m.label, i, seed) for i in range(len(m.points()))] for m in study.methods}
    chosen = choose(study, runs)  # a row's choice counts once all its tuning runs are done
    lines = [f"{runs}: {study.title}"]
    for m in study.methods:
        states = [run_state(runs, k) for k in tuning[m.label]]
        lines.append(f"{m.label}: tuning {states.count('done')}/{len(states)} done")
        lines += [f"  {k}: {s}" for k, s in zip(tuning[m.label], states, strict=True) if s != "done"]
        others = [s for s in study.seeds if s != seed]
        if states.count("done") < len(states):
            lines.append(f"  seeds {others}: after tuning")
            continue
        keys = [run_key(m.label, chosen[m.label], s) for s in others]
        states = [run_state(runs, k) for k in keys]
        lines.append(f"{m.label}: seeds {states.count('done')}/{len(states)} done")
        lines += [f"  {k}: {s}" for k, s in zip(keys, states, strict=True) if s != "done"]
    refs = sum((runs / f"regime-seed{s}.json").exists() for s in study.seeds)
    lines.append(f"central references: {refs}/{len(study.seeds)}")
    return lines
