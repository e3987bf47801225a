"""FedAvg+ : FedAvg training, then each client fine-tunes the global model locally for evaluation.

Fine-tuning happens only in ``personalize`` (evaluation): it never feeds back into training,
and it is seeded by (round, client) so that every evaluation is reproducible.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedmerge.core.algorithm import ALGORITHMS, AlgorithmConfig, ClientContext, ClientDataLike, StateDict, adapt_epochs
from fedmerge.core.training import LocalTraining, local_sgd
from fedmerge.core.types import ClientState, Payload

from .base import GlobalModelAlgorithm, fine_tuned, load_weights, model_weights


class FedAvgFTConfig(AlgorithmConfig):
    name: Literal["fedavg_ft"] = "fedavg_ft"
    finetune_epochs: int = Field(1, ge=0, description="local fine-tuning epochs before evaluation")
    finetune_lr: float | None = Field(None, gt=0, description="fine-tuning learning rate (default: lr)")


@ALGORITHMS.register(
    "fedavg_ft",
    config=FedAvgFTConfig,
    description="FedAvg+: FedAvg, then k epochs of local fine-tuning per client",
)
class FedAvgFT(GlobalModelAlgorithm):
    name = "fedavg_ft"
    dp_sgd_refusal = None
    central_dp_refusal = None
    secure_aggregation_refusal = None
    vectorizable = True  # training is FedAvg's; the fine-tuning (evaluation) stays per client

    def personalize(self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext) -> StateDict:
        cfg = self.config
        if cfg.finetune_epochs == 0:
            return payload.tensors
        load_weights(ctx, payload.tensors)
        ft = LocalTraining(
            lr=cfg.finetune_lr or cfg.lr,
            local_epochs=cfg.finetune_epochs,
            batch_size=cfg.batch_size,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
        )
        local_sgd(ctx.model, data.x_train, data.y_train, ft, ctx.generator("finetune"))
        return model_weights(ctx)

    def onboard(self, payload: Payload, data: ClientDataLike, ctx: ClientContext) -> StateDict:
        """The global model fine-tuned as participants fine-tune it (``finetune_lr``), for the newcomer's budget."""
        cfg = self.config.model_copy(update={"lr": self.config.finetune_lr or self.config.lr})
        return fine_tuned(payload.tensors, data, cfg, ctx, adapt_epochs(payload))
