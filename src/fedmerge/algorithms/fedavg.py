"""FedAvg (McMahan et al. 2017): local SGD, server averages weights by sample counts."""

from __future__ import annotations

from typing import Literal

from fedmerge.core.algorithm import ALGORITHMS, AlgorithmConfig

from .base import GlobalModelAlgorithm


class FedAvgConfig(AlgorithmConfig):
    name: Literal["fedavg"] = "fedavg"


@ALGORITHMS.register("fedavg", config=FedAvgConfig, description="FedAvg: local SGD, weights averaged by sample count")
class FedAvg(GlobalModelAlgorithm):
    name = "fedavg"
    dp_sgd_refusal = None
    central_dp_refusal = None
    vectorizable = True
