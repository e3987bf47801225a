"""FedAvg with a server step size: w <- w + server_lr * (mean_i w_i - w), from a package of its own.

An example fedmerge plugin (docs/extending.md). Importing this module registers the method
``fedavg_server_lr``; fedmerge imports it through the entry point this package declares, or through
a config's ``plugins: [fedmerge_server_step]``; like every plugin it imports from ``fedmerge.api`` only.
Clients train exactly as in FedAvg (the inherited client step); only the server's aggregation changes.
``server_lr: 1`` is FedAvg; below 1 the server moves part of the way towards the clients' average, above 1
beyond it (FedOpt's server SGD step, no momentum: Reddi et al., ICLR 2021).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedmerge.api import ALGORITHMS, AlgorithmConfig, GlobalModelAlgorithm, ServerState, Update


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


@ALGORITHMS.register(
    "fedavg_server_lr", config=ServerStepConfig, description="FedAvg with a server step size (example plugin)"
)
class FedAvgServerLR(GlobalModelAlgorithm):
    name = "fedavg_server_lr"

    def aggregate(self, state: ServerState, rnd: int, updates: dict[int, Update]) -> ServerState:
        average = super().aggregate(state, rnd, updates)  # FedAvg's mean by sample count
        return ServerState(server_step(state.tensors, average.tensors, self.config.server_lr), dict(state.meta))
