"""Local: every client trains its own model on its own data; nothing is communicated.

All clients start from the same initial weights as the federated methods, so Local vs FedAvg
compares training regimes, not initialisations.
"""

from __future__ import annotations

from typing import Any, Literal

from fedmerge.core.algorithm import (
    ALGORITHMS,
    Algorithm,
    AlgorithmConfig,
    ClientContext,
    ClientDataLike,
    PlainSGD,
    StateDict,
)
from fedmerge.core.training import local_sgd
from fedmerge.core.types import ClientState, Payload, ServerState, Update

from .base import adapted_state, load_weights, model_weights


class LocalConfig(AlgorithmConfig):
    name: Literal["local"] = "local"


@ALGORITHMS.register("local", config=LocalConfig, description="Local: each client trains alone, no communication")
class Local(Algorithm):
    name = "local"
    dp_sgd_refusal = None
    central_dp_refusal = "sends nothing to the server"
    secure_aggregation_refusal = "sends nothing to the server"

    def init_server_state(self) -> ServerState:
        return ServerState()

    def init_client_state(self, cid: int) -> ClientState:
        return ClientState(self.initial_weights())

    def configure(self, state: ServerState, rnd: int, selected: list[int]) -> dict[int, Payload]:
        return {cid: Payload(meta={"round": rnd}) for cid in selected}

    def client_update(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> tuple[Update, ClientState]:
        load_weights(ctx, state.tensors)
        stats = local_sgd(
            ctx.model, data.x_train, data.y_train, self.config, ctx.generator("train"), private=ctx.private
        )
        meta = {"num_examples": int(data.y_train.shape[0]), "train_loss": stats.loss, "steps": stats.steps}
        return Update(meta=meta), ClientState(model_weights(ctx), dict(state.meta))

    vectorizable = True

    def plain_sgd(self, payload: Payload, state: ClientState) -> PlainSGD:
        return PlainSGD(state.tensors)

    def plain_sgd_result(
        self, payload: Payload, state: ClientState, trained: StateDict, meta: dict[str, Any]
    ) -> tuple[Update, ClientState]:
        kept = ("num_examples", "train_loss", "steps")  # what client_update reports
        return Update(meta={k: meta[k] for k in kept}), ClientState(trained, dict(state.meta))

    def aggregate(self, state: ServerState, rnd: int, updates: dict[int, Update]) -> ServerState:
        return state

    def personalize(self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext) -> StateDict:
        return state.tensors

    # a newcomer has nothing from the federation: it trains the common initial model alone for its budget
    def configure_onboard(self, state: ServerState, rnd: int, cids: list[int]) -> dict[int, Payload]:
        return self.configure(state, rnd, cids)

    def onboard(self, payload: Payload, data: ClientDataLike, ctx: ClientContext) -> StateDict:
        return adapted_state(self, payload, data, self.init_client_state(ctx.cid), ctx).tensors
