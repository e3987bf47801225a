"""Several models of one architecture in one record (IFCA's clusters, FedEM's components).

Layout: model 0 is stored under its plain state-dict keys and model ``j > 0`` under ``m{j}/<key>``.
With one model the record is therefore exactly FedAvg's (same keys, same tensors), which is what
makes ``k = 1`` / ``M = 1`` reduce to FedAvg record for record. Keys shared by every model (IFCA's
weight-sharing variant: the body) are stored once, under the plain keys only.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

import torch
from torch.nn import functional as F

from fedmerge.core.algorithm import Algorithm, ClientRows, StateDict
from fedmerge.core.training import predict_logits

_PREFIX = re.compile(r"^m(\d+)/")


def prefix(j: int) -> str:
    return "" if j == 0 else f"m{j}/"


def pack(models: Sequence[Mapping[str, torch.Tensor]], own: Callable[[str], bool] | None = None) -> StateDict:
    """One record holding ``models``; for ``j > 0`` only the keys with ``own(key)`` (default: all)."""
    out: StateDict = dict(models[0])
    for j, m in enumerate(models[1:], start=1):
        out.update({prefix(j) + k: v for k, v in m.items() if own is None or own(k)})
    return out


def unpack(tensors: Mapping[str, torch.Tensor], k: int) -> list[StateDict]:
    """The ``k`` full state dicts of a [`pack()`][fedmerge.algorithms._multimodel.pack] record (shared keys are the
    same tensors)."""
    base = {key: v for key, v in tensors.items() if not _PREFIX.match(key)}
    models = [base]
    for j in range(1, k):
        p = prefix(j)
        models.append({**base, **{key[len(p) :]: v for key, v in tensors.items() if key.startswith(p)}})
    return models


def init_purpose(tag: str, j: int, attempt: int = 0) -> str:
    """Seed purpose of model ``j``'s initial weights. Model 0 of the first draw uses ``"init"``,
    FedAvg's, so a single model starts from FedAvg's initial weights."""
    if j == 0 and attempt == 0:
        return "init"
    return f"init/{tag}-model-{j}" + (f"/attempt-{attempt}" if attempt else "")


def initial_models(algorithm: Algorithm, k: int, tag: str, attempt: int = 0) -> list[StateDict]:
    """``k`` independently initialised models (each from its own seeded generator)."""
    return [algorithm.initial_weights(init_purpose(tag, j, attempt)) for j in range(k)]


@torch.no_grad()
def per_sample_losses(
    model: torch.nn.Module, models: Sequence[Mapping[str, torch.Tensor]], x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """(len(models), n) cross-entropy of every model on every sample, in eval mode."""
    rows = []
    for weights in models:
        model.load_state_dict(weights)
        rows.append(F.cross_entropy(predict_logits(model, x), y, reduction="none"))
    return torch.stack(rows)


def model_logits(model: torch.nn.Module, models: Sequence[Mapping[str, torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
    """(len(models), n, classes) logits of every model on ``x``, in eval mode."""
    out = []
    for weights in models:
        model.load_state_dict(weights)
        out.append(predict_logits(model, x))
    return torch.stack(out)


def one_hot_rows(choice: Mapping[int, int], num_clients: int, k: int) -> ClientRows:
    """Client x model matrix (``server.merge_weights`` layout): one-hot at each known choice,
    uniform for clients never seen; rows are made only for the clients logged."""

    def row(cid: int) -> list[float]:
        j = choice.get(cid)
        return [1.0 / k] * k if j is None else [1.0 if i == j else 0.0 for i in range(k)]

    return ClientRows(num_clients, row)
