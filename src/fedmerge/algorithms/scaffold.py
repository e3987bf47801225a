"""SCAFFOLD (Karimireddy et al., ICML 2020), option II control variates.

Client: y <- x; K plain-SGD steps with the corrected gradient g + c - c_i (a ``before_step`` hook);
then c_i+ = c_i - c + (x - y) / (K * lr) (option II), upload y and dc_i = c_i+ - c_i.
Server: x <- (1 - global_lr) x + global_lr * avg_i(y_i)   (= x + global_lr * avg_i(y_i - x));
c <- c + sum_{i in S} dc_i / N with N all clients. c_i lives in ClientState (zeros until first
sampled), c in ServerState under ``control/<param>``; both travel, so communication is twice FedAvg's.

Defaults and choices (reference: FL-bench ``KarhouTam/FL-bench`` @06e658b):
- the average of y_i is weighted by sample counts (``weighting: samples``, as every method here, and
  what makes the reduction to FedAvg exact); the paper and FL-bench use an unweighted mean:
  ``weighting: uniform``;
- momentum must be 0 (plain SGD), so that K * lr is the true length of the local path;
- ``control_variates: false`` holds c and c_i at zero (the correction hook still runs, adding 0):
  the run is then FedAvg exactly, and nothing extra is communicated.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from fedmerge.core.algorithm import ALGORITHMS, AlgorithmConfig, ClientContext, ClientDataLike, StateDict
from fedmerge.core.training import Step, local_sgd
from fedmerge.core.types import ClientState, Payload, ServerState, Update

from ._personal import GapProbe, Weighting, average_updates, zeros_like_params
from .base import GlobalModelAlgorithm, load_weights, model_weights

CONTROL = "control/"


class ScaffoldConfig(AlgorithmConfig):
    name: Literal["scaffold"] = "scaffold"
    global_lr: float = Field(1.0, gt=0, description="server step size eta_g on the averaged model change")
    control_variates: bool = Field(True, description="false: c = c_i = 0 throughout (reduces to FedAvg)")
    weighting: Weighting = Field("samples", description="average of client models: by n_i, or uniform (paper)")

    @model_validator(mode="after")
    def _plain_sgd(self) -> ScaffoldConfig:
        if self.momentum != 0:
            raise ValueError("SCAFFOLD needs plain SGD (momentum 0): option II divides by K * lr")
        return self


def split_control(tensors: dict[str, torch.Tensor]) -> tuple[StateDict, StateDict]:
    """(model, control) parts of a record whose control tensors are keyed ``control/<param>``."""
    model = {k: v for k, v in tensors.items() if not k.startswith(CONTROL)}
    control = {k[len(CONTROL) :]: v for k, v in tensors.items() if k.startswith(CONTROL)}
    return model, control


@ALGORITHMS.register("scaffold", config=ScaffoldConfig, description="SCAFFOLD: control variates (option II)")
class Scaffold(GlobalModelAlgorithm):
    name = "scaffold"
    dp_sgd_refusal = None
    central_dp_refusal = (
        "also sums control-variate updates (scaled by 1/N) beside the model mean, which one clipping bound "
        "does not cover"
    )
    secure_aggregation_refusal = None  # the model's mean and the control variates' sum

    def init_server_state(self) -> ServerState:
        weights = self.initial_weights()
        if not self.config.control_variates:
            return ServerState(weights)
        model = self.model_factory(torch.Generator().manual_seed(0))  # only for the parameter names/shapes
        control = {CONTROL + k: v for k, v in zeros_like_params(model).items()}
        return ServerState({**weights, **control})

    def global_model(self, state: ServerState) -> StateDict | None:
        return split_control(state.tensors)[0]

    def personalize(self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext) -> StateDict:
        return split_control(payload.tensors)[0]

    def client_update(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> tuple[Update, ClientState]:
        cfg = self.config
        x, c = split_control(payload.tensors)
        load_weights(ctx, x)
        probe = GapProbe(data, ctx, self.config.gap_samples)
        zeros = zeros_like_params(ctx.model)
        c = c or zeros
        c_i = state.tensors or zeros
        correction = {k: c[k] - c_i[k] for k in zeros}

        def correct_gradients(step: Step) -> None:  # g <- g + c - c_i
            for n, p in step.model.named_parameters():
                if p.grad is not None:
                    p.grad.add_(correction[n])

        gen = ctx.generator("train")
        # DP-SGD privatises the gradient; the correction c - c_i (post-processing) is added after it
        stats = local_sgd(
            ctx.model, data.x_train, data.y_train, cfg, gen, before_step=correct_gradients, private=ctx.private
        )
        y = model_weights(ctx)
        meta = probe.meta(ctx, data, stats)
        if not cfg.control_variates or stats.steps == 0:
            return Update(y, meta), state
        scale = 1.0 / (stats.steps * cfg.lr)
        new_c_i = {k: c_i[k] - c[k] + (x[k] - y[k]) * scale for k in zeros}
        delta = {CONTROL + k: new_c_i[k] - c_i[k] for k in zeros}
        return Update({**y, **delta}, meta), ClientState(new_c_i, dict(state.meta))

    def secure_weight(self, meta: dict) -> float:
        return float(meta["num_examples"]) if self.config.weighting == "samples" else 1.0

    def secure_summed(self, key: str) -> bool:
        return key.startswith(CONTROL)  # the server adds the control-variate changes up (then / N)

    def aggregate(self, state: ServerState, rnd: int, updates: dict[int, Update]) -> ServerState:
        x, c = split_control(state.tensors)
        model_updates = {cid: Update(split_control(u.tensors)[0], u.meta) for cid, u in updates.items()}
        avg = average_updates(model_updates, self.config.weighting)
        eta = self.config.global_lr
        if eta != 1.0:
            avg = {k: (1.0 - eta) * x[k] + eta * v if v.is_floating_point() else v for k, v in avg.items()}
        if not c:
            return ServerState(avg, dict(state.meta))
        new_c = dict(c)
        for cid in sorted(updates):
            dc = split_control(updates[cid].tensors)[1]
            for k in dc:
                new_c[k] = new_c[k] + dc[k] / self.num_clients
        return ServerState({**avg, **{CONTROL + k: v for k, v in new_c.items()}}, dict(state.meta))
