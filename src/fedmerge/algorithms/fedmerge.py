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
does (shared `train_received()`) plus a proximal term, return ``delta_i = theta_i(after) -
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

Choices (reference code = shutong043/FedMerge @ac60469; the options and presets are in ``fedmerge_config.py``).
``preset=reference`` selects the reference code's exact server step and ``preset=paper`` the paper's forms (the
defaults); see ``PRESETS``:

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
  default increment equals the threshold. ``gradient`` is plain ``A -= logit_lr * dL/dA``. The default
  ``logit_lr`` (``DEFAULT_LOGIT_LR``) is larger than the paper's stated 0.01, which is for 200-500 rounds
  and leaves the weights near uniform in this project's 20-50 (the evidence:
  docs/reproductions/fedmerge/logit_lr/); ``preset=reference`` keeps the reference's 0.01 unless written.
* ``theta_weights``: ``before`` (default, paper) steps Theta with the merge weights the clients
  trained under; ``after`` (reference) with the weights after this round's logit update.
* ``merge_grad``: which entries enter ``<Theta_j - theta_i, g_i>``: ``all`` (default, Eq. 6) = every
  trainable parameter (BatchNorm running statistics are excluded: their deltas are not loss
  gradients); ``head`` = the last Linear layer's weight and bias; ``from_key`` (reference) = every
  parameter from the first state-dict key containing ``merge_grad_key`` on, every parameter when no
  key contains it (the reference's rule with 'linear', the name of its ResNet's head; this project's
  models name their head ``classifier``, so on them the literal rule takes the whole model and
  ``merge_grad_key=classifier`` takes the head); ``topk`` = per client, the ``merge_grad_topk``
  fraction of largest-|g| parameters (the paper's "pruning before the inner product").
* Numerics: the logit gradient needs ``<Theta_j - theta_i, g_i>``; it is formed as ``<Theta_j, g_i>``
  minus its weighted mean, and those products are redone with float64 accumulation when they cancel
  (nearly equal global models, where float32 would lose 0.5% of the step or more; see
  ``merging.inner_products``). Well-separated models keep the float32 products, bit for bit.
* ``preset``: the server options of each preset are in ``PRESETS``; an option set explicitly that
  contradicts the preset is refused in one line. ``preset=reference`` also sets the client's training
  as the reference code does (``PRESET_UNLESS_WRITTEN``: SGD lr 0.01, which it hard-codes, 2 local
  epochs, batch 32, no momentum or weight decay) and keeps its logit threshold ``logit_lr`` 0.01, but for
  these an explicit value wins (studies tune the learning rate and logit_lr under the preset); built-in
  defaults (the command line's lr 0.2, the default logit_lr) are not explicit.
* ``merge_weights``: ``dynamic`` (default) learns A; ``fixed`` (Table 4 ablation) gives each client
  ``fixed_k`` of the d models drawn at random (seeded per client), uniform on those, frozen.
* Initialisation: global model j comes from its own seeded generator; model 0 uses the same
  generator as FedAvg's single model, so d = 1 starts exactly where FedAvg starts.
* ``global_model`` is None: there is no single global model (each client's model is its merge).
"""

from __future__ import annotations

from typing import Any

import torch

from fedmerge.core.algorithm import (
    ALGORITHMS,
    Algorithm,
    ClientContext,
    ClientDataLike,
    ModelFactory,
    PlainSGD,
    Predictor,
    StateDict,
    adapt_epochs,
    with_epochs,
)
from fedmerge.core.seeding import NO_ROUND, torch_generator
from fedmerge.core.training import Proximal, local_sgd
from fedmerge.core.types import ClientState, Payload, ServerState, Update

from . import merging
from ._flat_layout import FlatLayout
from .assignments import ASSIGNMENT_HOOKS
from .base import fine_tuned, train_received
from .fedmerge_config import FORMER_PRESET_VALUES as FORMER_PRESET_VALUES
from .fedmerge_config import PRESET_UNLESS_WRITTEN as PRESET_UNLESS_WRITTEN
from .fedmerge_config import PRESETS as PRESETS
from .fedmerge_config import FedMergeConfig


@ALGORITHMS.register(
    "fedmerge",
    config=FedMergeConfig,
    description="FedMerge: d global models, each client gets its own learned merge (softmax(A) @ Theta)",
    hooks=ASSIGNMENT_HOOKS,
)
class FedMerge(Algorithm):
    name = "fedmerge"
    dp_sgd_refusal = None
    central_dp_refusal = (
        "merges the clients' models with per-client learned weights, so its server needs each update: not a mean"
    )
    secure_aggregation_refusal = (
        "learns each client's merge weights from that client's own update, so its server needs each update, "
        "not their sum"
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
            inner = -merging.inner_products(self._merge_grad_columns(deltas), self._merge_theta_columns(theta), w)
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

    def _merge_columns(self) -> slice | torch.Tensor:
        """The columns that enter the merge-weight inner product (``merge_grad``)."""
        cfg, lay = self.config, self.layout
        if cfg.merge_grad == "head":
            return slice(*lay.head)
        if cfg.merge_grad == "from_key":
            return lay.param_columns_from_key(cfg.merge_grad_key)
        return slice(0, lay.num_params)

    def _merge_grad_columns(self, deltas: torch.Tensor) -> torch.Tensor:
        cols = _columns(deltas, self._merge_columns())
        cfg = self.config
        return merging.topk_mask(cols, cfg.merge_grad_topk) if cfg.merge_grad == "topk" else cols

    def _merge_theta_columns(self, theta: torch.Tensor) -> torch.Tensor:
        return _columns(theta, self._merge_columns())

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
            f"{cfg.logit_lr:g}; try {3 * cfg.logit_lr:g}, or tune it) or run more rounds"
        ]

    def server_report(self, state: ServerState, rnd: int) -> dict[str, Any]:
        w = merging.merge_weights(state.tensors["logits"])
        return {"merge_weights": [[round(float(v), 6) for v in row] for row in w]}

    # --- client ------------------------------------------------------------------------
    def _prox(self, payload: Payload, ctx: ClientContext) -> Proximal | None:
        cfg = self.config
        if cfg.prox_mu == 0:
            return None
        anchor = {k: v.to(ctx.device) for k, v in payload.tensors.items()}
        # Proximal is mu/2 * ||.||^2; the reference's term has no 1/2.
        return Proximal(2 * cfg.prox_mu if cfg.prox_form == "reference" else cfg.prox_mu, anchor)

    def client_update(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> tuple[Update, ClientState]:
        meta = train_received(payload.tensors, data, self.config, ctx, proximal=self._prox(payload, ctx))
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

    # --- a newcomer: its own merge logits fitted on its data, the d global models frozen ----------------------
    def configure_onboard(self, state: ServerState, rnd: int, cids: list[int]) -> dict[int, Payload]:
        """The d global models (d models down, as IFCA's k): the newcomer fits its own merge."""
        tensors = {"theta": state.tensors["theta"], "counters": state.tensors["counters"]}
        return {cid: Payload(tensors, {"round": rnd}) for cid in sorted(cids)}

    def newcomer_logits(self, payload: Payload, data: ClientDataLike, ctx: ClientContext) -> torch.Tensor:
        """The newcomer's merge logits a (d,): a participant's start (zeros: uniform weights; ``fixed``: its
        seeded ``fixed_k`` models, which stay fixed), then ``adapt_epochs`` epochs of minibatch SGD
        (``onboard_lr``, no momentum) on the task loss of ``softmax(a) @ Theta`` with Theta frozen. This is
        gradient descent on the logits (autograd through the merge), not the paper's server-side step, which
        moves a participant's logits by ``logit_lr`` per round and would leave a newcomer near uniform."""
        cfg, lay = self.config, self.layout
        theta = payload.tensors["theta"].to(ctx.device)
        logits = torch.zeros(cfg.num_models, dtype=torch.float64, device=ctx.device)
        if cfg.merge_weights == "fixed":
            gen = torch_generator(self.seed, NO_ROUND, ctx.cid, "fedmerge/fixed-models")
            logits[:] = float("-inf")
            logits[torch.randperm(cfg.num_models, generator=gen)[: cfg.fixed_k].to(ctx.device)] = 0.0
        epochs = adapt_epochs(payload)
        if epochs == 0 or cfg.merge_weights == "fixed" or cfg.num_models == 1:
            return logits
        a = logits.clone().requires_grad_(True)
        names = [n for n, p in ctx.model.named_parameters() if p.requires_grad]
        # buffers (BatchNorm statistics) at the start's merge: training mode normalises by batch statistics
        start = lay.state_dict(
            merging.merge(merging.merge_weights(logits[None]), theta)[0], self._ints(payload, logits)
        )
        buffers = {k: v.clone() for k, v in start.items() if k not in set(names)}
        offsets = {key: (off, shape) for key, shape, off in lay.floats}

        def forward(x: torch.Tensor) -> torch.Tensor:
            row = merging.merge(merging.merge_weights(a[None]), theta)[0]
            params = {k: row[offsets[k][0] : offsets[k][0] + offsets[k][1].numel()].view(offsets[k][1]) for k in names}
            return torch.func.functional_call(ctx.model, {**params, **buffers}, (x,))

        step = with_epochs(cfg, epochs).model_copy(update={"lr": cfg.onboard_lr, "momentum": 0.0, "weight_decay": 0.0})
        local_sgd(ctx.model, data.x_train, data.y_train, step, ctx.generator("onboard/logits"), params=[a],
                  forward=forward)  # fmt: skip
        return a.detach()

    def _ints(self, payload: Payload, logits: torch.Tensor) -> torch.Tensor:
        w = merging.merge_weights(logits[None])
        return torch.round(w @ payload.tensors["counters"].to(w.device).double()).to(torch.int64)[0]

    def onboard_variants(
        self, payload: Payload, data: ClientDataLike, ctx: ClientContext
    ) -> dict[str, StateDict | Predictor]:
        """``""``: the merge with the fitted logits, then fine-tuned for ``adapt_epochs`` epochs (plain local
        SGD, as a global model is fine-tuned); ``merge_only``: that merge without fine-tuning."""
        logits = self.newcomer_logits(payload, data, ctx)
        theta = payload.tensors["theta"].to(ctx.device)
        row = merging.merge(merging.merge_weights(logits[None]), theta)[0]
        merged = {k: v.clone() for k, v in self.layout.state_dict(row, self._ints(payload, logits)).items()}
        epochs = adapt_epochs(payload)
        if epochs == 0:
            return {"": merged}
        return {"": fine_tuned(merged, data, self.config, ctx, epochs), "merge_only": merged}

    def onboard(self, payload: Payload, data: ClientDataLike, ctx: ClientContext) -> StateDict | Predictor:
        return self.onboard_variants(payload, data, ctx)[""]


def _columns(x: torch.Tensor, cols: slice | torch.Tensor) -> torch.Tensor:
    return x[:, cols] if isinstance(cols, slice) else x.index_select(1, cols.to(x.device))
