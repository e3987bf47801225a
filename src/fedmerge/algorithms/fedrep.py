"""FedRep (Collins et al., ICML 2021): shared body, personal head; head first, then body.

Each round (reference ``lgcollins/FedRep`` @d82e629, ``LocalUpdate.train``): the head trains for
``local_epochs - body_epochs`` epochs with the body frozen, then the body for ``body_epochs`` epochs
(the reference's ``local_rep_ep``, default 1) with the head frozen; each phase is one ``local_sgd``
call with its own optimiser and batch stream. Only the body is averaged (by n_i). ``steps`` in the
update meta is the total; ``head_steps``/``body_steps`` record each phase. ``local_steps`` is not
supported (the reference counts epochs). The reference's momentum 0.5 / wd 1e-4 on weights only is
not special-cased (set ``momentum``/``weight_decay``); its final fine-tuning round is not reproduced.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from fedmerge.core.algorithm import ALGORITHMS, AlgorithmConfig, ClientContext, ClientDataLike
from fedmerge.core.training import LocalTraining, TrainStats, local_sgd

from ._partial import PartialSharingAlgorithm, trainable_only


class FedRepConfig(AlgorithmConfig):
    name: Literal["fedrep"] = "fedrep"
    local_epochs: int = Field(5, ge=1, description="head epochs + body epochs (the reference's local_ep)")
    body_epochs: int = Field(1, ge=0, description="epochs on the body (head frozen), after the head epochs")

    @model_validator(mode="after")
    def _epochs(self) -> FedRepConfig:
        if self.local_steps is not None:
            raise ValueError("fedrep counts epochs: leave local_steps unset")
        if self.body_epochs >= self.local_epochs:
            raise ValueError("body_epochs must be below local_epochs (head epochs = local_epochs - body_epochs >= 1)")
        return self


@ALGORITHMS.register("fedrep", config=FedRepConfig, description="FedRep: personal head trained first, then shared body")
class FedRep(PartialSharingAlgorithm):
    name = "fedrep"
    dp_sgd_refusal = None
    central_dp_refusal = None
    secure_aggregation_refusal = None
    share_head = False

    def phase(self, data: ClientDataLike, ctx: ClientContext, names: set[str], epochs: int, purpose: str) -> TrainStats:
        if epochs == 0:
            return TrainStats(loss=float("nan"), steps=0, samples=0)
        cfg = LocalTraining(
            **{**self.config.model_dump(include=set(LocalTraining.model_fields)), "local_epochs": epochs}
        )
        with trainable_only(ctx.model, names):
            return local_sgd(ctx.model, data.x_train, data.y_train, cfg, ctx.generator(purpose), private=ctx.private)

    def local_train(self, data: ClientDataLike, ctx: ClientContext) -> tuple[TrainStats, dict[str, Any]]:
        names = [n for n, _ in ctx.model.named_parameters()]
        head = {n for n in names if not self.is_shared(n)}
        body = {n for n in names if self.is_shared(n)}
        cfg = self.config
        h = self.phase(data, ctx, head, cfg.local_epochs - cfg.body_epochs, "train-head")
        b = self.phase(data, ctx, body, cfg.body_epochs, "train-body")
        steps = h.steps + b.steps
        # the reported loss is the body phase's when there is one (the model that is uploaded)
        loss = b.loss if b.steps else h.loss
        return TrainStats(loss=loss, steps=steps, samples=h.samples + b.samples), {
            "head_steps": h.steps,
            "body_steps": b.steps,
        }
