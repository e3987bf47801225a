"""LIVAR (Fiorini et al.): aggregation from intrinsic training signals, with no change to the loss.

Clients train exactly as in FedAvg (FedIT on a LoRA model) and send two signals they get for free:

- per LoRA layer l, the path-integral importances ``s_A^l, s_B^l`` (running sums of
  ``|sum(g * parameter update)|`` over the optimiser steps, see ``importance.py``);
- per class c, ``sigma^(c)``: the per-dimension variance of penultimate features over the
  correctly classified training samples of c, averaged over dimensions (after training, eval mode).

The server merges

- every LoRA A and B with per-layer coefficients ``alpha_i^l = G_SHAP(s_A, s_B)`` from a quantile
  table (the paper's Table A by default, or one written by ``fedmerge livar calibrate``);
- each head row c (weight row and bias entry) with weights ``sigma_i^(c) / sum_k sigma_k^(c)``: a
  client without correctly classified samples of c gets 0, and a class no client holds keeps the
  previous server row (Eq. 6);
- everything else by sample counts, as FedAvg.

Choices, recorded:
- A and B are averaged *separately* with the same alpha (as the reference code does); Eq. 3's merge
  of the products ``B_i A_i`` is not representable at rank r, and the next round needs factors.
- The importances cover this round's steps (``importance=round``, the update being merged); the
  reference never resets them (one model object per client, sums over all rounds):
  ``importance=run`` keeps them in the client state to reproduce that.
- The reference evaluates ``W0 + sum (n_i/n) B_i A_i`` while clients continue from the
  alpha-weighted factors; here the global model is the one the clients receive (no quirk).
- ``layer_weighting=samples`` / ``head_weighting=samples`` switch either part back to FedAvg (the
  paper's Table 4 ablation); both together are FedAvg bit for bit.
- ``ccvr`` composes LIVAR then CCVR (paper Table 3): the merged head is re-trained on virtual
  features drawn from the clients' pooled class statistics.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, field_validator

from fedmerge.core.algorithm import ALGORITHMS, AlgorithmConfig, ClientContext, ClientDataLike, ModelFactory
from fedmerge.core.merge import weighted_merge
from fedmerge.core.seeding import NO_CLIENT, torch_generator
from fedmerge.core.types import ClientState, Payload, ServerState, Update

from ._ccvr import CCVRSettings, calibrate_head
from ._features import class_moments, features_and_logits, linear_head, take_prefix, with_prefix
from ._personal import head_prefix, is_head
from .base import StatisticsAlgorithm, model_weights, train_received
from .importance import PathIntegralImportance, lora_layers
from .shap_table import ShapTable, layer_coefficients

STATS = "livar."
CCVR_STATS = "ccvr."


class LIVARConfig(AlgorithmConfig):
    name: Literal["livar"] = "livar"
    layer_weighting: Literal["shap", "samples"] = Field(
        "shap", description="LoRA layers: G_SHAP coefficients from the importances, or FedAvg's n_i (ablation)"
    )
    head_weighting: Literal["variance", "samples"] = Field(
        "variance", description="head rows: per-class feature-variance weights, or FedAvg's n_i (ablation)"
    )
    shap_table: str | None = Field(
        None, description="JSON table from `fedmerge livar calibrate`; default: the paper's Table A"
    )
    importance: Literal["round", "run"] = Field(
        "round", description="importance sums over this round's steps, or over all rounds (reference code)"
    )
    ccvr: CCVRSettings | None = Field(None, description="set (e.g. ccvr={}) to re-train the head with CCVR after")

    @field_validator("shap_table")
    @classmethod
    def _table_loads(cls, path: str | None) -> str | None:
        if path is not None:
            try:
                ShapTable.load(path)
            except (OSError, ValueError) as exc:  # a missing file, bad JSON or an invalid table
                raise ValueError(str(exc).splitlines()[0]) from None
        return path


@ALGORITHMS.register(
    "livar",
    config=LIVARConfig,
    description="LIVAR: variance-weighted head rows + SHAP-calibrated LoRA layer weights (+ optional CCVR)",
)
class LIVAR(StatisticsAlgorithm):
    name = "livar"
    stats_prefix = STATS
    config: LIVARConfig

    def __init__(self, config: LIVARConfig, model_factory: ModelFactory, num_clients: int, seed: int) -> None:
        super().__init__(config, model_factory, num_clients, seed)
        self.probe = model_factory(torch.Generator().manual_seed(0))
        head = linear_head(self.probe)
        self.num_classes = head.out_features
        prefix = head_prefix(self.probe)
        keys = list(self.probe.state_dict())
        self.head_keys = [k for k in keys if is_head(k, prefix)]
        self.layers = lora_layers([k for k in keys if not is_head(k, prefix)])
        self.table = ShapTable.load(config.shap_table)

    # --- client ------------------------------------------------------------------------
    def client_update(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> tuple[Update, ClientState]:
        start = state.tensors.get("importance") if self.config.importance == "run" else None
        tracker = PathIntegralImportance(ctx.model, self.layers, start)
        meta = train_received(
            payload.tensors, data, self.config, ctx, before_step=tracker.before_step, after_step=tracker.after_step
        )
        stats = {"importance": tracker.sums.float(), **self.client_statistics(ctx, data)}
        new_state = ClientState({"importance": tracker.sums.float()}) if self.config.importance == "run" else state
        return Update({**model_weights(ctx), **with_prefix(STATS, stats)}, meta), new_state

    def client_statistics(self, ctx: ClientContext, data: ClientDataLike) -> dict[str, torch.Tensor]:
        """sigma^(c) over correctly classified training samples (+ CCVR's class moments if on)."""
        feats, logits = features_and_logits(ctx.model, data.x_train)
        y = data.y_train
        correct = logits.argmax(1) == y
        m = class_moments(feats[correct], y[correct], self.num_classes)
        out = {"variance": torch.where(m["count"] > 1, m["var"].mean(1).double(), 0.0).float()}
        if self.config.ccvr is not None:
            allm = class_moments(feats, y, self.num_classes, covariance=True)
            out |= with_prefix(CCVR_STATS, {k: allm[k] for k in ("count", "mean", "cov")})
        return out

    # --- server ------------------------------------------------------------------------
    def aggregate(self, state: ServerState, rnd: int, updates: dict[int, Update]) -> ServerState:
        cids = sorted(updates)
        stats, models, merged = self.split(updates)
        n = torch.tensor([updates[c].num_examples for c in cids], dtype=torch.float64)
        meta = dict(state.meta)
        if self.layers and self.config.layer_weighting == "shap":
            # (clients, 2, layers), on CPU where the SHAP table is
            imp = torch.stack([s["importance"].double().cpu() for s in stats])
            alpha = layer_coefficients(self.table, imp[:, 0], imp[:, 1], n)
            for j, (_, a, b) in enumerate(self.layers):
                coef = alpha[:, j].tolist()
                merged[a] = weighted_merge([m[a] for m in models], coef)
                merged[b] = weighted_merge([m[b] for m in models], coef)
            meta["layer_coefficients"] = {str(c): [round(float(v), 6) for v in alpha[i]] for i, c in enumerate(cids)}
        if self.config.head_weighting == "variance":
            sigma = [s["variance"].double() for s in stats]
            for k in self.head_keys:
                per_row = [v.reshape(-1, *([1] * (state.tensors[k].dim() - 1))) for v in sigma]
                merged[k] = weighted_merge([m[k] for m in models], per_row, fallback=state.tensors[k])
        if self.config.ccvr is not None:
            ccvr_stats = [take_prefix(CCVR_STATS, s)[0] for s in stats]
            gen = torch_generator(self.seed, rnd, NO_CLIENT, "ccvr")
            merged = calibrate_head(self.probe, merged, ccvr_stats, self.config.ccvr, self.config, gen)
        return ServerState(merged, meta)

    def server_report(self, state: ServerState, rnd: int) -> dict:
        return {k: state.meta[k] for k in ("layer_coefficients",) if k in state.meta}
