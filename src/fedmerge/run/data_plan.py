"""The data part of a run's plan, for everything that trains on a config's clients: a run
([`plan_run()`][fedmerge.run.plan.plan_run]), LIVAR's calibration, a study's central reference, the benchmarks.

[`plan_data()`][fedmerge.run.data_plan.plan_data] resolves the device and builds the config's clients there (or
takes the source's data, built already), once, the same way for all of them; the frozen
[`DataPlan`][fedmerge.run.data_plan.DataPlan] also builds the config's model for that data. It leaves torch's
thread count alone: a run sets it before (``plan_run``), and a caller that trains sets its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fedmerge.config.schema import ExperimentConfig
from fedmerge.data import FederatedDataset
from fedmerge.models import build_model
from fedmerge.run.prepare import data_warnings, load_data, resolve_device, without_test
from fedmerge.run.source import RunSource

Notify = Callable[[str], None]


@dataclass(frozen=True)
class DataPlan:
    """A config's clients, on its device: what a run trains on, and what a calibration or a central reference
    pools."""

    cfg: ExperimentConfig
    device: torch.device
    data: FederatedDataset  # on ``device``; without test splits when the source withholds them

    @property
    def sample(self) -> torch.Tensor:
        """Two training inputs (of the first client that has any): what the model checks run on."""
        return next(c.x_train[:2] for c in self.data.clients if c.n_train)

    @property
    def groups(self) -> list[int | None]:
        """The participants' ground-truth groups: the clients that never train (``split.unseen_clients``) come
        last and are not among them; their count is the population a method is built for."""
        return self.data.groups()[: self.data.num_participants]

    def build_model(self, generator: torch.Generator) -> torch.nn.Module:
        """The config's model for this data (its input shape and classes), initialised from ``generator``, on the
        CPU: a run's model factory."""
        return build_model(self.cfg.model, self.data.input_shape, self.data.num_classes, generator=generator)


def plan_data(
    cfg: ExperimentConfig,
    source: RunSource | None = None,
    *,
    device: torch.device | None = None,
    notify: Notify | None = None,
) -> DataPlan:
    """The clients of ``cfg`` on ``device`` (default: ``cfg.device``, refused in one line when absent): the
    source's data when it has some, else the config's dataset, partitioned and split. ``notify``: each
    `DataWarning` as one line (None: shown as Python warnings). A deployment has no data here: its nodes hold it."""
    source = source or RunSource()
    if source.deployment:  # a caller's mistake, not a user's
        raise ValueError("a deployment's data is on its nodes: plan_run plans it from their handshake")
    device = device if device is not None else resolve_device(cfg.device)
    data = source.data
    if data is None and notify is None:
        data = load_data(cfg)
    elif data is None:
        with data_warnings(notify):
            data = load_data(cfg)
    data = data.to(device)
    if source.withhold_test:
        data = without_test(data)
    return DataPlan(cfg, device, data)
