"""What the methods that assign clients to several global models log, read back: FedMerge's merge weights, IFCA's
cluster choices and FedEM's mixture weights, all a client x model matrix in ``server.merge_weights`` (or, when only
some clients are evaluated, ``server.merge_weights_clients``: {client id: row}).

[`ASSIGNMENT_HOOKS`][fedmerge.algorithms.assignments.ASSIGNMENT_HOOKS], the three methods' registry hooks: how well the
argmax assignment recovers the partition's true groups (``cluster_recovery`` in the summary), and the heatmaps of the
matrix at several rounds (the FedMerge paper's Fig. 5) in reports.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fedmerge.core.method_hooks import MethodHooks, ReportFigure, Rows, RunFolder


def cluster_recovery(rows: Rows, groups: list[int | None]) -> dict[str, Any]:
    """Adjusted Rand index between each client's argmax merge weight and its true group, at the
    last round that logged merge weights (``server.merge_weights``, or the evaluated clients'
    ``server.merge_weights_clients``)."""
    if any(g is None for g in groups):
        return {}
    from sklearn.metrics import adjusted_rand_score

    per_round = {}
    for r in rows:
        server = r.get("server", {})
        if "merge_weights" in server and len(server["merge_weights"]) == len(groups):
            truth, weights = groups, server["merge_weights"]
        elif "merge_weights_clients" in server:  # evaluated clients only (eval_clients: sample:K, participants)
            truth = [groups[int(c)] for c in server["merge_weights_clients"]]
            weights = list(server["merge_weights_clients"].values())
        else:
            continue
        argmax = [max(range(len(row)), key=row.__getitem__) for row in weights]
        per_round[r["round"]] = float(adjusted_rand_score(truth, argmax))
    if not per_round:
        return {}
    last = max(per_round)
    return {"round": last, "ari": per_round[last], "ari_by_round": {str(k): v for k, v in sorted(per_round.items())}}


def recovery_extras(rows: Rows, info: dict[str, Any]) -> dict[str, Any]:
    """The summary's ``cluster_recovery``, for partitions with true groups (``info["client_groups"]``)."""
    groups = info.get("client_groups")
    recovery = cluster_recovery(rows, groups) if groups is not None else {}
    return {"cluster_recovery": recovery} if recovery else {}


def recovery_lines(summary: dict[str, Any]) -> list[str]:
    recovery = summary.get("cluster_recovery")
    if not recovery:
        return []
    return [
        "",
        f"cluster recovery (ARI of argmax merge weight vs. true group) at round "
        f"{recovery['round']}: {recovery['ari']:.4f}",
    ]


def merge_weight_snapshots(rows: Rows) -> list[tuple[int, np.ndarray]]:
    """(round, m x d merge-weight matrix) for every round that logged one (every round since they are
    logged each round; older runs have them at evaluation rounds only)."""
    return [
        (int(r["round"]), np.asarray(r["server"]["merge_weights"], dtype=float))
        for r in rows
        if "merge_weights" in r.get("server", {})
    ]


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


def draw_merge_weights(
    snaps: dict[int, np.ndarray],
    path: Path,
    rounds: list[int] | None = None,
    panels: int = 4,
    groups: list[int] | None = None,
) -> Path:
    """The paper's Fig. 5: one heatmap per round (clients x global models), clients sorted by true
    group with dashed boundaries between groups when the partition has groups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = pick_rounds(sorted(snaps), rounds, panels)
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
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def _draw(run: RunFolder, path: Path) -> Path:
    snaps = dict(merge_weight_snapshots(run.rows))
    if not snaps:
        raise ValueError(f"{run.path}: no merge weights in metrics.jsonl (not a FedMerge run, or no evaluation yet)")
    return draw_merge_weights(snaps, path, groups=run.client_groups())


MERGE_WEIGHTS = ReportFigure(
    name="merge_weights",
    title="Merge weights",
    note="Clients × global models, at several rounds (FedMerge; IFCA and FedEM assignments), one run per method "
    "and setting.",
    empty="No run logged merge weights.",
    applies=lambda run: any("merge_weights" in r.get("server", {}) for r in run.rows),
    draw=_draw,
    order=10,
)

ASSIGNMENT_HOOKS = MethodHooks(
    summary_extras=recovery_extras, summary_lines=recovery_lines, report_figures=(MERGE_WEIGHTS,)
)
