"""Partial sharing: one part of the model is global (averaged by n_i), the rest stays with the client.

The part is chosen by the model's ``head_prefix`` (the last layer, ``classifier``): FedPer and FedRep
share the body and keep the head; LG-FedAvg shares the head and keeps the body. BatchNorm buffers
follow their module. Every client's personal part starts from the same initial weights as the
global part (as in the FedRep reference code), and lives in ClientState.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import nn

from fedmerge.core.algorithm import Algorithm, ClientContext, ClientDataLike, StateDict, adapt_epochs, with_epochs
from fedmerge.core.training import TrainStats, local_sgd
from fedmerge.core.types import ClientState, Payload, ServerState, Update

from ._personal import GapProbe, average_updates, is_head
from .base import load_weights, model_weights


@contextmanager
def trainable_only(model: nn.Module, names: set[str]):
    """Freeze every parameter not in ``names`` (no gradients computed), restoring flags after."""
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    try:
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n] and n in names)
        yield
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n])


class PartialSharingAlgorithm(Algorithm):
    """Server state and uploads hold only the shared keys; ClientState holds the personal keys."""

    share_head: ClassVar[bool]  # True: the head is global (LG-FedAvg); False: the body is (FedPer, FedRep)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._prefix = str(getattr(self.model_factory(torch.Generator().manual_seed(0)), "head_prefix", "classifier"))

    def is_shared(self, key: str) -> bool:
        return is_head(key, self._prefix) == self.share_head

    def shared(self, state: dict[str, torch.Tensor]) -> StateDict:
        return {k: v for k, v in state.items() if self.is_shared(k)}

    def personal(self, state: dict[str, torch.Tensor]) -> StateDict:
        return {k: v for k, v in state.items() if not self.is_shared(k)}

    # --- server --------------------------------------------------------------------------
    def init_server_state(self) -> ServerState:
        return ServerState(self.shared(self.initial_weights()))

    def init_client_state(self, cid: int) -> ClientState:
        return ClientState(self.personal(self.initial_weights()))

    def configure(self, state: ServerState, rnd: int, selected: list[int]) -> dict[int, Payload]:
        return {cid: Payload(state.tensors, {"round": rnd}) for cid in selected}

    def aggregate(self, state: ServerState, rnd: int, updates: dict[int, Update]) -> ServerState:
        return ServerState(average_updates(updates), dict(state.meta))

    # --- client --------------------------------------------------------------------------
    def local_train(self, data: ClientDataLike, ctx: ClientContext) -> tuple[TrainStats, dict[str, Any]]:
        """Train the assembled ``ctx.model``; returns the stats and extra update meta."""
        stats = local_sgd(
            ctx.model, data.x_train, data.y_train, self.config, ctx.generator("train"), private=ctx.private
        )
        return stats, {}

    def client_update(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> tuple[Update, ClientState]:
        load_weights(ctx, {**payload.tensors, **state.tensors})
        probe = GapProbe(data, ctx, self.config.gap_samples)
        stats, extra = self.local_train(data, ctx)
        meta = probe.meta(ctx, data, stats, **extra)
        weights = model_weights(ctx)
        return Update(self.shared(weights), meta), ClientState(self.personal(weights), dict(state.meta))

    def personalize(self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext) -> StateDict:
        return {**payload.tensors, **state.tensors}

    # --- a newcomer: its personal part (the common initialisation) trained on the frozen shared part ------------
    def configure_onboard(self, state: ServerState, rnd: int, cids: list[int]) -> dict[int, Payload]:
        return self.configure(state, rnd, cids)

    def onboard(self, payload: Payload, data: ClientDataLike, ctx: ClientContext) -> StateDict:
        """The shared part as received with the newcomer's personal part after ``adapt_epochs`` epochs of local
        SGD on it alone (with no budget: the common initialisation, so FedPer/FedRep's head is untrained). The
        shared part's BatchNorm statistics are the received ones too: nothing of it changes."""
        personal = self.init_client_state(ctx.cid).tensors
        epochs = adapt_epochs(payload)
        if epochs == 0:
            return {**payload.tensors, **personal}
        load_weights(ctx, {**payload.tensors, **personal})
        names = {n for n, _ in ctx.model.named_parameters() if not self.is_shared(n)}
        with trainable_only(ctx.model, names):
            local_sgd(ctx.model, data.x_train, data.y_train, with_epochs(self.config, epochs), ctx.generator("onboard"))
        return {**payload.tensors, **self.personal(model_weights(ctx))}
