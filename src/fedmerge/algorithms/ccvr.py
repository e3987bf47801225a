"""CCVR (Luo et al., NeurIPS 2021, "No Fear of Heterogeneity"): FedAvg + classifier calibration with
virtual representations.

Clients train exactly as in FedAvg and, after local training, also upload the per-class count, mean and
unbiased covariance of the penultimate features of their training data (eval mode, the trained model).
The server averages the weights by n_i, pools the statistics, draws ``samples_per_class`` virtual
features per class from ``N(mu_c, Sigma_c)`` and retrains only the final linear layer on them (the math
is in ``_ccvr.py``, shared with LIVAR).

``broadcast_calibrated`` chooses where the calibrated head goes:

- ``true`` (default): it replaces the global head: clients receive it next round, and the global model
  (pooled test) and every client's evaluation use it;
- ``false``: the paper's post-hoc use, as FL-bench implements it (calibrate at test time, evaluate,
  restore): clients keep training the uncalibrated FedAvg model; the calibrated head is kept next to it
  in the server state and used only for evaluation. The metrics of round r are then those of calibrating
  once after r rounds of FedAvg (the paper's protocol, at the final round; statistics as below). An option
  "calibrate only in the final round" is not offered: an algorithm does not know the round count (the
  runner lets ``rounds`` change on resume), and ``false`` gives the same final-round figures.

Differences from FL-bench's ``ccvr.py``: FL-bench computes the client statistics in a separate exchange
with the current global model; here they travel in the round's update and come from the locally trained
model (one exchange per round; the pooled statistics therefore describe the clients' bodies, not exactly
the averaged body the head sits on). FL-bench's local covariances are biased (``correction=0``) while its
pooling formula assumes unbiased ones; here they are unbiased, so the pooled covariance is exact. Rank-
deficient covariances are sampled through a clamped eigen-decomposition plus ``jitter`` (FL-bench calls
``np.random.multivariate_normal``).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from fedmerge.core.algorithm import ALGORITHMS, AlgorithmConfig, ClientContext, ClientDataLike, StateDict
from fedmerge.core.seeding import NO_CLIENT, torch_generator
from fedmerge.core.types import Payload, ServerState, Update

from ._ccvr import CCVRSettings, calibrate_head, client_class_stats
from ._features import linear_head, take_prefix, with_prefix
from .base import StatisticsAlgorithm

STATS = "ccvr/"  # per-class statistics in an Update
CALIBRATED = "calibrated/"  # the calibrated head in the server state (broadcast_calibrated: false)


class CCVRConfig(AlgorithmConfig):
    name: Literal["ccvr"] = "ccvr"
    samples_per_class: int = Field(200, ge=1, description="virtual features drawn per class for the calibration")
    calibration_epochs: int = Field(1, ge=1, description="epochs of classifier retraining on the virtual features")
    calibration_lr: float | None = Field(None, gt=0, description="SGD step size of the calibration (None: lr)")
    jitter: float = Field(1e-5, ge=0, description="added to each covariance eigenvalue before sampling")
    broadcast_calibrated: bool = Field(
        True,
        description="true: the calibrated head replaces the global head (clients train from it); false: post-hoc "
        "as in the paper/FL-bench, clients train the uncalibrated FedAvg model and only evaluation uses the "
        "calibrated head",
    )

    def ccvr_settings(self) -> CCVRSettings:
        return CCVRSettings(
            samples_per_class=self.samples_per_class,
            epochs=self.calibration_epochs,
            lr=self.calibration_lr,
            jitter=self.jitter,
        )


@ALGORITHMS.register("ccvr", config=CCVRConfig, description="CCVR: FedAvg + classifier calibration on virtual features")
class CCVR(StatisticsAlgorithm):
    name = "ccvr"
    stats_prefix = STATS
    config: CCVRConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._scratch = self.model_factory(torch.Generator().manual_seed(0))  # server-side calibration model
        self.num_classes = int(linear_head(self._scratch).out_features)

    # --- server ----------------------------------------------------------------------------
    def configure(self, state: ServerState, rnd: int, selected: list[int]) -> dict[int, Payload]:
        weights = take_prefix(CALIBRATED, state.tensors)[1]
        return {cid: Payload(weights, {"round": rnd}) for cid in selected}

    def configure_evaluate(self, state: ServerState, rnd: int, cids: list[int]) -> dict[int, Payload]:
        weights = self.global_model(state)
        return {cid: Payload(weights, {"round": rnd}) for cid in cids}

    def global_model(self, state: ServerState) -> StateDict | None:
        head, weights = take_prefix(CALIBRATED, state.tensors)
        return {**weights, **head}

    def aggregate(self, state: ServerState, rnd: int, updates: dict[int, Update]) -> ServerState:
        stats, _, avg = self.split(updates)
        gen = torch_generator(self.seed, rnd, NO_CLIENT, "ccvr/calibrate")
        calibrated = calibrate_head(self._scratch, avg, stats, self.config.ccvr_settings(), self.config, gen)
        if self.config.broadcast_calibrated:
            return ServerState(calibrated, dict(state.meta))
        head = {k: v for k, v in calibrated.items() if k.startswith("classifier.")}
        return ServerState({**avg, **with_prefix(CALIBRATED, head)}, dict(state.meta))

    # --- client ----------------------------------------------------------------------------
    def client_statistics(self, ctx: ClientContext, data: ClientDataLike) -> dict[str, torch.Tensor]:
        return client_class_stats(ctx.model, data.x_train, data.y_train, self.num_classes)
