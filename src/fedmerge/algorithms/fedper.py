"""FedPer (Arivazhagan et al., 2019): shared body, personal head, trained jointly.

Reference behaviour (``lgcollins/FedRep`` @d82e629, ``--alg fedper``): every local epoch trains all
parameters; the server averages the body by n_i; the head (``head_prefix``) never leaves the client.
The reference optimiser (momentum 0.5, weight decay 1e-4 on weights only) is not special-cased: set
``momentum``/``weight_decay`` (the decay then also applies to biases). The reference's final
round of >= 10 fine-tuning epochs for every client is not reproduced.
"""

from __future__ import annotations

from typing import Literal

from fedmerge.core.algorithm import ALGORITHMS, AlgorithmConfig

from ._partial import PartialSharingAlgorithm


class FedPerConfig(AlgorithmConfig):
    name: Literal["fedper"] = "fedper"


@ALGORITHMS.register("fedper", config=FedPerConfig, description="FedPer: shared body, personal head (joint training)")
class FedPer(PartialSharingAlgorithm):
    name = "fedper"
    dp_sgd_refusal = None
    central_dp_refusal = None
    secure_aggregation_refusal = None
    share_head = False
