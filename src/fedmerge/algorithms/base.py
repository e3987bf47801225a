"""Shared server logic for methods with one global model averaged by sample counts."""

from __future__ import annotations

from fedmerge.core.algorithm import Algorithm, ClientContext, ClientDataLike, StateDict
from fedmerge.core.params import clone_state, weighted_average
from fedmerge.core.training import ExtraLoss, local_sgd
from fedmerge.core.types import ClientState, Payload, ServerState, Update


def load_weights(ctx: ClientContext, weights: StateDict) -> None:
    ctx.model.load_state_dict(weights, strict=True)


def model_weights(ctx: ClientContext) -> StateDict:
    return clone_state(ctx.model.state_dict())


class GlobalModelAlgorithm(Algorithm):
    """FedAvg's server: broadcast the global weights, average the returned weights by n_i.

    Subclasses change only the client side (a loss term, a personalisation step).
    """

    def init_server_state(self) -> ServerState:
        return ServerState(self.initial_weights())

    def configure(self, state: ServerState, rnd: int, selected: list[int]) -> dict[int, Payload]:
        # Payloads share tensors: the engine must not mutate them (load_state_dict copies).
        return {cid: Payload(state.tensors, {"round": rnd}) for cid in selected}

    def aggregate(self, state: ServerState, rnd: int, updates: dict[int, Update]) -> ServerState:
        cids = sorted(updates)
        avg = weighted_average([updates[c].tensors for c in cids], [updates[c].num_examples for c in cids])
        return ServerState(avg, dict(state.meta))

    def global_model(self, state: ServerState) -> StateDict | None:
        return state.tensors

    def extra_loss(self, payload: Payload, ctx: ClientContext) -> ExtraLoss | None:
        """Hook for methods that only add a loss term (FedProx)."""
        return None

    def client_update(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> tuple[Update, ClientState]:
        load_weights(ctx, payload.tensors)
        stats = local_sgd(
            ctx.model,
            data.x_train,
            data.y_train,
            self.config,
            ctx.generator("train"),
            extra_loss=self.extra_loss(payload, ctx),
        )
        meta = {"num_examples": int(data.y_train.shape[0]), "train_loss": stats.loss, "steps": stats.steps}
        return Update(model_weights(ctx), meta), state

    def personalize(self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext) -> StateDict:
        return payload.tensors
