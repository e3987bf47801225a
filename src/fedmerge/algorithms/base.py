"""Shared server logic for methods with one global model averaged by sample counts."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from fedmerge.core.algorithm import (
    Algorithm,
    ClientContext,
    ClientDataLike,
    PlainSGD,
    Predictor,
    StateDict,
    adapt_epochs,
    with_epochs,
)
from fedmerge.core.model_state import copy_state, load_state
from fedmerge.core.params import weighted_average
from fedmerge.core.seeding import NO_ROUND, torch_generator
from fedmerge.core.training import ExtraLoss, LocalTraining, Proximal, StepHook, TrainStats, local_sgd, mean_loss
from fedmerge.core.types import ClientState, Payload, ServerState, Update

from ._features import take_prefix, with_prefix


def load_weights(ctx: ClientContext, weights: StateDict) -> None:
    load_state(ctx.model, weights)  # = load_state_dict(weights, strict=True), cheaper per client


def model_weights(ctx: ClientContext) -> StateDict:
    return copy_state(ctx.model)  # = clone of state_dict(), cheaper per client


def gap_subset(data: ClientDataLike, ctx: ClientContext, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed subset (same every round) of up to ``samples`` training examples, for the local-global
    gap. Empty when ``samples`` is 0 (the default ``gap_samples``): the losses are then NaN, cost
    nothing (no draw, no forward pass: [`gap_loss()`][fedmerge.algorithms.base.gap_loss]), and the round loop leaves
    the gap out."""
    if samples == 0:
        return data.x_train[:0], data.y_train[:0]
    n = int(data.y_train.shape[0])
    if n <= samples:
        return data.x_train, data.y_train
    gen = torch_generator(ctx.seed, NO_ROUND, ctx.cid, "local-gap")
    idx = torch.randperm(n, generator=gen)[:samples].to(data.y_train.device)
    return data.x_train[idx], data.y_train[idx]


def gap_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The training loss on a `gap_subset()`; NaN, without touching the model, when it is empty."""
    return mean_loss(model, x, y) if y.numel() else float("nan")


def client_sgd(ctx: ClientContext, data: ClientDataLike, cfg: LocalTraining, **options: Any) -> TrainStats:
    """The client's training step on its own data: [`local_sgd()`][fedmerge.core.training.local_sgd] on ``ctx.model``
    and the client's training split, drawing batches from the round's ``"train"`` generator.

    ``options`` are ``local_sgd``'s keywords (``params``, ``extra_loss``, ``proximal``, ``before_step``,
    ``before_forward``, ``forward``, ``optimizer``, ``private``); nothing is added to them, so DP-SGD runs only
    where the caller passes ``private=ctx.private``. The personal-model methods (APFL, Ditto, pFedMe, SuPerFed)
    train through it.
    """
    return local_sgd(ctx.model, data.x_train, data.y_train, cfg, ctx.generator("train"), **options)


def train_received(
    weights: StateDict,
    data: ClientDataLike,
    cfg: LocalTraining,
    ctx: ClientContext,
    extra_loss: ExtraLoss | None = None,
    before_step: StepHook | None = None,
    after_step: StepHook | None = None,
    proximal: Proximal | None = None,
) -> dict[str, Any]:
    """Load the received weights into ``ctx.model``, train locally, and return the update's meta.

    Besides ``num_examples``/``train_loss``/``steps`` the meta carries the local-global gap: the
    training loss (eval mode, on `gap_subset()`) of the model as received (``loss_received``) and
    after local training (``loss_trained``). Both are forward passes only, and draw no randomness,
    so training is unchanged by them.
    """
    load_weights(ctx, weights)
    xg, yg = gap_subset(data, ctx, cfg.gap_samples)
    received = gap_loss(ctx.model, xg, yg)
    stats = local_sgd(
        ctx.model, data.x_train, data.y_train, cfg, ctx.generator("train"),
        extra_loss=extra_loss, proximal=proximal, before_step=before_step, after_step=after_step,
        private=ctx.private,
    )  # fmt: skip
    return {
        "num_examples": int(data.y_train.shape[0]),
        "train_loss": stats.loss,
        "steps": stats.steps,
        "loss_received": received,
        "loss_trained": gap_loss(ctx.model, xg, yg),
    }


def fine_tuned(
    weights: StateDict, data: ClientDataLike, cfg: LocalTraining, ctx: ClientContext, epochs: int
) -> StateDict:
    """``weights`` after ``epochs`` epochs of plain local SGD on the client's training split (the method's
    step size, batch size, momentum and weight decay); ``weights`` themselves when ``epochs`` is 0."""
    if epochs == 0:
        return weights
    load_weights(ctx, weights)
    local_sgd(ctx.model, data.x_train, data.y_train, with_epochs(cfg, epochs), ctx.generator("onboard"))
    return model_weights(ctx)


def adapted_state(
    algorithm: Algorithm, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
) -> ClientState:
    """A newcomer's client state after ``adapt_epochs(payload)`` epochs of the method's own client update,
    started from ``state`` (the update it would send is dropped: a newcomer sends nothing)."""
    epochs = adapt_epochs(payload)
    if epochs == 0:
        return state
    return algorithm.adapted(epochs).client_update(payload, data, state, ctx)[1]


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
        """Hook for methods that only add a loss term."""
        return None

    def proximal(self, payload: Payload, ctx: ClientContext) -> Proximal | None:
        """Hook for methods that only add a proximal term (FedProx)."""
        return None

    def client_update(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> tuple[Update, ClientState]:
        meta = train_received(
            payload.tensors, data, self.config, ctx, self.extra_loss(payload, ctx),
            proximal=self.proximal(payload, ctx),
        )  # fmt: skip
        return Update(model_weights(ctx), meta), state

    def personalize(self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext) -> StateDict:
        return payload.tensors

    def plain_sgd(self, payload: Payload, state: ClientState) -> PlainSGD:
        return PlainSGD(payload.tensors)

    # a newcomer gets the global model, fine-tuned for its adaptation budget
    def configure_onboard(self, state: ServerState, rnd: int, cids: list[int]) -> dict[int, Payload]:
        weights = self.global_model(state)
        assert weights is not None, f"{self.name} has a global model"
        return {cid: Payload(weights, {"round": rnd}) for cid in cids}

    def onboard(self, payload: Payload, data: ClientDataLike, ctx: ClientContext) -> StateDict | Predictor:
        return fine_tuned(payload.tensors, data, self.config, ctx, adapt_epochs(payload))

    def plain_sgd_result(
        self, payload: Payload, state: ClientState, trained: StateDict, meta: dict[str, Any]
    ) -> tuple[Update, ClientState]:
        return Update(trained, meta), state


class StatisticsAlgorithm(GlobalModelAlgorithm):
    """FedAvg's training whose clients also send statistics of their trained model (input Grams,
    Fishers, class moments) next to its weights, under ``stats_prefix``; the server splits them off
    with `split()` and merges with them (RegMean, Fisher averaging, CCVR, LIVAR)."""

    dp_sgd_refusal = (
        "sends statistics of its raw training data (Grams, Fishers, class moments, importances) that DP-SGD "
        "does not cover"
    )
    central_dp_refusal = "merges with per-client statistics, so its server needs each update: not a mean"
    secure_aggregation_refusal = (
        "merges with each client's statistics (Grams, Fishers, class moments), so its server needs each update, "
        "not their sum"
    )

    stats_prefix: ClassVar[str]

    def client_statistics(self, ctx: ClientContext, data: ClientDataLike) -> dict[str, torch.Tensor]:
        """Statistics of ``ctx.model`` after local training (no randomness but ``ctx.generator``)."""
        raise NotImplementedError

    def client_update(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> tuple[Update, ClientState]:
        meta = train_received(payload.tensors, data, self.config, ctx)
        stats = with_prefix(self.stats_prefix, self.client_statistics(ctx, data))
        return Update({**model_weights(ctx), **stats}, meta), state

    def split(self, updates: dict[int, Update]) -> tuple[list[StateDict], list[StateDict], StateDict]:
        """(statistics, model weights, n_i-weighted average of the weights), in client-id order."""
        cids = sorted(updates)
        parts = [take_prefix(self.stats_prefix, updates[c].tensors) for c in cids]
        stats, weights = [st for st, _ in parts], [w for _, w in parts]
        return stats, weights, weighted_average(weights, [updates[c].num_examples for c in cids])
