"""FedMerge (arXiv 2504.06768): d global models on the server, one merged model per client.

Server state (a ServerState, so checkpoints and resume are exact):

* ``theta``    (d, P) float stack of the d global models' flat floating-point entries, BatchNorm
  running statistics included (as the authors do). Columns are ordered [body parameters, head
  parameters, float buffers] so that "all parameters" and "head only" are contiguous slices.
* ``counters`` (d, K) int64: integer buffers (BatchNorm ``num_batches_tracked``). They are counters,
  not parameters: merged and updated with the same weights, then rounded back to integers.
* ``logits``   (m, d) float64 merge logits A, zeros (uniform weights) at the start.

Round: ``configure`` merges only the selected rows, ``theta_i = softmax(A_i) @ Theta``, and sends each
client its own merged state dict (client cost independent of d). Clients train it exactly as FedAvg
does (shared :func:`train_received`) plus a proximal term, return ``delta_i = theta_i(after) -
theta_i(before)`` for every state entry and ``n_i``, and keep nothing (client state is empty).
``aggregate`` uses ``g_i = -delta_i`` (the pseudo-gradient) in the softmax-constrained Eq. 5/6
(Appendix D), written by hand as matrix products on the stack (``merging.py``); A is stepped before
Theta and both use the pre-update Theta; the Theta step's weights are the pre-update ones (paper)
or the updated ones (``theta_weights=after``, as the reference code reads them). ``aggregate`` updates
``theta`` in place: it is the largest object on the server and a copy per round would double the
step's memory traffic; callers that want the previous state must clone it first. Likewise the
payload tensors are views into a merge buffer reused by the next call of the same kind: payloads
from ``configure`` stay valid until the next ``configure`` (those from ``configure_evaluate`` until
the next ``configure_evaluate``), so an engine must load or serialise them before asking again.

Choices (reference code = shutong043/FedMerge @ac60469). ``preset=reference`` selects the reference
code's exact server step and ``preset=paper`` the paper's forms (the defaults); see ``PRESETS``:

* ``prox_form``: ``reference`` (default) is the authors' ``prox_mu * ||theta - theta0||^2`` with no
  1/2; ``fedprox`` is FedProx's ``prox_mu/2 * ||.||^2``. Only trainable parameters enter the term.
  With d = 1 FedMerge is FedProx with ``mu = 2 * prox_mu`` (``reference``) or ``mu = prox_mu``.
* ``theta_update``: ``normalized`` (default, reference) moves Theta_j by the convex combination
  ``sum_i omega_ij delta_i`` with ``omega_ij = p_i w_ij / sum_i' p_i' w_i'j``; ``sum`` is the paper's
  unnormalised ``sum_i p_i w_ij delta_i`` (Eq. 5), whose steps are ~1/d as large. The default
  follows the paper's own reading of "Theta learning rate 1: the global model is replaced with the
  local update model", which only the normalised form satisfies. ``theta_lr`` scales either.
* ``logit_step``: ``fixed_magnitude`` (default, paper and reference) is the closed form of the
  reference's "grid search": increments of ``logit_increment`` until the largest logit change
  exceeds ``logit_lr`` (at most 10,000 increments), independent of the gradient's scale. The
  reference hard-codes the increment 0.01 and uses ``learning_rate_W`` only as the threshold; the
  default increment equals the threshold. ``gradient`` is plain ``A -= logit_lr * dL/dA``.
* ``theta_weights``: ``before`` (default, paper) steps Theta with the merge weights the clients
  trained under; ``after`` (reference) with the weights after this round's logit update.
* ``merge_grad``: which entries enter ``<Theta_j - theta_i, g_i>``: ``all`` (default, Eq. 6) = every
  trainable parameter (BatchNorm running statistics are excluded: their deltas are not loss
  gradients); ``head`` (reference) = the last Linear layer's weight and bias; ``topk`` = per client,
  the ``merge_grad_topk`` fraction of largest-|g| parameters (the paper's "pruning before the inner
  product").
* ``merge_weights``: ``dynamic`` (default) learns A; ``fixed`` (Table 4 ablation) gives each client
  ``fixed_k`` of the d models drawn at random (seeded per client), uniform on those, frozen.
* Initialisation: global model j comes from its own seeded generator; model 0 uses the same
  generator as FedAvg's single model, so d = 1 starts exactly where FedAvg starts.
* ``global_model`` is None: there is no single global model (each client's model is its merge).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from fedmerge.core.algorithm import (
    ALGORITHMS,
    Algorithm,
    AlgorithmConfig,
    ClientContext,
    ClientDataLike,
    ModelFactory,
    PlainSGD,
    StateDict,
)
from fedmerge.core.seeding import NO_ROUND, torch_generator
from fedmerge.core.training import ExtraLoss
from fedmerge.core.types import ClientState, Payload, ServerState, Update

from . import merging
from .base import train_received
from .fedprox import proximal_term


class FedMergeConfig(AlgorithmConfig):
    name: Literal["fedmerge"] = "fedmerge"
    num_models: int = Field(5, ge=1, description="d, the number of global models on the server")
    prox_mu: float = Field(0.01, ge=0, description="proximal coefficient (see prox_form)")
    prox_form: Literal["reference", "fedprox"] = Field(
        "reference", description="reference: prox_mu*||w-w0||^2 (authors' code); fedprox: prox_mu/2*||w-w0||^2"
    )
    theta_lr: float = Field(1.0, gt=0, description="learning rate of the global models")
    theta_update: Literal["normalized", "sum"] = Field(
        "normalized", description="normalized: convex combination per model (reference); sum: paper's Eq. 5"
    )
    logit_step: Literal["fixed_magnitude", "gradient"] = Field(
        "fixed_magnitude", description="fixed_magnitude: largest logit change logit_lr per round; gradient: SGD"
    )
    logit_lr: float = Field(
        0.01,
        gt=0,
        description="merge-logit step (max change per round, or SGD lr); 0.01 barely moves the weights in 30 "
        "rounds: try 0.1 or tune it",
    )
    merge_grad: Literal["all", "head", "topk"] = Field(
        "all", description="entries in the merge-weight inner product: all parameters, classifier head, top-k |g|"
    )
    merge_grad_topk: float = Field(0.1, gt=0, le=1, description="fraction of entries kept per client for topk")
    merge_weights: Literal["dynamic", "fixed"] = Field(
        "dynamic", description="dynamic: learned; fixed: fixed_k random models per client, uniform, frozen"
    )
    fixed_k: int = Field(1, ge=1, description="models per client when merge_weights=fixed")
    theta_weights: Literal["before", "after"] = Field(
        "before",
        description="merge weights in the Theta step: before (paper: one gradient step at one point) or after "
        "the logit update (reference code)",
    )
    logit_increment: float | None = Field(
        None,
        gt=0,
        description="fixed_magnitude: increment of each grid step (reference: 0.01, logit_lr is then only the stop "
        "threshold); default: equal to logit_lr",
    )
    preset: Literal["paper", "reference"] | None = Field(
        None,
        description="fill the server-step options with the paper's forms or the reference code's exact behaviour; "
        "options set explicitly must agree with it",
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("preset") is None:
            return data
        preset = data["preset"]
        if preset not in PRESETS:
            return data  # the Literal check reports it
        out = dict(data)
        for key, value in PRESETS[preset].items():
            if key in out and out[key] != value:
                msg = f"{key}={out[key]!r} contradicts preset {preset!r} ({key}={value!r}); drop one of them"
                raise ValueError(msg)
            out[key] = value
        return out

    @model_validator(mode="after")
    def _check_fixed_k(self) -> FedMergeConfig:
        if self.fixed_k > self.num_models:
            raise ValueError(f"fixed_k ({self.fixed_k}) cannot exceed num_models ({self.num_models})")
        return self


# The server step of each preset. ``paper``: Eqs. 5-6 at one point (both updates use the current
# weights), the inner product over every parameter, the fixed-magnitude logit step whose increment is
# its threshold, Theta by the column-normalised convex combination ("learning rate 1: the global model
# is replaced with the local update model"). ``reference``: shutong043/FedMerge @ac60469 exactly: the
# head-only inner product, a 0.01 increment with logit_lr as the stop threshold (10,000 steps at most),
# and Theta weights read from the updated logits. The defaults are the paper's forms: the paper is the
# authority on the method; the reference preset is for reproducing the authors' numbers.
PRESETS: dict[str, dict[str, Any]] = {
    "paper": {
        "theta_update": "normalized",
        "logit_step": "fixed_magnitude",
        "logit_increment": None,
        "merge_grad": "all",
        "theta_weights": "before",
    },
    "reference": {
        "prox_form": "reference",
        "theta_update": "normalized",
        "logit_step": "fixed_magnitude",
        "logit_increment": 0.01,
        "merge_grad": "head",
        "theta_weights": "after",
    },
}


@dataclass(frozen=True)
class FlatLayout:
    """Where each state-dict entry lives in the flat stack (float) or the counter stack (integer)."""

    floats: tuple[tuple[str, torch.Size, int], ...]  # (key, shape, offset) in stack order
    ints: tuple[tuple[str, torch.Size, torch.dtype], ...]
    num_floats: int
    num_params: int  # columns [0, num_params) are trainable parameters
    head: tuple[int, int]  # columns of the last Linear layer's parameters
    dtype: torch.dtype

    @classmethod
    def of(cls, model: nn.Module) -> FlatLayout:
        state = model.state_dict()
        params = [n for n, p in model.named_parameters() if p.requires_grad]
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        if linears:
            head_ids = {id(q) for q in linears[-1].parameters()}
            head_names = {n for n, q in model.named_parameters() if id(q) in head_ids}
        else:  # no Linear layer: the last two parameter tensors stand in for the head
            head_names = set(params[-2:])
        order = [n for n in params if n not in head_names] + [n for n in params if n in head_names]
        buffers = [k for k, v in state.items() if k not in set(params) and v.is_floating_point()]
        floats, offset = [], 0
        head_start = sum(state[n].numel() for n in params if n not in head_names)
        for key in order + buffers:
            floats.append((key, state[key].shape, offset))
            offset += state[key].numel()
        num_params = sum(state[n].numel() for n in params)
        ints = tuple((k, v.shape, v.dtype) for k, v in state.items() if not v.is_floating_point())
        dtype = state[order[0]].dtype if order else torch.float32
        return cls(tuple(floats), ints, offset, num_params, (head_start, num_params), dtype)

    def flatten_into(self, state: StateDict, row: torch.Tensor) -> None:
        for key, shape, off in self.floats:
            row[off : off + shape.numel()].copy_(state[key].reshape(-1))

    def flatten_rows(self, states: list[StateDict], out: torch.Tensor, concatenate: bool | None = None) -> None:
        """``flatten_into`` for each state, row by row of the contiguous ``out``. On an accelerator it is
        one concatenation into ``out`` instead of one copy per tensor: hundreds of small launches are
        issued by the host more slowly than the device runs them (an H100 profile of the server step). On
        CPU the row copies are kept (8-11% faster there: 50 deltas of 5M floats, 1 thread). The same
        bytes land in the same places either way; ``concatenate`` forces the choice (tests)."""
        if concatenate is None:
            concatenate = out.device.type != "cpu"
        if concatenate:
            parts = [state[key].reshape(-1) for state in states for key, _, _ in self.floats]
            if out.is_contiguous() and all(t.dtype == out.dtype and t.device == out.device for t in parts):
                torch.cat(parts, out=out.view(-1))
                return
        for state, row in zip(states, out):  # CPU, or another dtype or device (copy_ converts)
            self.flatten_into(state, row)

    def int_vector(self, state: StateDict) -> torch.Tensor:
        if not self.ints:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat([state[k].reshape(-1).to(torch.int64) for k, _, _ in self.ints])

    def state_dict(self, row: torch.Tensor, int_row: torch.Tensor) -> StateDict:
        """Views into ``row`` (no copy) plus the integer entries."""
        out = {key: row[off : off + shape.numel()].view(shape) for key, shape, off in self.floats}
        offset = 0
        for key, shape, dtype in self.ints:
            n = shape.numel()
            out[key] = int_row[offset : offset + n].reshape(shape).to(dtype)
            offset += n
        return out


@ALGORITHMS.register(
    "fedmerge",
    config=FedMergeConfig,
    description="FedMerge: d global models, each client gets its own learned merge (softmax(A) @ Theta)",
)
class FedMerge(Algorithm):
    name = "fedmerge"
    dp_sgd_refusal = None
    central_dp_refusal = (
        "merges the clients' models with per-client learned weights, so its server needs each update: not a mean"
    )
    config: FedMergeConfig

    def __init__(self, config: FedMergeConfig, model_factory: ModelFactory, num_clients: int, seed: int) -> None:
        super().__init__(config, model_factory, num_clients, seed)
        self.layout = FlatLayout.of(model_factory(torch.Generator().manual_seed(0)))
        self._buffers: dict[str, torch.Tensor] = {}  # reused (rows, P) matrices, see _buffer

    # --- server ------------------------------------------------------------------------
    def init_server_state(self) -> ServerState:
        cfg, lay = self.config, self.layout
        d = cfg.num_models
        theta = torch.empty(d, lay.num_floats, dtype=lay.dtype)
        counters = torch.zeros(d, sum(shape.numel() for _, shape, _ in lay.ints), dtype=torch.int64)
        for j in range(d):
            weights = self.initial_weights("init" if j == 0 else f"init/fedmerge-model-{j}")
            lay.flatten_into(weights, theta[j])
            counters[j] = lay.int_vector(weights)
        logits = torch.zeros(self.num_clients, d, dtype=torch.float64)
        if cfg.merge_weights == "fixed":
            for cid in range(self.num_clients):
                gen = torch_generator(self.seed, NO_ROUND, cid, "fedmerge/fixed-models")
                chosen = torch.randperm(d, generator=gen)[: cfg.fixed_k]
                logits[cid] = float("-inf")
                logits[cid, chosen] = 0.0
        return ServerState({"theta": theta, "counters": counters, "logits": logits})

    def _merged(self, state: ServerState, cids: list[int], rnd: int, purpose: str) -> dict[int, Payload]:
        w = merging.merge_weights(state.tensors["logits"][cids])
        theta = state.tensors["theta"]
        merged = merging.merge(w, theta, out=self._buffer(purpose, len(cids), theta))
        ints = torch.round(w @ state.tensors["counters"].double()).to(torch.int64)
        return {cid: Payload(self.layout.state_dict(merged[r], ints[r]), {"round": rnd}) for r, cid in enumerate(cids)}

    def configure(self, state: ServerState, rnd: int, selected: list[int]) -> dict[int, Payload]:
        return self._merged(state, sorted(selected), rnd, "fit")

    def configure_evaluate(self, state: ServerState, rnd: int, cids: list[int]) -> dict[int, Payload]:
        return self._merged(state, sorted(cids), rnd, "evaluate")

    def _buffer(self, purpose: str, rows: int, like: torch.Tensor) -> torch.Tensor:
        """A (rows, P) scratch matrix kept between calls. Reuse matters at scale: a fresh 1 GB
        allocation costs more in page faults than the merge itself."""
        buf = self._buffers.get(purpose)
        if buf is None or buf.shape[0] < rows or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buffers[purpose] = torch.empty(rows, like.shape[1], dtype=like.dtype, device=like.device)
        return buf[:rows]

    def aggregate(self, state: ServerState, rnd: int, updates: dict[int, Update]) -> ServerState:
        cfg, lay = self.config, self.layout
        cids = sorted(updates)
        theta, logits = state.tensors["theta"], state.tensors["logits"]
        w = merging.merge_weights(logits[cids])
        n = torch.tensor([float(updates[c].num_examples) for c in cids], dtype=torch.float64, device=logits.device)
        p = n / n.sum()

        deltas = self._stack_deltas([updates[c].tensors for c in cids], theta)
        new_logits = logits.clone()
        if cfg.merge_weights == "dynamic":
            # g_i = -delta_i, so <Theta_j, g_i> = -<Theta_j, delta_i>; uses Theta before its update.
            inner = -merging.inner_products(self._merge_grad_columns(deltas), self._merge_theta_columns(theta))
            grad = merging.logit_gradient(w, inner)  # without p_i
            if cfg.logit_step == "fixed_magnitude":
                step = merging.fixed_magnitude_step(grad, p, cfg.logit_lr, cfg.logit_increment)
            else:
                step = -cfg.logit_lr * p[:, None] * grad
            new_logits[cids] += step
            if cfg.theta_weights == "after":  # the reference reads the updated logits here
                w = merging.merge_weights(new_logits[cids])

        coef = p[:, None] * w
        if cfg.theta_update == "normalized":
            coef = merging.column_normalized(coef)
        # Theta_j <- Theta_j - lr * sum_i coef_ij g_i  ==  Theta_j + lr * sum_i coef_ij delta_i
        theta.addmm_(coef.t().to(theta.dtype), deltas, alpha=cfg.theta_lr)
        counters = state.tensors["counters"]
        if counters.shape[1]:
            int_deltas = torch.stack([lay.int_vector(updates[c].tensors) for c in cids]).double()
            counters = counters + torch.round(cfg.theta_lr * coef.t() @ int_deltas).to(torch.int64)
        return ServerState({"theta": theta, "counters": counters, "logits": new_logits}, dict(state.meta))

    def _stack_deltas(self, deltas: list[StateDict], like: torch.Tensor) -> torch.Tensor:
        out = self._buffer("deltas", len(deltas), like)
        self.layout.flatten_rows(deltas, out)
        return out

    def _merge_grad_columns(self, deltas: torch.Tensor) -> torch.Tensor:
        cfg, lay = self.config, self.layout
        if cfg.merge_grad == "head":
            return deltas[:, lay.head[0] : lay.head[1]]
        params = deltas[:, : lay.num_params]
        return merging.topk_mask(params, cfg.merge_grad_topk) if cfg.merge_grad == "topk" else params

    def _merge_theta_columns(self, theta: torch.Tensor) -> torch.Tensor:
        lay = self.layout
        return theta[:, lay.head[0] : lay.head[1]] if self.config.merge_grad == "head" else theta[:, : lay.num_params]

    def run_warnings(self, state: ServerState, rounds: int) -> list[str]:
        """One line when, after the run, no client gives any model even 1.5x the uniform share 1/d: the
        merge weights did not move, every client trained about the same average of the d models."""
        cfg, d = self.config, self.config.num_models
        if cfg.merge_weights != "dynamic" or d < 2:
            return []
        w = merging.merge_weights(state.tensors["logits"])
        if float(w.max()) >= 1.5 / d:
            return []
        return [
            f"fedmerge's merge weights barely moved from the uniform 1/{d} = {1 / d:.2f} (all within "
            f"{float(w.min()):.2f}-{float(w.max()):.2f} after {rounds} rounds): raise algorithm.logit_lr (now "
            f"{cfg.logit_lr:g}; try 0.1, or tune it) or run more rounds"
        ]

    def server_report(self, state: ServerState, rnd: int) -> dict[str, Any]:
        w = merging.merge_weights(state.tensors["logits"])
        return {"merge_weights": [[round(float(v), 6) for v in row] for row in w]}

    # --- client ------------------------------------------------------------------------
    def _prox(self, payload: Payload, ctx: ClientContext) -> ExtraLoss | None:
        cfg = self.config
        if cfg.prox_mu == 0:
            return None
        anchor = {k: v.to(ctx.device) for k, v in payload.tensors.items()}
        # proximal_term computes mu/2 * ||.||^2; the reference's term has no 1/2.
        return proximal_term(2 * cfg.prox_mu if cfg.prox_form == "reference" else cfg.prox_mu, anchor)

    def client_update(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> tuple[Update, ClientState]:
        meta = train_received(payload.tensors, data, self.config, ctx, self._prox(payload, ctx))
        after = ctx.model.state_dict()
        delta = {k: after[k].detach() - v for k, v in payload.tensors.items()}
        return Update(delta, meta), state

    def personalize(self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext) -> StateDict:
        return payload.tensors

    vectorizable = True

    def plain_sgd(self, payload: Payload, state: ClientState) -> PlainSGD:
        cfg = self.config
        return PlainSGD(payload.tensors, 2 * cfg.prox_mu if cfg.prox_form == "reference" else cfg.prox_mu)

    def plain_sgd_result(
        self, payload: Payload, state: ClientState, trained: StateDict, meta: dict[str, Any]
    ) -> tuple[Update, ClientState]:
        return Update({k: trained[k] - v for k, v in payload.tensors.items()}, meta), state
