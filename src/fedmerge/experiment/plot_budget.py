"""``fedmerge plot budget RUN_DIRS...``: accuracy against parameter budgets (FedMerge Figs. 3-4, 7).

One point per run: the last evaluated round's mean personalised test accuracy against three budgets
(float values, from each run's summary.json), the paper's Appendix "Server / Communicate / Client":

- server: what the server stores (``parameters.server_state``);
- communicated: sent to plus received from one client per round (``communication_per_client_per_round``
  down + up; IFCA and FedEM send k or M models down);
- client: what a client stores, its persistent state plus the model(s) it receives
  (``parameter_budget.client_stored`` when the summary has it, else computed the same way).

Runs of one algorithm are joined by a line in order of the x value, so varying the number of global
models or the architecture draws one curve per method.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .results import SUMMARY_FILE

AXES = (
    ("server", "server parameters"),
    ("communicated", "communicated parameters per client per round"),
    ("client", "parameters stored per client"),
)


def budget_point(run_dir: str | Path) -> dict[str, Any]:
    """{label, accuracy, server, communicated, client} of one finished run."""
    path = Path(run_dir) / SUMMARY_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; is {run_dir} a finished run folder?")
    summary = json.loads(path.read_text())
    try:
        accuracy = float(summary["last"]["clients"]["test_acc"]["mean"])
        params = summary["parameters"]
        comm = summary["communication_per_client_per_round"]
    except KeyError as err:
        raise ValueError(f"{path}: no {err} (a run with no evaluated round?)") from None
    budget = summary.get("parameter_budget", {})
    client = budget.get("client_stored", float(params.get("client_state_mean", 0.0)) + float(comm["down"]))
    return {
        "label": str(summary.get("algorithm", Path(run_dir).name)),
        "accuracy": accuracy,
        "server": float(params.get("server_state", math.nan)),
        "communicated": float(comm["down"]) + float(comm["up"]),
        "client": float(client),
    }


def plot_budget(run_dirs: list[Path], out: Path) -> Path:
    """Draw accuracy against each budget, one panel per budget; returns ``out`` (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not run_dirs:
        raise ValueError("plot_budget needs at least one run folder")
    points = [budget_point(d) for d in run_dirs]
    labels = sorted({p["label"] for p in points})
    fig, axes = plt.subplots(1, len(AXES), figsize=(4.2 * len(AXES), 3.6), sharey=True)
    for ax, (key, title) in zip(axes, AXES):
        for i, label in enumerate(labels):
            pts = sorted((p[key], p["accuracy"]) for p in points if p["label"] == label)
            ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", color=f"C{i % 10}", label=label)
        if all(p[key] > 0 for p in points):  # Local communicates nothing: keep 0 on a linear axis
            ax.set_xscale("log")
        ax.set_xlabel(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean test accuracy (last round)")
    axes[-1].legend(fontsize=8, loc="best")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
