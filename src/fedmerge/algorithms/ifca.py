"""IFCA (Ghosh et al., NeurIPS 2020): iterative federated clustering with k cluster models.

Round (reference ``jichan3751/ifca`` @61e44b8): the server sends all k cluster models to every
selected client; the client evaluates each on its whole training set (eval mode), takes the one with
the lowest loss, trains it (``local_sgd``) and returns it with its cluster id in ``Update.meta``; the
server averages the returned models per cluster; a cluster nobody chose is unchanged. Communication:
k models down, one up. No persistent client state (as the reference): the personalised model is the
cluster model with the lowest loss on the client's *training* data (the reference picks with test
clients' labelled test data, which would leak the test labels).

Choices and reference quirks:
- the k models are initialised independently (model 0 with FedAvg's ``init`` seed, so ``k: 1`` is
  FedAvg exactly, record for record);
- ``weighting: samples`` (default) averages a cluster's models by n_i, like every method here;
  ``uniform`` is the reference's unweighted mean (the paper assumes equal n_i, where both agree);
- ``min_cluster_share`` (default 0: off, the paper) copies the reference's ``find_good_initializer``
  (CIFAR: 0.35 for k=2, 0.1 for k=4), which re-draws the initial models until every cluster is
  chosen by at least that share of clients. The server has no data at init time, so the check runs
  on the first rounds instead: while the draw is not accepted, ``aggregate`` counts the cluster ids
  the round's clients chose on the current (initial) models, which is the reference's criterion,
  over that round's selected clients rather than all clients. A draw that passes is accepted and the
  round's training is kept; a draw that fails is replaced by the next seeded draw and the round's
  updates are discarded, so each rejected draw costs one round of the budget (logged as
  ``server.init_attempt``). After ``max_init_attempts`` draws the last one is kept;
- ``shared_body: true`` is the paper's weight-sharing variant (not in the reference's MNIST code):
  every layer but the head (``model.head_prefix``) is one shared body averaged over all the round's
  clients, and each cluster has its own head. The body travels once: down = body + k heads.

``server.merge_weights`` logs each client's last chosen cluster one-hot (uniform before its first
round), the layout FedMerge logs, so the run summary's cluster recovery and the merge-weight plot
work for IFCA too.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from fedmerge.core.algorithm import (
    ALGORITHMS,
    Algorithm,
    AlgorithmConfig,
    ClientContext,
    ClientDataLike,
    StateDict,
    adapt_epochs,
)
from fedmerge.core.params import weighted_average
from fedmerge.core.types import ClientState, Payload, ServerState, Update

from ._multimodel import initial_models, one_hot_rows, pack, per_sample_losses, unpack
from ._personal import Weighting, head_prefix, is_head
from .assignments import ASSIGNMENT_HOOKS
from .base import fine_tuned, model_weights, train_received

TAG = "ifca"


class IFCAConfig(AlgorithmConfig):
    name: Literal["ifca"] = "ifca"
    num_clusters: int = Field(2, ge=1, description="k, the number of cluster models")
    weighting: Weighting = Field("samples", description="per-cluster average: by n_i, or uniform (reference)")
    shared_body: bool = Field(False, description="weight-sharing variant: one body for all, a head per cluster")
    min_cluster_share: float = Field(
        0.0, ge=0, le=1, description="re-draw the initial models until each cluster gets this share of clients"
    )
    max_init_attempts: int = Field(20, ge=1, description="draws tried for min_cluster_share before giving up")

    @model_validator(mode="after")
    def _feasible(self) -> IFCAConfig:
        if self.min_cluster_share * self.num_clusters > 1:
            raise ValueError("min_cluster_share * num_clusters must be at most 1")
        return self


def choose_cluster(model: torch.nn.Module, models: list[StateDict], x: torch.Tensor, y: torch.Tensor) -> int:
    """Index of the model with the lowest mean training loss (the first on ties)."""
    if len(models) == 1:
        return 0
    losses = per_sample_losses(model, models, x, y).mean(dim=1).tolist()
    return min(range(len(losses)), key=losses.__getitem__)


@ALGORITHMS.register(
    "ifca",
    config=IFCAConfig,
    description="IFCA: k cluster models, clients join the lowest-loss one",
    hooks=ASSIGNMENT_HOOKS,
)
class IFCA(Algorithm):
    name = "ifca"
    dp_sgd_refusal = (
        "chooses its cluster by the losses of every cluster model on its training data and sends that choice,"
        " which DP-SGD does not cover"
    )
    central_dp_refusal = "averages per cluster, so its server needs each client's cluster"
    secure_aggregation_refusal = "averages per cluster, so its server needs each client's update and cluster choice"
    config: IFCAConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_prefix = head_prefix(self.model_factory(torch.Generator().manual_seed(0)))

    # --- layout ----------------------------------------------------------------------------
    def _is_head(self, key: str) -> bool:
        return is_head(key, self._head_prefix)

    def _pack(self, models: list[StateDict]) -> StateDict:
        return pack(models, self._is_head if self.config.shared_body else None)

    def _models(self, tensors: dict[str, torch.Tensor]) -> list[StateDict]:
        return unpack(tensors, self.config.num_clusters)

    # --- server ----------------------------------------------------------------------------
    def init_server_state(self) -> ServerState:
        models = initial_models(self, self.config.num_clusters, TAG)
        if self.config.shared_body:  # one body: model 0's
            models = [{**models[0], **{k: v for k, v in m.items() if self._is_head(k)}} for m in models]
        return ServerState(self._pack(models), {"init_attempt": 0, "init_done": self.config.min_cluster_share == 0})

    def configure(self, state: ServerState, rnd: int, selected: list[int]) -> dict[int, Payload]:
        # Payloads share tensors: the engine must not mutate them (load_state_dict copies).
        return {cid: Payload(state.tensors, {"round": rnd}) for cid in selected}

    def _redraw(self, meta: dict[str, Any], clusters: list[int]) -> bool:
        """Whether this round's assignment rejects the current initial draw (``min_cluster_share``)."""
        cfg = self.config
        if meta.get("init_done", True) or cfg.num_clusters == 1:
            return False
        if int(meta["init_attempt"]) + 1 >= cfg.max_init_attempts:
            return False
        counts = [clusters.count(j) for j in range(cfg.num_clusters)]
        return min(counts) < cfg.min_cluster_share * len(clusters)

    def aggregate(self, state: ServerState, rnd: int, updates: dict[int, Update]) -> ServerState:
        cfg = self.config
        cids = sorted(updates)
        chosen = {c: int(updates[c].meta["cluster"]) for c in cids}
        meta = dict(state.meta)
        if self._redraw(meta, [chosen[c] for c in cids]):
            meta["init_attempt"] = attempt = int(meta["init_attempt"]) + 1
            models = initial_models(self, cfg.num_clusters, TAG, attempt)
            if cfg.shared_body:
                models = [{**models[0], **{k: v for k, v in m.items() if self._is_head(k)}} for m in models]
            return ServerState(self._pack(models), meta)
        meta["init_done"] = True

        def weight(c: int) -> float:
            return float(updates[c].num_examples) if cfg.weighting == "samples" else 1.0

        models = self._models(state.tensors)
        for j in range(cfg.num_clusters):
            members = [c for c in cids if chosen[c] == j]
            if members:  # a cluster nobody chose keeps its model
                avg = weighted_average([updates[c].tensors for c in members], [weight(c) for c in members])
                models[j] = {k: v for k, v in avg.items() if self._is_head(k)} if cfg.shared_body else avg
        if cfg.shared_body:
            body = weighted_average(
                [{k: v for k, v in updates[c].tensors.items() if not self._is_head(k)} for c in cids],
                [weight(c) for c in cids],
            )
            models = [{**body, **{k: v for k, v in m.items() if self._is_head(k)}} for m in models]
        meta["clusters"] = {**meta.get("clusters", {}), **{str(c): chosen[c] for c in cids}}
        return ServerState(self._pack(models), meta)

    def global_model(self, state: ServerState) -> StateDict | None:
        return self._models(state.tensors)[0] if self.config.num_clusters == 1 else None

    def server_report(self, state: ServerState, rnd: int) -> dict[str, Any]:
        k = self.config.num_clusters
        if k == 1:
            return {}
        clusters = {int(c): int(j) for c, j in state.meta.get("clusters", {}).items()}
        sizes = [sum(1 for j in clusters.values() if j == i) for i in range(k)]
        report: dict[str, Any] = {"merge_weights": one_hot_rows(clusters, self.num_clients, k), "cluster_sizes": sizes}
        if self.config.min_cluster_share > 0:
            report["init_attempt"] = int(state.meta.get("init_attempt", 0))
        return report

    # --- client ----------------------------------------------------------------------------
    def client_update(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> tuple[Update, ClientState]:
        models = self._models(payload.tensors)
        j = choose_cluster(ctx.model, models, data.x_train, data.y_train)
        meta = train_received(models[j], data, self.config, ctx)
        return Update(model_weights(ctx), {**meta, "cluster": j}), state

    def personalize(self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext) -> StateDict:
        models = self._models(payload.tensors)
        return models[choose_cluster(ctx.model, models, data.x_train, data.y_train)]

    # a newcomer receives the k cluster models (as a participant does), joins the one with the lowest loss on its
    # training split, and fine-tunes it for its budget
    def configure_onboard(self, state: ServerState, rnd: int, cids: list[int]) -> dict[int, Payload]:
        return self.configure(state, rnd, cids)

    def onboard(self, payload: Payload, data: ClientDataLike, ctx: ClientContext) -> StateDict:
        chosen = self.personalize(payload, data, ClientState(), ctx)
        return fine_tuned(chosen, data, self.config, ctx, adapt_epochs(payload))
