"""FedProx (Li et al. 2020): FedAvg plus the proximal term (mu/2)||w - w_g||^2 in the local loss."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedmerge.core.algorithm import ALGORITHMS, AlgorithmConfig, ClientContext, PlainSGD
from fedmerge.core.training import Proximal
from fedmerge.core.types import ClientState, Payload

from .base import GlobalModelAlgorithm


class FedProxConfig(AlgorithmConfig):
    name: Literal["fedprox"] = "fedprox"
    mu: float = Field(0.01, ge=0, description="proximal coefficient; the term is mu/2 * ||w - w_global||^2")


@ALGORITHMS.register(
    "fedprox", config=FedProxConfig, description="FedProx: FedAvg with a proximal term to the global model"
)
class FedProx(GlobalModelAlgorithm):
    name = "fedprox"
    dp_sgd_refusal = None
    central_dp_refusal = None
    secure_aggregation_refusal = None
    vectorizable = True

    def plain_sgd(self, payload: Payload, state: ClientState) -> PlainSGD:
        return PlainSGD(payload.tensors, self.config.mu)

    def proximal(self, payload: Payload, ctx: ClientContext) -> Proximal | None:
        if self.config.mu == 0:
            return None
        return Proximal(self.config.mu, {k: v.to(ctx.device) for k, v in payload.tensors.items()})
