"""``fedmerge plot merge-weights RUN_DIR``: the merge-weight heatmaps (FedMerge Fig. 5) of a run folder, drawn by
the methods' own [`draw_merge_weights`][fedmerge.algorithms.assignments.draw_merge_weights]."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedmerge.algorithms import assignments
from fedmerge.algorithms.assignments import draw_merge_weights, pick_rounds
from fedmerge.run.results import SUMMARY_FILE, RunStore
from fedmerge.run.run_records import read_summary

__all__ = ["client_groups", "merge_weight_snapshots", "pick_rounds", "plot_merge_weights"]


def merge_weight_snapshots(run_dir: str | Path) -> list[tuple[int, np.ndarray]]:
    """(round, m x d merge-weight matrix) for every round of the run folder that logged one."""
    return assignments.merge_weight_snapshots(RunStore(run_dir).read_metrics())


def client_groups(run_dir: str | Path) -> list[int] | None:
    """Ground-truth group of each client: from summary.json when the runner stored it, else by
    rebuilding the (deterministic) partition from config.yaml. None when the partition has none."""
    run_dir = Path(run_dir)
    summary = run_dir / SUMMARY_FILE
    if summary.exists():
        groups = read_summary(summary).client_groups
        if groups is not None:
            return None if any(g is None for g in groups) else [int(g) for g in groups]
    from fedmerge.config.schema import load_config
    from fedmerge.run.prepare import load_data

    try:
        data = load_data(load_config(RunStore(run_dir).read_config_path()))
    except Exception:  # noqa: BLE001  (data gone or config from another version: plot without groups)
        return None
    groups = [c.group for c in data.clients]
    return None if any(g is None for g in groups) else [int(g) for g in groups]


def plot_merge_weights(
    run_dir: str | Path,
    out: str | Path | None = None,
    rounds: list[int] | None = None,
    panels: int = 4,
    groups: list[int] | None = None,
) -> Path:
    """One heatmap per round (clients x global models), clients sorted by true group with dashed boundaries
    between groups when the partition has groups; the PNG's path (default RUN_DIR/merge_weights.png)."""
    snaps = dict(merge_weight_snapshots(run_dir))
    if not snaps:
        raise ValueError(f"{run_dir}: no merge weights in metrics.jsonl (not a FedMerge run, or no evaluation yet)")
    chosen = pick_rounds(sorted(snaps), rounds, panels)  # a round not logged fails before groups are rebuilt
    groups = client_groups(run_dir) if groups is None else groups
    path = Path(out) if out is not None else Path(run_dir) / "merge_weights.png"
    return draw_merge_weights(snaps, path, chosen, panels, groups)
