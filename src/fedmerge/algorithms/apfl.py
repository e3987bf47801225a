"""APFL (Deng et al., 2020): adaptive personalised FL by an output mixture.

Per minibatch (reference ``MLOPTPSU/FedTorch`` @ab8068d): an SGD step on the global copy w with
CE(f_w(x)), and an SGD step on the personal model v with CE(alpha f_v(x) + (1 - alpha) f_w(x)), f_w's
output detached so the mixture loss moves only v. One ``local_sgd`` call does both: w is ``ctx.model``
(the task loss; its output is the step's ``logits``), v a second model run through ``functional_call``
(the mixture loss is the ``extra_loss``). Both steps use the weights from before the step, as in the
paper's algorithm.
With ``adaptive_alpha`` alpha is updated once per round, at the first local step (as the reference):
alpha <- clip(alpha - alpha_lr * (dL/dalpha + 0.02 alpha), 0, 1), with L = CE(alpha f_v(x) + (1 - alpha)
f_w(x), y) v's mixture loss on that step's batch, differentiated by autograd in the step's backward
pass: the paper's grad_alpha f(v_bar; xi). For a model linear in its parameters it equals the paper's
<v - w, grad f(alpha v + (1 - alpha) w)>. The reference code's <v - w, alpha g_v + (1 - alpha) g_w>
(g_v, g_w: gradients of the mixture loss, so g_v already carries a factor alpha) is, for such a model,
(alpha^2 + (1 - alpha)^2) times it, a smaller alpha step; not reproduced. The 0.02 alpha term is the
reference's (``alpha_decay``).
Defaults: alpha 0.5, not adaptive (the reference's). v and alpha live in ClientState; w travels and
is averaged by n_i.

Evaluation: the personalised model is the output mixture alpha f_v(x) + (1 - alpha) f_{w_g}(x) (the
reference's ``inference_personal``; ``personal_eval: output``, the default), given to the engine as a
predictor. ``personal_eval: mixture`` evaluates the *parameter* mixture alpha v + (1 - alpha) w_g
instead (as PFLlib does) and ``v`` evaluates v alone.
``lambda_steps`` adds the parameter line (1 - lam) w_g + lam v as ``lambda=...`` variants (the
paper's Fig. A2 comparison with SuPerFed).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch.func import functional_call
from torch.nn import functional as F

from fedmerge.core.algorithm import (
    ALGORITHMS,
    AlgorithmConfig,
    ClientContext,
    ClientDataLike,
    Predictor,
    StateDict,
)
from fedmerge.core.training import Step
from fedmerge.core.types import ClientState, Payload, Update

from ._personal import GapProbe, SecondModel, interpolate, lambda_grid, lambda_key
from .base import GlobalModelAlgorithm, adapted_state, client_sgd, load_weights, model_weights
from .lambda_line import LAMBDA_HOOKS


class APFLConfig(AlgorithmConfig):
    name: Literal["apfl"] = "apfl"
    alpha: float = Field(0.5, ge=0, le=1, description="initial weight of the personal model's output")
    adaptive_alpha: bool = Field(False, description="update alpha by gradient once per round")
    alpha_lr: float | None = Field(None, gt=0, description="step size for alpha (default: lr)")
    alpha_decay: float = Field(0.02, ge=0, description="the reference's 0.02*alpha term in alpha's gradient")
    personal_eval: Literal["output", "mixture", "v"] = Field(
        "output",
        description="evaluate the output mixture alpha f_v + (1-alpha) f_w (reference), the parameter mixture, or v",
    )
    lambda_steps: int | None = Field(None, ge=1, description="also evaluate (1-lam) w_g + lam v on this grid")


def alpha_step(alpha: float, grad: float, lr: float, decay: float) -> float:
    """One projected gradient step on alpha, ``grad`` being d(mixture loss)/d alpha."""
    return min(1.0, max(0.0, alpha - lr * (grad + decay * alpha)))


@ALGORITHMS.register(
    "apfl",
    config=APFLConfig,
    description="APFL: personal/global output mixture, optional adaptive alpha",
    hooks=LAMBDA_HOOKS,
)
class APFL(GlobalModelAlgorithm):
    name = "apfl"
    dp_sgd_refusal = (
        "takes mixed steps of its personal and global models (the mixture's loss reads the training data "
        "through both), which local_sgd's DP step does not privatise"
    )
    central_dp_refusal = None
    secure_aggregation_refusal = None

    def init_client_state(self, cid: int) -> ClientState:
        return ClientState(self.initial_weights(), {"alpha": self.config.alpha})

    def client_update(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> tuple[Update, ClientState]:
        cfg = self.config
        load_weights(ctx, payload.tensors)
        probe = GapProbe(data, ctx, self.config.gap_samples)
        v = SecondModel(state.tensors, ctx.model, ctx.device)
        alpha = [float(state.meta.get("alpha", cfg.alpha))]  # mutable: the adaptive step changes it
        alpha_leaf: dict[str, torch.Tensor] = {}  # alpha as a tensor, at the step whose backward gives its gradient

        def mixture_loss(step: Step) -> torch.Tensor:  # v's objective; f_w(x) is the step's logits
            assert step.logits is not None
            a: float | torch.Tensor = alpha[0]
            if cfg.adaptive_alpha and step.index == 0:
                a = torch.tensor(alpha[0], dtype=step.logits.dtype, device=ctx.device, requires_grad=True)
                alpha_leaf["a"] = a
            out = a * v(ctx.model, step.x) + (1 - a) * step.logits.detach()
            return F.cross_entropy(out, step.y)

        def adapt(step: Step) -> None:  # alpha moves once per round, at the first step
            if step.index == 0:
                grad = alpha_leaf["a"].grad
                assert grad is not None
                alpha[0] = alpha_step(alpha[0], float(grad), cfg.alpha_lr or cfg.lr, cfg.alpha_decay)

        params = [p for p in ctx.model.parameters() if p.requires_grad] + list(v.params.values())
        stats = client_sgd(
            ctx,
            data,
            cfg,
            params=params,
            extra_loss=mixture_loss,
            before_step=adapt if cfg.adaptive_alpha else None,
        )
        meta = probe.meta(ctx, data, stats, alpha=alpha[0])
        return Update(model_weights(ctx), meta), ClientState(v.state(), {**state.meta, "alpha": alpha[0]})

    def personalize_variants(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> dict[str, StateDict | Predictor]:
        alpha = float(state.meta.get("alpha", self.config.alpha))
        out: dict[str, StateDict | Predictor]
        if self.config.personal_eval == "v":
            out = {"": state.tensors}
        elif self.config.personal_eval == "mixture":
            out = {"": interpolate(payload.tensors, state.tensors, alpha)}
        else:
            out = {"": output_mixture(ctx.model, state.tensors, payload.tensors, alpha)}
        if self.config.lambda_steps:
            out.update(
                {
                    lambda_key(lam): interpolate(payload.tensors, state.tensors, lam)
                    for lam in lambda_grid(self.config.lambda_steps)
                }
            )
        return out

    def onboard_variants(
        self, payload: Payload, data: ClientDataLike, ctx: ClientContext
    ) -> dict[str, StateDict | Predictor]:
        """A newcomer's v starts from the global model with alpha at its initial value and follows APFL's
        client step (the mixture objective, alpha adapted if configured) for the adaptation budget; with no
        budget v = w, so every mixture is the global model."""
        start = ClientState({k: t.detach().clone() for k, t in payload.tensors.items()}, {"alpha": self.config.alpha})
        return self.personalize_variants(payload, data, adapted_state(self, payload, data, start, ctx), ctx)

    def onboard(self, payload: Payload, data: ClientDataLike, ctx: ClientContext) -> StateDict | Predictor:
        return self.onboard_variants(payload, data, ctx)[""]

    def personalize(self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext) -> StateDict:
        """One set of weights (the parameter mixture), for callers that need a plain model."""
        return interpolate(payload.tensors, state.tensors, float(state.meta.get("alpha", self.config.alpha)))


def output_mixture(model: torch.nn.Module, v: StateDict, w: StateDict, alpha: float) -> Predictor:
    """x -> alpha f_v(x) + (1 - alpha) f_w(x), both through ``model``'s architecture in eval mode."""

    def predict(x: torch.Tensor) -> torch.Tensor:
        model.eval()
        return alpha * functional_call(model, v, (x,)) + (1 - alpha) * functional_call(model, w, (x,))

    return predict
