"""Accuracy along the line between the federated and the local model, read back (SuPerFed Fig. 3 / A2).

SuPerFed (and APFL with ``lambda_steps``) log ``lambda=<x>/<split>_acc`` client summaries at evaluation rounds;
[`LAMBDA_HOOKS`][fedmerge.algorithms.lambda_line.LAMBDA_HOOKS], their registry hooks, draw the mean across clients
with a +- std band, plus the personalised model (best lambda per client, chosen on validation) as a reference line.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from fedmerge.core.method_hooks import MethodHooks, ReportFigure, Rows

_KEY = re.compile(r"^lambda=([0-9.eE+-]+)/(\w+)_acc$")


def lambda_curve(rows: Rows, split: str = "test", rnd: int | None = None) -> dict[str, Any]:
    """{round, lambdas, mean, std, personalized: (mean, std), best_lambda_counts} for one evaluation round
    (the last one that has the line, unless ``rnd``)."""
    candidates = [
        r
        for r in rows
        if "summary" in r and any(_KEY.match(k) for k in r["summary"]) and (rnd is None or r["round"] == rnd)
    ]
    if not candidates:
        raise ValueError("no lambda=.../..._acc metrics in this run (SuPerFed logs them once mixing has started)")
    row = candidates[-1]
    points = sorted(
        (float(m.group(1)), v) for k, v in row["summary"].items() if (m := _KEY.match(k)) and m.group(2) == split
    )
    personal = row["summary"].get(f"{split}_acc", {})
    # which lambda each client's personalised model is (the first one whose val acc equals the best)
    counts: dict[float, int] = {}
    for metrics in row.get("eval", {}).get("clients", {}).values():
        line = {float(m.group(1)): v for k, v in metrics.items() if (m := _KEY.match(k)) and m.group(2) == "val"}
        if line:
            best = max(line.items(), key=lambda kv: kv[1])[0]
            counts[best] = counts.get(best, 0) + 1
    return {
        "round": row["round"],
        "lambdas": [p[0] for p in points],
        "mean": [p[1]["mean"] for p in points],
        "std": [p[1]["std"] for p in points],
        "personalized": (personal.get("mean"), personal.get("std")),
        "best_lambda_counts": dict(sorted(counts.items())),
    }


def draw_lambda(curve: dict[str, Any], path: Path, title: str, split: str = "test") -> Path:
    """Mean +- std client accuracy against lambda (a [`lambda_curve`][fedmerge.algorithms.lambda_line.lambda_curve])
    as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lam, mean, std = (np.asarray(curve[k], dtype=float) for k in ("lambdas", "mean", "std"))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(lam, mean, "o-", color="tab:orange", label="W(lambda), mean over clients")
    ax.fill_between(lam, mean - std, mean + std, color="tab:orange", alpha=0.2, label="+- std")
    p_mean, p_std = curve["personalized"]
    if p_mean is not None:
        ax.axhline(p_mean, color="tab:blue", ls="--", label=f"personalised (best lambda): {p_mean:.3f}")
    ax.set_xlabel("lambda  (0 = federated model, 1 = local model)")
    ax.set_ylabel(f"{split} accuracy")
    ax.set_xlim(-0.02, 1.02)
    ax.set_title(f"{title}: round {curve['round']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower center")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


LAMBDA_LINE = ReportFigure(
    name="lambda",
    title="Lambda curves",
    note="Accuracy along the line between the federated (λ = 0) and the local (λ = 1) model (SuPerFed).",
    empty="No run logged a lambda curve.",
    applies=lambda run: any(any(k.startswith("lambda=") for k in r.get("summary", {})) for r in run.rows),
    draw=lambda run, path: draw_lambda(lambda_curve(run.rows), path, Path(run.path).name),
    order=20,
)

LAMBDA_HOOKS = MethodHooks(report_figures=(LAMBDA_LINE,))
