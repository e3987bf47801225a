"""FedAvg with a server step size: w <- w + server_lr * (mean_i w_i - w), from a package of its own.

An example fedmerge plugin (docs/extending.md). Importing this module registers the method
``fedavg_server_lr``; fedmerge imports it through the entry point this package declares, or through
a config's ``plugins: [fedmerge_server_step]``; like every plugin it imports from ``fedmerge.api`` only.
Clients train exactly as in FedAvg (the inherited client step); only the server's aggregation changes.
``server_lr: 1`` is FedAvg; below 1 the server moves part of the way towards the clients' average, above 1
beyond it (FedOpt's server SGD step, no momentum: Reddi et al., ICLR 2021).

The method also says what it knows about its outputs (its registry hooks): it logs the length of each server
step (``server.step_norm``), adds their mean and last value to ``summary.json`` (``server_step``) and
``summary.md``, and draws them per round in ``fedmerge report`` and ``fedmerge plot figures``. Its command group,
``fedmerge server-step``, is the module ``fedmerge_server_step_cli``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field

from fedmerge.api import (
    ALGORITHMS,
    AlgorithmConfig,
    GlobalModelAlgorithm,
    MethodHooks,
    ReportFigure,
    RunFolder,
    ServerState,
    Update,
)


class ServerStepConfig(AlgorithmConfig):
    name: Literal["fedavg_server_lr"] = "fedavg_server_lr"
    server_lr: float = Field(1.0, gt=0, description="server step along (average of the clients' weights - w)")


def server_step(
    current: dict[str, torch.Tensor], average: dict[str, torch.Tensor], lr: float
) -> dict[str, torch.Tensor]:
    """current + lr * (average - current) for floating tensors; counters (integer buffers) take the average."""
    if lr == 1:
        return average  # FedAvg's model bit for bit (current + (average - current) may round differently)
    return {k: current[k] + lr * (v - current[k]) if v.is_floating_point() else v for k, v in average.items()}


def step_norm(current: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> float:
    """The length (L2 norm, in float64) of the server's move over the floating tensors."""
    return math.sqrt(sum(float(((new[k] - current[k]).double() ** 2).sum()) for k in new if new[k].is_floating_point()))


# --- what the method knows about its outputs: its registry hooks ----------------------------------------------
def logged_steps(rows: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(round, step norm) of every round that logged one."""
    return [(r["round"], r["server"]["step_norm"]) for r in rows if "step_norm" in r.get("server", {})]


def step_summary(rows: list[dict[str, Any]], info: dict[str, Any]) -> dict[str, Any]:
    """summary.json's ``server_step``: the mean and last step norm."""
    norms = [norm for _, norm in logged_steps(rows)]
    return {"server_step": {"mean_norm": sum(norms) / len(norms), "last_norm": norms[-1]}} if norms else {}


def step_lines(summary: dict[str, Any]) -> list[str]:
    """summary.md's line (also printed after ``fedmerge run``)."""
    step = summary.get("server_step")
    return ["", f"server step norm: mean {step['mean_norm']:.4f}, last {step['last_norm']:.4f}"] if step else []


def draw_steps(run: RunFolder, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds, norms = zip(*logged_steps(run.rows))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(rounds, norms, "o-")
    ax.set(xlabel="round", ylabel="norm of the server step", title=run.path.name)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


STEPS = ReportFigure(
    name="server_step",
    title="Server steps",
    note="How far the server moved the global model at each round (fedavg_server_lr, an example plugin).",
    empty="No run logged server steps.",
    applies=lambda run: bool(logged_steps(run.rows)),
    draw=draw_steps,
)


@ALGORITHMS.register(
    "fedavg_server_lr",
    config=ServerStepConfig,
    description="FedAvg with a server step size (example plugin)",
    hooks=MethodHooks(summary_extras=step_summary, summary_lines=step_lines, report_figures=(STEPS,)),
)
class FedAvgServerLR(GlobalModelAlgorithm):
    name = "fedavg_server_lr"

    def aggregate(self, state: ServerState, rnd: int, updates: dict[int, Update]) -> ServerState:
        average = super().aggregate(state, rnd, updates)  # FedAvg's mean by sample count
        new = server_step(state.tensors, average.tensors, self.config.server_lr)
        return ServerState(new, {**state.meta, "step_norm": step_norm(state.tensors, new)})

    def server_report(self, state: ServerState, rnd: int) -> dict[str, Any]:
        return {"step_norm": state.meta["step_norm"]} if "step_norm" in state.meta else {}
