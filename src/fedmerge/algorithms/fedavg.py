"""FedAvg (McMahan et al. 2017): local SGD, server averages weights by sample counts.

On a LoRA model (``minilm_lora``, ``vit_lora``, ``causal_lm_lora``) the weights are the adapters (and
head), so FedAvg is FedIT (Zhang et al. 2024, federated instruction tuning): there is no separate entry.
"""

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
    secure_aggregation_refusal = None
    vectorizable = True
