"""SuPerFed (Hahn et al., KDD 2022): a federated and a local model trained jointly along a line.

Registered twice: ``superfed_mm`` (Model Mixing: one lambda per batch for the whole model) and
``superfed_lm`` (Layer Mixing: one lambda per layer per batch), with the reference scripts' nu.

Client (round r): w_f <- w_g; w_l is the client's own model (ClientState; initialised by the model
builder seeded with (seed, client id), not copied from w_g, as the paper's text and the reference code do).
Each minibatch trains W(lambda) = (1 - lambda) w_f + lambda w_l through ``torch.func.functional_call``
with lambda ~ U(0, 1), on the loss

    CE(W(lambda)) + mu * ||w_f - w_g||^2 + nu * cos^2(w_f, w_l)

where cos^2 is one cosine over the concatenation of all mixed parameters. Until round ``start_round``
(the paper's L*R) lambda = 0, only w_f trains and the cos term is off (the reference code; the prox
term is on). Only w_f travels; the server averages it by n_i (FedAvg's server).

Mixed are all parameters (Linear/Conv weights and biases, BatchNorm gamma/beta). BatchNorm running
statistics are NOT mixed: they belong to w_f (updated by every mixed forward pass, averaged by the
server) and every lambda is evaluated with them. The reference avoids the question with
``track_running_stats=False``; the paper's models (TwoNN, TwoCNN) have no BatchNorm.

Evaluation: w_f is the current global model (the reference transmits it before its final
evaluation). Once mixing has started, ``personalize_variants`` returns the line at lambda in
{0, 1/steps, ..., 1} as ``lambda=0.3`` etc. The default personalised model ("" key) is the lambda
with the best accuracy on the client's **validation** split (training split if it has none).

Reference-code quirks (``vaseline555/SuPerFed`` @55064b9) and their options; defaults follow the paper:
- the prox term is ``mu * sum_layers ||w_f - w_g||_2`` (per-layer norm, not squared):
  ``prox: layer_norm`` (default ``squared``, the paper's eq. 4);
- 1e-6 is added to every element of ``w_f * w_l`` before summing the cosine's numerator:
  ``cos_eps: 1e-6`` (default 0);
- the best lambda per client is chosen on the TEST split: ``select_lambda_on: test`` (default ``val``);
- the server averages only keys containing 'weight' (harmless only without biases): not reproduced,
  every federated tensor is averaged;
- SGD with momentum 0.9, wd 1e-4 and lr decay 0.999 per round: set ``momentum``/``weight_decay``;
  there is no per-round lr decay (no other method here has one either).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from fedmerge.core.algorithm import (
    ALGORITHMS,
    AlgorithmConfig,
    ClientContext,
    ClientDataLike,
    StateDict,
    adapt_epochs,
)
from fedmerge.core.seeding import NO_ROUND, torch_generator
from fedmerge.core.training import Step
from fedmerge.core.types import ClientState, Payload, Update

from ._personal import GapProbe, detached, interpolate, lambda_grid, lambda_key, leaves, pick_best
from .base import GlobalModelAlgorithm, adapted_state, client_sgd, load_weights, model_weights
from .lambda_line import LAMBDA_HOOKS

Tensors = dict[str, torch.Tensor]


class _SuPerFedConfig(AlgorithmConfig):
    start_round: int = Field(0, ge=0, description="mixing starts after this round: the paper's L*R (e.g. 0.6*R)")
    mu: float = Field(0.01, ge=0, description="proximity of w_f to the received global model")
    nu: float = Field(1.0, ge=0, description="weight of cos^2(w_f, w_l)")
    prox: Literal["squared", "layer_norm"] = Field(
        "squared", description="squared: mu||w_f-w_g||^2 (paper); layer_norm: mu*sum of per-tensor L2 norms (reference)"
    )
    cos_eps: float = Field(0.0, ge=0, description="added to every element of w_f*w_l in cos's numerator (ref: 1e-6)")
    lambda_steps: int = Field(10, ge=1, description="evaluate lambda in {0, 1/steps, ..., 1}")
    select_lambda_on: Literal["val", "test"] = Field(
        "val", description="split the personalised lambda is chosen on (test: the reference code's choice)"
    )

    def warnings(self, rounds: int) -> list[str]:
        if rounds > self.start_round:
            return []
        return [
            f"rounds={rounds} <= algorithm.start_round={self.start_round}: {self.name} never starts mixing "
            "(only the federated model trains); raise rounds or lower algorithm.start_round"
        ]


class SuPerFedMMConfig(_SuPerFedConfig):
    name: Literal["superfed_mm"] = "superfed_mm"


class SuPerFedLMConfig(_SuPerFedConfig):
    name: Literal["superfed_lm"] = "superfed_lm"
    nu: float = Field(2.0, ge=0, description="weight of cos^2(w_f, w_l) (reference LM scripts: 2)")


def layer_of(param: str) -> str:
    """The module a parameter belongs to (``body.1.weight`` -> ``body.1``): LM's unit of mixing."""
    return param.rsplit(".", 1)[0] if "." in param else param


def sample_lambdas(names: list[str], mode: str, gen: torch.Generator) -> dict[str, float]:
    """One U(0,1) draw for the whole model (mm) or one per layer (lm), for every parameter name."""
    if mode == "mm":
        lam = float(torch.rand((), generator=gen))
        return dict.fromkeys(names, lam)
    layers = sorted({layer_of(n) for n in names})
    draws = torch.rand(len(layers), generator=gen).tolist()
    by_layer = dict(zip(layers, draws))
    return {n: by_layer[layer_of(n)] for n in names}


def prox_term(wf: Tensors, anchor: Tensors, kind: str) -> torch.Tensor:
    if kind == "squared":
        return torch.stack([((wf[k] - anchor[k]) ** 2).sum() for k in wf]).sum()
    # torch's norm has a zero subgradient at 0, so the first step (w_f == w_g) is well defined
    return torch.stack([torch.linalg.vector_norm(wf[k] - anchor[k]) for k in wf]).sum()


def cos_squared(wf: Tensors, wl: Tensors, eps: float = 0.0) -> torch.Tensor:
    """cos^2 between the concatenations of all tensors of ``wf`` and ``wl``."""
    num = torch.stack([(wf[k] * wl[k] + eps).sum() for k in wf]).sum()
    nf = torch.stack([(wf[k] ** 2).sum() for k in wf]).sum()
    nl = torch.stack([(wl[k] ** 2).sum() for k in wf]).sum()
    return num**2 / (nf * nl).clamp_min(1e-24)


class SuPerFed(GlobalModelAlgorithm):
    name = "superfed_mm"
    dp_sgd_refusal = (
        "trains its federated and local models through one interpolated forward per step, whose per-sample "
        "gradients local_sgd's DP step does not form"
    )
    central_dp_refusal = None
    secure_aggregation_refusal = None
    mode: ClassVar[str] = "mm"

    def init_client_state(self, cid: int) -> ClientState:
        # w_l: the client's own initialisation (parameters only; BN statistics belong to w_f)
        model = self.model_factory(torch_generator(self.seed, NO_ROUND, cid, "superfed-local"))
        return ClientState({n: p.detach().clone() for n, p in model.named_parameters()})

    def mixing(self, ctx: ClientContext) -> bool:
        return ctx.round > self.config.start_round

    def client_update(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> tuple[Update, ClientState]:
        cfg = self.config
        load_weights(ctx, payload.tensors)  # buffers (BN statistics) are w_f's and live in ctx.model
        probe = GapProbe(data, ctx, self.config.gap_samples)
        names = [n for n, _ in ctx.model.named_parameters()]
        mixing = self.mixing(ctx)
        wf = leaves(payload.tensors, names, ctx.device)
        wl = leaves(state.tensors, names, ctx.device) if mixing else {}
        anchor = {k: payload.tensors[k].detach() for k in names}
        gen = ctx.generator("lambda")

        def forward(xb: torch.Tensor) -> torch.Tensor:
            params = wf
            if mixing:
                lam = sample_lambdas(names, self.mode, gen)
                params = {k: (1.0 - lam[k]) * wf[k] + lam[k] * wl[k] for k in names}
            return torch.func.functional_call(ctx.model, params, (xb,))

        use_prox, use_cos = cfg.mu > 0, mixing and cfg.nu > 0

        def extra_loss(_: Step) -> torch.Tensor:
            terms = []
            if use_prox:
                terms.append(cfg.mu * prox_term(wf, anchor, cfg.prox))
            if use_cos:
                terms.append(cfg.nu * cos_squared(wf, wl, cfg.cos_eps))
            return torch.stack(terms).sum()

        stats = client_sgd(
            ctx,
            data,
            cfg,
            params=[*wf.values(), *wl.values()],
            extra_loss=extra_loss if (use_prox or use_cos) else None,
            forward=forward,
        )
        ctx.model.load_state_dict({**ctx.model.state_dict(), **detached(wf)})
        meta = probe.meta(ctx, data, stats)
        new_state = ClientState(detached(wl), dict(state.meta)) if mixing else state
        return Update(model_weights(ctx), meta), new_state

    # --- evaluation ----------------------------------------------------------------------
    def line(self, payload: Payload, state: ClientState) -> dict[str, StateDict]:
        return {
            lambda_key(lam): interpolate(payload.tensors, state.tensors, lam)
            for lam in lambda_grid(self.config.lambda_steps)
        }

    def personalize_variants(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> dict[str, StateDict]:
        if not self.mixing(ctx):
            return {"": payload.tensors}  # lambda = 0 until mixing starts: w_l is untrained
        variants = self.line(payload, state)
        split = self.config.select_lambda_on
        x, y = getattr(data, f"x_{split}"), getattr(data, f"y_{split}")
        if y.numel() == 0:
            x, y = data.x_train, data.y_train
        best = pick_best(ctx.model, variants, x, y)
        return {"": variants[best], **variants}

    def personalize(self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext) -> StateDict:
        return self.personalize_variants(payload, data, state, ctx)[""]

    def onboard_variants(self, payload: Payload, data: ClientDataLike, ctx: ClientContext) -> dict[str, StateDict]:
        """The paper's novel client (Fig. 2, case 2) downloads the global model: that is the newcomer's model
        with no adaptation budget, and before mixing starts (the fine-tuned global model then). With a budget,
        once mixing has started, it draws its own local model (``init_client_state``, as a participant does),
        trains it with the global model on the line by SuPerFed's client step, and is evaluated on the line as
        participants are (lambda chosen on its own ``select_lambda_on`` split)."""
        if adapt_epochs(payload) == 0 or not self.mixing(ctx):
            return {"": self.onboard(payload, data, ctx)}
        state = adapted_state(self, payload, data, self.init_client_state(ctx.cid), ctx)
        return self.personalize_variants(payload, data, state, ctx)


@ALGORITHMS.register(
    "superfed_mm",
    config=SuPerFedMMConfig,
    description="SuPerFed-MM: federated + local model mixed with one lambda~U(0,1) per batch",
    hooks=LAMBDA_HOOKS,
)
class SuPerFedMM(SuPerFed):
    name = "superfed_mm"
    mode = "mm"


@ALGORITHMS.register(
    "superfed_lm",
    config=SuPerFedLMConfig,
    description="SuPerFed-LM: federated + local model mixed with one lambda~U(0,1) per layer per batch",
    hooks=LAMBDA_HOOKS,
)
class SuPerFedLM(SuPerFed):
    name = "superfed_lm"
    mode = "lm"
