"""FedEM (Marfoq et al., NeurIPS 2021): federated EM over a mixture of M shared component models.

Client step (reference ``omarfoq/FedEM`` @996fadd, ``MixtureClient``):
E-step on the whole training set (eval mode): ``L[m, s] = CE(h_m(x_s), y_s)``,
``q[m, s] = softmax_m(log pi_m - L[m, s])``; M-step for the mixture weights: ``pi = mean_s q[:, s]``;
then each component m is trained (``local_sgd``, ``local_epochs``) on the weighted loss
``sum_{s in batch} q[m, s] CE_ms / |batch|``. Server: each component averaged by n_i over the round's
clients. Prediction: ``p(y|x) = sum_m pi_m softmax(h_m(x))``
([`mixture_log_probs()`][fedmerge.algorithms.fedem.mixture_log_probs]).
pi (and, with momentum, each component's momentum buffers) live in ClientState; communication is M
models down and M up.

Choices and reference quirks:
- component m is initialised from its own seed (the reference seeds learner m with seed + m);
  component 0 uses FedAvg's ``init`` seed and ``train`` stream, so ``num_components: 1`` is FedAvg
  exactly, record for record (with M = 1, pi = q = 1: the loss is plain CE and nothing is stored);
- plain SGD by default; the reference uses ``momentum: 0.9`` and ``weight_decay: 5e-4`` with one
  optimiser per component that is never rebuilt, so its momentum buffers persist across rounds:
  ``keep_momentum: true`` (default, only matters with momentum > 0) keeps them in ClientState. The
  reference's per-round multistep lr decay is not reproduced (no lr schedules here yet);
- the reference averages each component over ALL clients, unsampled ones contributing their stale
  copy (the server would have to hold M models per client); here only the round's clients count,
  which is the same with full participation. It also SUMS BatchNorm's ``num_batches_tracked``; here
  integer buffers are averaged like everything else (they are not used in training);
- ``weighting: uniform`` averages components unweighted instead of by n_i.

Evaluation: the personalised model is the pi-weighted mixture of the components' softmax outputs
([`predict()`][fedmerge.algorithms.fedem.FedEM.predict], given to the engine as a predictor); the component with the
largest pi_i is
also evaluated, as the variant ``dominant``.

Weighted loss: ``local_sgd``'s ``loss_fn`` hook computes mean_s(q_s * CE_s) on each batch; the logged
``train_loss`` is that weighted loss of each component (weighted by pi across them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from pydantic import Field
from torch.nn import functional as F

from fedmerge.core.algorithm import (
    ALGORITHMS,
    Algorithm,
    AlgorithmConfig,
    ClientContext,
    ClientDataLike,
    ClientRows,
    Predictor,
    StateDict,
    adapt_epochs,
)
from fedmerge.core.params import clone_state, weighted_average
from fedmerge.core.training import LocalTraining, TrainStats, local_sgd
from fedmerge.core.types import ClientState, Payload, ServerState, Update

from ._multimodel import initial_models, model_logits, pack, unpack
from ._personal import Weighting
from .assignments import ASSIGNMENT_HOOKS
from .base import gap_subset

TAG = "fedem"
PI = "pi"
MOMENTUM = "momentum/"


class FedEMConfig(AlgorithmConfig):
    name: Literal["fedem"] = "fedem"
    num_components: int = Field(3, ge=1, description="M, the number of shared component models")
    weighting: Weighting = Field("samples", description="average of each component: by n_i, or uniform")
    keep_momentum: bool = Field(
        True, description="with momentum > 0: keep each component's momentum buffers across rounds (reference)"
    )


def mixture_log_probs(logits: torch.Tensor, pi: torch.Tensor) -> torch.Tensor:
    """log sum_m pi_m softmax(logits[m]) for (M, n, C) logits; usable as logits (softmax gives p).

    One component is the model itself (log_softmax), so the M = 1 losses are FedAvg's exactly."""
    if logits.shape[0] == 1:
        return F.log_softmax(logits[0], dim=-1)
    log_pi = torch.log(pi.to(logits.dtype)).view(-1, 1, 1)
    return torch.logsumexp(log_pi + F.log_softmax(logits, dim=-1), dim=0)


def e_step(losses: torch.Tensor, pi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Responsibilities q (M, n) = softmax_m(log pi_m - L[m, s]) and the updated pi = mean_s q."""
    q = torch.softmax(torch.log(pi).view(-1, 1) - losses.double(), dim=0)
    return q, q.mean(dim=1)


EM_TOL = 1e-8  # a newcomer's EM stops when no mixture weight moves more than this
EM_MAX_ITERATIONS = 1000


def em_mixture_weights(losses: torch.Tensor, pi: torch.Tensor) -> torch.Tensor:
    """The maximum-likelihood mixture weights for fixed per-sample losses (M, n), by EM from ``pi``: the
    log-likelihood is concave in pi, so EM converges to its maximum (slowly where components are alike)."""
    for _ in range(EM_MAX_ITERATIONS):
        _, new = e_step(losses, pi)
        if float((new - pi).abs().max()) <= EM_TOL:
            return new
        pi = new
    return pi


def mixture_loss(model: torch.nn.Module, models: list, pi: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
    """NLL of the pi-mixture on (x, y); NaN on no data (the local-global gap is off)."""
    if y.numel() == 0:
        return float("nan")
    return float(F.nll_loss(mixture_log_probs(model_logits(model, models, x), pi), y))


def weighted_cross_entropy(weights: torch.Tensor):
    """``local_sgd`` task loss mean_s(q_s * CE_s) over a batch, looked up by sample index."""

    def loss(logits: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(logits, y, reduction="none")
        return (weights[idx].to(ce.dtype) * ce).mean()

    return loss


def train_component(
    model: torch.nn.Module,
    data: ClientDataLike,
    q: torch.Tensor,
    cfg: LocalTraining,
    gen: torch.Generator,
    momentum: dict[str, torch.Tensor] | None,
) -> tuple[TrainStats, dict[str, torch.Tensor]]:
    """Train ``model`` in place on the q-weighted loss; returns its stats and momentum buffers."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.SGD([p for _, p in named], lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    for n, p in named:
        if momentum and n in momentum:
            opt.state[p]["momentum_buffer"] = momentum[n].detach().clone()
    if bool((q == 1).all()):  # every weight 1 (M = 1): the plain loss
        stats = local_sgd(model, data.x_train, data.y_train, cfg, gen, optimizer=opt)
    else:
        stats = local_sgd(model, data.x_train, data.y_train, cfg, gen, optimizer=opt, loss_fn=weighted_cross_entropy(q))
    buffers = {
        n: opt.state[p]["momentum_buffer"].detach().clone() for n, p in named if "momentum_buffer" in opt.state[p]
    }
    return stats, buffers


@ALGORITHMS.register(
    "fedem",
    config=FedEMConfig,
    description="FedEM: mixture of M shared models, client mixture weights by EM",
    hooks=ASSIGNMENT_HOOKS,
)
class FedEM(Algorithm):
    name = "fedem"
    dp_sgd_refusal = (
        "weights each sample's loss by its mixture responsibility (an E-step on the training data), which "
        "local_sgd's DP step does not privatise"
    )
    central_dp_refusal = "averages each component model by the clients' responsibilities, not one mean"
    secure_aggregation_refusal = (
        "weights each component model by each client's responsibilities, so its server needs each update"
    )
    config: FedEMConfig

    # --- state layout --------------------------------------------------------------------
    def _models(self, tensors: dict[str, torch.Tensor]) -> list[StateDict]:
        return unpack(tensors, self.config.num_components)

    def pi(self, state: ClientState) -> torch.Tensor:
        m = self.config.num_components
        return state.tensors.get(PI, torch.full((m,), 1.0 / m, dtype=torch.float64))

    # --- server ----------------------------------------------------------------------------
    def init_server_state(self) -> ServerState:
        return ServerState(pack(initial_models(self, self.config.num_components, TAG)))

    def configure(self, state: ServerState, rnd: int, selected: list[int]) -> dict[int, Payload]:
        return {cid: Payload(state.tensors, {"round": rnd}) for cid in selected}

    def aggregate(self, state: ServerState, rnd: int, updates: dict[int, Update]) -> ServerState:
        cids = sorted(updates)
        weights = [float(updates[c].num_examples) if self.config.weighting == "samples" else 1.0 for c in cids]
        per_client = [self._models(updates[c].tensors) for c in cids]
        models = [weighted_average([m[j] for m in per_client], weights) for j in range(self.config.num_components)]
        meta = dict(state.meta)
        if self.config.num_components > 1:  # for the log only: the server never uses pi
            meta["pi"] = {**meta.get("pi", {}), **{str(c): updates[c].meta["pi"] for c in cids}}
        return ServerState(pack(models), meta)

    def global_model(self, state: ServerState) -> StateDict | None:
        return self._models(state.tensors)[0] if self.config.num_components == 1 else None

    def server_report(self, state: ServerState, rnd: int) -> dict[str, Any]:
        m = self.config.num_components
        if m == 1:
            return {}
        pis = state.meta.get("pi", {})
        return {"merge_weights": ClientRows(self.num_clients, lambda c: pis.get(str(c), [1.0 / m] * m))}

    def client_optimized_parameters(self, model_parameters: int, client_states: Iterable[ClientState]) -> float:
        """Parameters one client trains per round: M models (for the parameter budget)."""
        return float(self.config.num_components * model_parameters)

    # --- client ----------------------------------------------------------------------------
    def client_update(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> tuple[Update, ClientState]:
        cfg = self.config
        m_count = cfg.num_components
        models = self._models(payload.tensors)
        pi_old = self.pi(state).to(ctx.device)
        xg, yg = gap_subset(data, ctx, self.config.gap_samples)
        received = mixture_loss(ctx.model, models, pi_old, xg, yg)
        logits = model_logits(ctx.model, models, data.x_train)
        losses = F.cross_entropy(logits.flatten(0, 1), data.y_train.repeat(m_count), reduction="none")
        q, pi = e_step(losses.view(m_count, -1), pi_old)

        trained: list[StateDict] = []
        new_state: dict[str, torch.Tensor] = {PI: pi.cpu()} if m_count > 1 else {}
        loss = 0.0
        steps = 0
        for j, weights in enumerate(models):
            ctx.model.load_state_dict(weights)
            momentum = {
                k[len(f"{MOMENTUM}{j}/") :]: v for k, v in state.tensors.items() if k.startswith(f"{MOMENTUM}{j}/")
            }
            gen = ctx.generator("train" if j == 0 else f"train/component-{j}")
            stats, buffers = train_component(ctx.model, data, q[j], cfg, gen, momentum)
            trained.append(clone_state(ctx.model.state_dict()))
            if cfg.keep_momentum:
                new_state.update({f"{MOMENTUM}{j}/{k}": v for k, v in buffers.items()})
            loss += float(pi[j]) * stats.loss
            steps += stats.steps
        after = mixture_loss(ctx.model, trained, pi, xg, yg)
        meta = {
            "num_examples": int(data.y_train.shape[0]),
            "train_loss": loss,
            "steps": steps,
            "loss_received": float(received),
            "loss_trained": float(after),
        }
        if m_count > 1:
            meta["pi"] = [float(p) for p in pi]
        return Update(pack(trained), meta), ClientState(new_state, dict(state.meta))

    def predict(self, payload: Payload, state: ClientState, ctx: ClientContext, x: torch.Tensor) -> torch.Tensor:
        """The client's mixture prediction, as log-probabilities (n, C)."""
        logits = model_logits(ctx.model, self._models(payload.tensors), x)
        return mixture_log_probs(logits, self.pi(state).to(logits.device))

    def personalize(self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext) -> StateDict:
        """The dominant component (largest pi_i): the best single network for this client."""
        return self._models(payload.tensors)[int(torch.argmax(self.pi(state)))]

    def personalize_variants(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> dict[str, StateDict | Predictor]:
        if self.config.num_components == 1:
            return {"": self.personalize(payload, data, state, ctx)}
        return {
            "": lambda x: self.predict(payload, state, ctx, x),
            "dominant": self.personalize(payload, data, state, ctx),
        }

    # --- a newcomer: mixture weights by EM on its own data, the M components frozen (the paper's rule for
    # clients unseen at training time: only pi is learned) ---------------------------------------------------
    def configure_onboard(self, state: ServerState, rnd: int, cids: list[int]) -> dict[int, Payload]:
        return self.configure(state, rnd, cids)

    def newcomer_pi(self, payload: Payload, data: ClientDataLike, ctx: ClientContext) -> torch.Tensor:
        """pi fitted by EM on the training split with the M models frozen, from the uniform pi a participant starts
        with: the maximum-likelihood mixture weights, EM iterated to convergence. The models are frozen, so one
        forward pass gives every loss and further iterations cost nothing; a fixed few iterations would leave pi
        near uniform while the components are still flat (early rounds), so the newcomer would mix components
        of other groups. Any budget > 0 therefore gives the same pi; 0 keeps it uniform."""
        pi = self.pi(ClientState()).to(ctx.device)
        m_count = self.config.num_components
        if adapt_epochs(payload) == 0 or m_count == 1 or data.y_train.numel() == 0:
            return pi
        logits = model_logits(ctx.model, self._models(payload.tensors), data.x_train)
        losses = F.cross_entropy(logits.flatten(0, 1), data.y_train.repeat(m_count), reduction="none")
        return em_mixture_weights(losses.view(m_count, -1), pi)

    def onboard_variants(
        self, payload: Payload, data: ClientDataLike, ctx: ClientContext
    ) -> dict[str, StateDict | Predictor]:
        pi = self.newcomer_pi(payload, data, ctx)
        state = ClientState({PI: pi.cpu()} if self.config.num_components > 1 else {})
        return self.personalize_variants(payload, data, state, ctx)

    def onboard(self, payload: Payload, data: ClientDataLike, ctx: ClientContext) -> StateDict | Predictor:
        return self.onboard_variants(payload, data, ctx)[""]
