"""FedProto (Tan et al., AAAI 2022): clients share class prototypes, not parameters.

Reference behaviour (official ``yuetan031/fedproto``, FL-bench ``fedproto.py``):

- every client's whole model is personal (ClientState), starting from the common initial weights, so
  ``lam: 0`` is exactly Local training;
- local loss: ``CE(model(x), y) + lam * MSE(features(x), P_y)``, with ``features`` the input of the final
  linear layer and ``P_y`` the global prototype of the sample's label. As in both references the MSE is
  ``nn.MSELoss()`` between the features and a copy of them whose rows are replaced by the global
  prototype where one exists: the mean over all ``B * D`` entries of the batch, rows without a global
  prototype contributing zero;
- local prototypes: the per-class mean of the features of the client's training data, taken in one eval
  pass after local training (the references average the features of the training passes; an eval pass
  describes the model actually uploaded and draws no randomness);
- server: the global prototype of class c is the *unweighted* mean of the prototypes of this round's
  clients that hold c; a (C,) boolean mask says which exist (classes no client of the round holds have
  none, as in the references). Communication: prototypes (and the mask) only;
- evaluation: each client's personal model.

``share_parameters: true`` is *not* FedProto's protocol: the parameters are also FedAvg-averaged by n_i
and broadcast (clients keep no personal model; the prototype term regularises FedAvg's local training),
so a global model exists and is evaluated, e.g. for a pooled-test comparison.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from fedmerge.core.algorithm import (
    ALGORITHMS,
    Algorithm,
    AlgorithmConfig,
    ClientContext,
    ClientDataLike,
    StateDict,
    adapt_epochs,
)
from fedmerge.core.merge import weighted_merge
from fedmerge.core.params import weighted_average
from fedmerge.core.training import ExtraLoss, Step, local_sgd
from fedmerge.core.types import ClientState, Payload, ServerState, Update

from ._features import class_moments, features_and_logits, linear_head, take_prefix
from ._personal import GapProbe
from .base import load_weights, model_weights

PROTO = "fedproto/"
PROTOTYPES = PROTO + "prototypes"  # (C, D) float
MASK = PROTO + "mask"  # (C,) bool: which prototypes exist


class FedProtoConfig(AlgorithmConfig):
    name: Literal["fedproto"] = "fedproto"
    lam: float = Field(1.0, ge=0, description="weight of the MSE between features and global prototypes")
    share_parameters: bool = Field(
        False,
        description="also FedAvg-average the parameters (a global model is trained and evaluated); "
        "not FedProto's original protocol",
    )


def prototype_loss(features: torch.Tensor, y: torch.Tensor, prototypes: torch.Tensor, mask: torch.Tensor):
    """``MSELoss(features, target)`` where ``target`` is ``features`` with each row replaced by the global
    prototype of its label, where one exists (so rows without one contribute zero but count in the mean)."""
    has = mask[y]
    target = torch.where(has[:, None], prototypes[y].to(features.dtype), features.detach())
    return ((features - target) ** 2).mean()


@ALGORITHMS.register(
    "fedproto", config=FedProtoConfig, description="FedProto: personal models regularised by shared class prototypes"
)
class FedProto(Algorithm):
    name = "fedproto"
    dp_sgd_refusal = "sends class prototypes (feature means of its training data), which DP-SGD does not cover"
    central_dp_refusal = "aggregates class prototypes per class, not one mean of updates"
    secure_aggregation_refusal = (
        "averages each class's prototypes by each client's class counts, so its server needs each update"
    )
    config: FedProtoConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        head = linear_head(self.model_factory(torch.Generator().manual_seed(0)))
        self.num_classes, self.feature_dim = int(head.out_features), int(head.in_features)

    # --- server ----------------------------------------------------------------------------
    def init_server_state(self) -> ServerState:
        tensors = {
            PROTOTYPES: torch.zeros((self.num_classes, self.feature_dim)),
            MASK: torch.zeros((self.num_classes,), dtype=torch.bool),
        }
        if self.config.share_parameters:
            tensors.update(self.initial_weights())
        return ServerState(tensors)

    def configure(self, state: ServerState, rnd: int, selected: list[int]) -> dict[int, Payload]:
        return {cid: Payload(state.tensors, {"round": rnd}) for cid in selected}

    def aggregate(self, state: ServerState, rnd: int, updates: dict[int, Update]) -> ServerState:
        cids = sorted(updates)
        protos = [updates[c].tensors[PROTOTYPES] for c in cids]
        masks = [updates[c].tensors[MASK] for c in cids]
        mask = torch.stack(masks).any(0)
        zeros = torch.zeros_like(protos[0])
        merged = weighted_merge(protos, [m.double()[:, None] for m in masks], fallback=zeros)
        tensors = {PROTOTYPES: merged, MASK: mask}
        if self.config.share_parameters:
            weights = [take_prefix(PROTO, updates[c].tensors)[1] for c in cids]
            tensors.update(weighted_average(weights, [updates[c].num_examples for c in cids]))
        return ServerState(tensors, dict(state.meta))

    def global_model(self, state: ServerState) -> StateDict | None:
        return take_prefix(PROTO, state.tensors)[1] if self.config.share_parameters else None

    # --- client ----------------------------------------------------------------------------
    def init_client_state(self, cid: int) -> ClientState:
        return ClientState() if self.config.share_parameters else ClientState(self.initial_weights())

    def _weights(self, payload: Payload, state: ClientState) -> StateDict:
        return take_prefix(PROTO, payload.tensors)[1] if self.config.share_parameters else state.tensors

    def client_update(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> tuple[Update, ClientState]:
        model = ctx.model
        load_weights(ctx, self._weights(payload, state))
        probe = GapProbe(data, ctx, self.config.gap_samples)
        head = linear_head(model)
        features: dict[str, torch.Tensor] = {}  # of the step's batch, kept by the forward for the extra loss

        def forward(xb: torch.Tensor) -> torch.Tensor:
            features["batch"] = feats = model.features(xb)
            return head(feats)

        prototypes, mask = payload.tensors[PROTOTYPES], payload.tensors[MASK]
        extra: ExtraLoss | None = None
        if self.config.lam > 0 and bool(mask.any()):

            def extra(step: Step) -> torch.Tensor:
                return self.config.lam * prototype_loss(features["batch"], step.y, prototypes, mask)

        stats = local_sgd(
            model,
            data.x_train,
            data.y_train,
            self.config,
            ctx.generator("train"),
            forward=forward,
            extra_loss=extra,
        )
        feats, _ = features_and_logits(model, data.x_train)
        moments = class_moments(feats, data.y_train, self.num_classes)
        upload = {PROTOTYPES: moments["mean"], MASK: moments["count"] > 0}
        weights = model_weights(ctx)
        meta = probe.meta(ctx, data, stats)
        if self.config.share_parameters:
            return Update({**weights, **upload}, meta), state
        return Update(upload, meta), ClientState(weights, dict(state.meta))

    def personalize(self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext) -> StateDict:
        return self._weights(payload, state)

    # a newcomer receives the global prototypes (and, with share_parameters, the shared model) and trains
    # its model by FedProto's local objective (CE + lam * distance to the prototypes) for its budget
    def configure_onboard(self, state: ServerState, rnd: int, cids: list[int]) -> dict[int, Payload]:
        return self.configure(state, rnd, cids)

    def onboard(self, payload: Payload, data: ClientDataLike, ctx: ClientContext) -> StateDict:
        state = self.init_client_state(ctx.cid)
        epochs = adapt_epochs(payload)
        if epochs == 0:
            return self._weights(payload, state)
        update, state = self.adapted(epochs).client_update(payload, data, state, ctx)
        return take_prefix(PROTO, update.tensors)[1] if self.config.share_parameters else state.tensors
