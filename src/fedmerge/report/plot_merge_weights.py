"""Plots drawn from a run folder (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fedmerge.run.results import SUMMARY_FILE, RunStore


def merge_weight_snapshots(run_dir: str | Path) -> list[tuple[int, np.ndarray]]:
    """(round, m x d merge-weight matrix) for every round that logged one (every round since they are
    logged each round; older runs have them at evaluation rounds only)."""
    rows = RunStore(run_dir).read_metrics()
    return [
        (int(r["round"]), np.asarray(r["server"]["merge_weights"], dtype=float))
        for r in rows
        if "merge_weights" in r.get("server", {})
    ]


def client_groups(run_dir: str | Path) -> list[int] | None:
    """Ground-truth group of each client: from summary.json when the runner stored it, else by
    rebuilding the (deterministic) partition from config.yaml. None when the partition has none."""
    run_dir = Path(run_dir)
    summary = run_dir / SUMMARY_FILE
    if summary.exists():
        groups = json.loads(summary.read_text()).get("client_groups")
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


def pick_rounds(available: list[int], wanted: list[int] | None, panels: int) -> list[int]:
    """The requested rounds (must be logged), or ``panels`` evenly spaced ones including the last."""
    if wanted:
        missing = sorted(set(wanted) - set(available))
        if missing:
            raise ValueError(f"no merge weights logged at round(s) {missing}; logged: {available}")
        return sorted(set(wanted))
    if len(available) <= panels:
        return available
    idx = np.unique(np.linspace(0, len(available) - 1, panels).round().astype(int))
    return [available[i] for i in idx]


def plot_merge_weights(
    run_dir: str | Path,
    out: str | Path | None = None,
    rounds: list[int] | None = None,
    panels: int = 4,
    groups: list[int] | None = None,
) -> Path:
    """The paper's Fig. 5: one heatmap per round (clients x global models), clients sorted by true
    group with dashed boundaries between groups when the partition has groups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    snaps = dict(merge_weight_snapshots(run_dir))
    if not snaps:
        raise ValueError(f"{run_dir}: no merge weights in metrics.jsonl (not a FedMerge run, or no evaluation yet)")
    chosen = pick_rounds(sorted(snaps), rounds, panels)
    groups = client_groups(run_dir) if groups is None else groups
    m = next(iter(snaps.values())).shape[0]
    order = np.arange(m) if groups is None else np.argsort(np.asarray(groups), kind="stable")
    bounds = [] if groups is None else np.flatnonzero(np.diff(np.asarray(groups)[order])) + 0.5

    fig, axes = plt.subplots(1, len(chosen), figsize=(2.2 + 2.4 * len(chosen), 0.8 + 0.12 * m), squeeze=False)
    # one colour scale for all panels, stretched to the values shown (early weights are near 1/d)
    vmin, vmax = min(float(snaps[r].min()) for r in chosen), max(float(snaps[r].max()) for r in chosen)
    image = None
    for ax, rnd in zip(axes[0], chosen):
        image = ax.imshow(snaps[rnd][order], aspect="auto", cmap="viridis", vmin=vmin, vmax=vmax, interpolation="none")
        for b in bounds:
            ax.axhline(b, color="white", linestyle="--", linewidth=1.0)
        ax.set_title(f"round {rnd}")
        ax.set_xlabel("global model")
        d = snaps[rnd].shape[1]
        ax.set_xticks(range(d) if d <= 12 else range(0, d, max(1, d // 6)))
    for ax in axes[0][1:]:
        ax.set_yticks([])
    axes[0][0].set_ylabel("client (sorted by true group)" if groups is not None else "client")
    if m <= 30:
        axes[0][0].set_yticks(range(m), [str(i) for i in order])
    fig.colorbar(image, ax=axes[0].tolist(), fraction=0.03, pad=0.02, label="merge weight")
    path = Path(out) if out is not None else Path(run_dir) / "merge_weights.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
