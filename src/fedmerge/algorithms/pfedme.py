"""pFedMe (T. Dinh et al., NeurIPS 2020): personalisation by Moreau envelopes.

Each local step (reference ``CharlieDinh/pFedMe`` @caf24b1) takes ONE minibatch and
1. approximately solves the Moreau envelope's inner problem with ``inner_steps`` (K) SGD steps on the
   personal model theta on that same batch:  theta -= personal_lr * (grad f(theta) + lam (theta - w_loc));
2. moves the local copy of the global model towards it:  w_loc -= lr * lam * (w_loc - theta).
Both are ``local_sgd`` calls: the outer one draws the batches and trains w_loc on the loss
lam/2 ||w_loc - theta||^2 (whose gradient step is 2.); its ``before_forward`` hook is 1., an inner
``local_sgd`` on theta (= ``ctx.model``) for the step's batch. The outer loop runs ``local_steps``
steps if set (the reference's ``local_epochs`` R=20 is 20 steps: set ``local_steps: 20``), else
``local_epochs`` epochs of batches. ``train_loss`` is theta's loss on each batch after its inner solve.
The inner solve draws its batch (all of the step's samples, permuted) from its own generator.

At the start of every round theta and w_loc are set to the received global model, as in the
reference. w_loc travels (with theta's BatchNorm statistics); the server takes
w <- (1 - beta) w + beta * avg_i w_loc,i (by n_i). theta is kept in ClientState and is the model
evaluated (the global model until the client first trains).

Reference defaults: lam 15, personal_lr 0.09, K 5, lr (eta) 0.005, beta 1. Quirk not reproduced:
the reference trains *all* clients every round and aggregates only the sampled ones; here only the
sampled clients train (identical at participation 1).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedmerge.core.algorithm import ALGORITHMS, AlgorithmConfig, ClientContext, ClientDataLike, StateDict
from fedmerge.core.training import LocalTraining, Step, local_sgd
from fedmerge.core.types import ClientState, Payload, ServerState, Update

from ._personal import GapProbe, average_updates, detached, half_sq_dist, leaves
from .base import GlobalModelAlgorithm, adapted_state, client_sgd, load_weights, model_weights


class PFedMeConfig(AlgorithmConfig):
    name: Literal["pfedme"] = "pfedme"
    lam: float = Field(15.0, gt=0, description="Moreau-envelope regularisation lambda")
    personal_lr: float = Field(0.09, gt=0, description="step size of the inner solve on theta")
    inner_steps: int = Field(5, ge=1, description="K: inner steps on theta per minibatch")
    beta: float = Field(1.0, gt=0, description="server step: w <- (1-beta) w + beta avg")


@ALGORITHMS.register(
    "pfedme", config=PFedMeConfig, description="pFedMe: Moreau-envelope personal models (K inner steps)"
)
class PFedMe(GlobalModelAlgorithm):
    name = "pfedme"
    dp_sgd_refusal = (
        "solves an inner problem on each minibatch and steps through the personalised model, which "
        "local_sgd's DP step does not privatise"
    )
    central_dp_refusal = "steps from the old model by beta times the mean (more than a mean when beta > 1)"
    secure_aggregation_refusal = None  # (1 - beta) * old + beta * mean: a function of the mean

    def aggregate(self, state: ServerState, rnd: int, updates: dict[int, Update]) -> ServerState:
        avg = average_updates(updates)
        beta = self.config.beta
        if beta != 1.0:
            old = state.tensors
            avg = {k: (1 - beta) * old[k] + beta * v if v.is_floating_point() else v for k, v in avg.items()}
        return ServerState(avg, dict(state.meta))

    def client_update(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> tuple[Update, ClientState]:
        cfg = self.config
        load_weights(ctx, payload.tensors)  # theta <- w_g
        probe = GapProbe(data, ctx, self.config.gap_samples)
        w_loc = leaves(payload.tensors, [n for n, _ in ctx.model.named_parameters()], ctx.device)
        # one slice holds any batch (local_sgd merges a trailing single sample into the last batch)
        inner = LocalTraining(lr=cfg.personal_lr, local_steps=cfg.inner_steps, batch_size=2 * cfg.batch_size)
        inner_gen = ctx.generator("inner")

        def theta() -> dict[str, torch.Tensor]:
            return dict(ctx.model.named_parameters())

        def solve_inner_problem(step: Step) -> None:
            # 1. theta ~ argmin f(theta; batch) + lam/2 ||theta - w_loc||^2, by K SGD steps on the batch
            anchor = {k: v.detach() for k, v in w_loc.items()}

            def prox(_: Step) -> torch.Tensor:
                return half_sq_dist(theta(), anchor, cfg.lam)

            local_sgd(ctx.model, step.x, step.y, inner, inner_gen, extra_loss=prox)

        def personal_prediction(xb: torch.Tensor) -> torch.Tensor:  # theta's, for train_loss only
            ctx.model.eval()
            with torch.no_grad():
                out = ctx.model(xb)
            ctx.model.train()
            return out

        def envelope(_: Step) -> torch.Tensor:
            # 2. its gradient step is w_loc <- w_loc - lr * lam * (w_loc - theta)
            return half_sq_dist(w_loc, {k: v.detach() for k, v in theta().items()}, cfg.lam)

        stats = client_sgd(
            ctx,
            data,
            cfg,
            params=list(w_loc.values()),
            before_forward=solve_inner_problem,
            forward=personal_prediction,
            extra_loss=envelope,
        )
        personal = model_weights(ctx)
        ctx.model.load_state_dict({**personal, **detached(w_loc)})
        meta = probe.meta(ctx, data, stats)
        return Update(model_weights(ctx), meta), ClientState(personal, dict(state.meta))

    def personalize(self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext) -> StateDict:
        return state.tensors or payload.tensors

    def onboard(self, payload: Payload, data: ClientDataLike, ctx: ClientContext) -> StateDict:
        """A newcomer's theta: pFedMe's client step (the Moreau-envelope inner solve around a local copy of
        the global model) for the adaptation budget; with no budget, the global model."""
        return self.personalize(payload, data, adapted_state(self, payload, data, ClientState(), ctx), ctx)
