"""Ditto (Li et al., ICML 2021): a personal model v pulled towards the global model.

Per minibatch (reference ``litian96/ditto`` @26d9b29): a personal step
``v <- v - personal_lr * (grad f(v) + lam * (v - w^t))`` with the anchor w^t = the global model
received this round, and a plain SGD step on the global copy w, on the same batch. Both are one
``local_sgd`` call: w is ``ctx.model`` (the task loss), v a second model run through
``functional_call`` whose loss CE(v) + lam/2 ||v - w^t||^2 on the step's batch is the ``extra_loss`` and
the ``proximal`` term;
the two losses have disjoint parameters, so the joint step is exactly the two separate steps. w's
trajectory is FedAvg's, bit for bit.

v lives in ClientState (starting from the common initial weights, so ``lam: 0`` is exactly Local);
only w travels. The server averages w by n_i (``weighting: samples``, default, which keeps
Ditto's global model identical to FedAvg's); the reference adds the unweighted mean of (w_i - w^t):
``weighting: uniform``. The reference's personal step is explicit (``prox_step: explicit``, default),
stable only for ``personal_lr * lam < 2`` (checked). ``prox_step: implicit`` takes the proximal term
implicitly (backward Euler): v <- (v - eta grad f(v) + eta lam w^t) / (1 + eta lam), which is the same
step with eta / (1 + eta lam): stable for every lam, and lam -> infinity gives v = w^t (FedAvg's model).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator
from torch.nn import functional as F

from fedmerge.core.algorithm import ALGORITHMS, AlgorithmConfig, ClientContext, ClientDataLike, StateDict
from fedmerge.core.training import Proximal, Step
from fedmerge.core.types import ClientState, Payload, ServerState, Update

from ._personal import GapProbe, SecondModel, Weighting, average_updates
from .base import GlobalModelAlgorithm, adapted_state, client_sgd, load_weights, model_weights


class DittoConfig(AlgorithmConfig):
    name: Literal["ditto"] = "ditto"
    lam: float = Field(1.0, ge=0, description="pull of the personal model towards the global model")
    personal_lr: float | None = Field(None, gt=0, description="step size of the personal model (default: lr)")
    weighting: Weighting = Field("samples", description="server average of w_i: by n_i, or uniform (reference)")
    prox_step: Literal["explicit", "implicit"] = Field(
        "explicit", description="explicit: the reference's gradient step; implicit: backward Euler, stable for any lam"
    )

    @model_validator(mode="after")
    def _stable(self) -> DittoConfig:
        if self.prox_step == "explicit" and (self.personal_lr or self.lr) * self.lam >= 2:
            raise ValueError("personal_lr * lam must be below 2 (the explicit proximal step diverges otherwise)")
        return self


@ALGORITHMS.register(
    "ditto", config=DittoConfig, description="Ditto: personal model with a proximal pull to the global"
)
class Ditto(GlobalModelAlgorithm):
    name = "ditto"
    dp_sgd_refusal = None
    central_dp_refusal = None
    secure_aggregation_refusal = None

    def init_client_state(self, cid: int) -> ClientState:
        return ClientState(self.initial_weights())

    def aggregate(self, state: ServerState, rnd: int, updates: dict[int, Update]) -> ServerState:
        return ServerState(average_updates(updates, self.config.weighting), dict(state.meta))

    def secure_weight(self, meta: dict) -> float:
        return float(meta["num_examples"]) if self.config.weighting == "samples" else 1.0

    def client_update(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> tuple[Update, ClientState]:
        cfg = self.config
        load_weights(ctx, payload.tensors)
        probe = GapProbe(data, ctx, self.config.gap_samples)
        v = SecondModel(state.tensors, ctx.model, ctx.device)
        anchor = {k: payload.tensors[k].detach() for k in v.params}

        def personal_loss(step: Step) -> torch.Tensor:  # v's objective on this step's batch, less its pull
            return F.cross_entropy(v(ctx.model, step.x), step.y)

        plr = cfg.personal_lr or cfg.lr
        if cfg.prox_step == "implicit":
            plr = plr / (1.0 + plr * cfg.lam)
        groups = [
            {"params": [p for p in ctx.model.parameters() if p.requires_grad]},
            {"params": list(v.params.values()), "lr": plr},
        ]
        opt = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        stats = client_sgd(
            ctx,
            data,
            cfg,
            extra_loss=personal_loss,
            proximal=Proximal(cfg.lam, anchor, v.params) if cfg.lam > 0 else None,
            optimizer=opt,
            private=ctx.private,  # DP-SGD on w (sent); v never leaves the client
        )
        meta = probe.meta(ctx, data, stats)
        return Update(model_weights(ctx), meta), ClientState(v.state(), dict(state.meta))

    def personalize(self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext) -> StateDict:
        return state.tensors

    def onboard(self, payload: Payload, data: ClientDataLike, ctx: ClientContext) -> StateDict:
        """A newcomer's v starts from the global model and follows Ditto's personal objective (the pull to
        the global model included) for the adaptation budget; with no budget it is the global model."""
        start = ClientState({k: v.detach().clone() for k, v in payload.tensors.items()})
        return adapted_state(self, payload, data, start, ctx).tensors
