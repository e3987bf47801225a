"""LG-FedAvg (Liang et al., 2020): local representation (body), global head.

As in the reference (``lgcollins/FedRep`` @d82e629, ``--alg lg``), the *top* layers are global: here
the layer under ``head_prefix`` (the model's ``classifier``); everything below it, with its
BatchNorm statistics, stays with the client. All parameters train jointly each local epoch; the server
averages the head by n_i. The original paper's FedAvg warm-up of the whole model is not reproduced
(every client's body starts from the common initialisation).
"""

from __future__ import annotations

from typing import Literal

from fedmerge.core.algorithm import ALGORITHMS, AlgorithmConfig

from ._partial import PartialSharingAlgorithm


class LGFedAvgConfig(AlgorithmConfig):
    name: Literal["lg_fedavg"] = "lg_fedavg"


@ALGORITHMS.register("lg_fedavg", config=LGFedAvgConfig, description="LG-FedAvg: local body, global head")
class LGFedAvg(PartialSharingAlgorithm):
    name = "lg_fedavg"
    dp_sgd_refusal = None
    central_dp_refusal = None
    secure_aggregation_refusal = None
    share_head = True
