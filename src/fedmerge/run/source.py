"""Where a run's clients and their data are: this process (its own data, or data built already) or a Flower Grid
(a simulation, or a deployment whose nodes own their data). [`plan_data()`][fedmerge.run.data_plan.plan_data] and
[`plan_run()`][fedmerge.run.plan.plan_run] plan from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedmerge.data import FederatedDataset


@dataclass(frozen=True)
class RunSource:
    """Where a run's clients and their data are.

    Local data (the default): this process builds the config's dataset, or uses ``data`` (built already:
    benchmarks); ``withhold_test`` removes the test split before training (``fedmerge tune``'s trials). ``grid``:
    a Flower Grid handed to a ServerApp (``engine: flower``); with ``deployment`` the nodes own their data and
    states, the server loads none and tests a global model only on ``pooled_test`` (a file of
    ``fedmerge export-clients --pooled-test``)."""

    data: FederatedDataset | None = None
    grid: Any = None
    deployment: bool = False
    pooled_test: str | None = None
    withhold_test: bool = False

    def __post_init__(self) -> None:
        if self.deployment and self.grid is None:  # a caller's mistake, not a user's
            raise ValueError("deployment=True needs the Grid of a ServerApp")

    @property
    def local(self) -> bool:
        """Whether ``cfg``'s clients run in this process (no Flower Grid to send them to)."""
        return self.grid is None
