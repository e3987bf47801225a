"""FedProx (Li et al. 2020): FedAvg plus the proximal term (mu/2)||w - w_g||^2 in the local loss."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedmerge.core.algorithm import ALGORITHMS, AlgorithmConfig, ClientContext, PlainSGD
from fedmerge.core.training import ExtraLoss, Step
from fedmerge.core.types import ClientState, Payload

from .base import GlobalModelAlgorithm


class FedProxConfig(AlgorithmConfig):
    name: Literal["fedprox"] = "fedprox"
    mu: float = Field(0.01, ge=0, description="proximal coefficient; the term is mu/2 * ||w - w_global||^2")


def proximal_term(mu: float, anchor: dict[str, torch.Tensor]) -> ExtraLoss:
    """(mu/2) * sum over trainable parameters of ||w - anchor||^2."""

    def term(step: Step) -> torch.Tensor:
        sq = [((p - anchor[n]) ** 2).sum() for n, p in step.model.named_parameters() if p.requires_grad]
        return 0.5 * mu * torch.stack(sq).sum()

    return term


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

    def extra_loss(self, payload: Payload, ctx: ClientContext) -> ExtraLoss | None:
        if self.config.mu == 0:
            return None
        anchor = {k: v.to(ctx.device) for k, v in payload.tensors.items()}
        return proximal_term(self.config.mu, anchor)
