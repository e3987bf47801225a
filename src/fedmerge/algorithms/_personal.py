"""Pieces shared by the personalisation baselines and SuPerFed (not a registered method).

- head/body split of a state dict by the model's ``head_prefix``;
- trainable copies ("leaves") of a state dict, for methods that train a second model next to
  ``ctx.model`` through ``torch.func.functional_call``;
- parameter interpolation ``(1 - lam) a + lam b`` and the evaluation grid along it;
- the local-global gap probe (the same figures ``base.train_received`` logs for FedAvg).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

import torch
from torch import nn

from fedmerge.core.algorithm import ClientContext, ClientDataLike, StateDict
from fedmerge.core.params import weighted_average
from fedmerge.core.training import TrainStats, predict_logits
from fedmerge.core.types import Update
from fedmerge.metrics.classification import nll, topk_accuracy

from .base import gap_loss, gap_subset

Weighting = Literal["samples", "uniform"]


# --- head / body ---------------------------------------------------------------------------
def head_prefix(model: nn.Module) -> str:
    return str(getattr(model, "head_prefix", "classifier"))


def is_head(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


def split_state(state: Mapping[str, torch.Tensor], prefix: str) -> tuple[StateDict, StateDict]:
    """(head, body) parts of a state dict; BatchNorm buffers follow their module."""
    head = {k: v for k, v in state.items() if is_head(k, prefix)}
    body = {k: v for k, v in state.items() if not is_head(k, prefix)}
    return head, body


def param_names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters()]


# --- a second trainable model --------------------------------------------------------------
def leaves(state: Mapping[str, torch.Tensor], keys: Iterable[str], device: torch.device) -> dict[str, torch.Tensor]:
    """Fresh trainable copies of ``state[k]`` (never aliasing a payload or a stored state)."""
    return {k: state[k].detach().to(device).clone().requires_grad_(True) for k in keys}


def detached(tensors: Mapping[str, torch.Tensor]) -> StateDict:
    return {k: v.detach().clone() for k, v in tensors.items()}


def zeros_like_params(model: nn.Module) -> StateDict:
    return {n: torch.zeros_like(p, requires_grad=False) for n, p in model.named_parameters()}


class SecondModel:
    """A personal model trained next to ``ctx.model`` (which holds the global one): trainable copies
    of its parameters plus copies of its buffers, run through ``functional_call`` on the same module
    object (BatchNorm updates these buffers, not the global model's)."""

    def __init__(self, state: Mapping[str, torch.Tensor], model: nn.Module, device: torch.device) -> None:
        names = param_names(model)
        self.params = leaves(state, names, device)
        self.buffers = {k: v.detach().to(device).clone() for k, v in state.items() if k not in self.params}

    def __call__(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, {**self.params, **self.buffers}, (x,))

    def state(self) -> StateDict:
        return {**detached(self.params), **self.buffers}


# --- interpolation -------------------------------------------------------------------------
def interpolate(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], lam: float) -> StateDict:
    """``(1 - lam) a + lam b`` over floating tensors of ``a``; integer buffers are taken from ``a``."""
    out: StateDict = {}
    for k, va in a.items():
        if k in b and va.is_floating_point():
            out[k] = (1.0 - lam) * va + lam * b[k]
        else:
            out[k] = va
    return out


def lambda_grid(steps: int) -> list[float]:
    return [i / steps for i in range(steps + 1)]


def lambda_key(lam: float) -> str:
    return f"lambda={lam:g}"


def pick_best(
    model: nn.Module, variants: Mapping[str, StateDict], x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024
) -> str:
    """The variant with the highest accuracy on (x, y); ties go to the lower NLL, then the first."""
    best_key, best_score = next(iter(variants)), None
    for key, weights in variants.items():
        model.load_state_dict(weights)
        logits = predict_logits(model, x, batch_size)
        score = (topk_accuracy(logits, y, 1), -nll(logits, y))
        if best_score is None or score > best_score:
            best_key, best_score = key, score
    return best_key


# --- server side ---------------------------------------------------------------------------
def average_updates(updates: Mapping[int, Update], weighting: Weighting = "samples") -> StateDict:
    """Average the update tensors in client-id order, by sample count (FedAvg) or uniformly."""
    cids = sorted(updates)
    weights = [updates[c].num_examples if weighting == "samples" else 1.0 for c in cids]
    return weighted_average([updates[c].tensors for c in cids], weights)


def half_sq_dist(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], lam: float) -> torch.Tensor:
    """(lam / 2) * sum_k ||a_k - b_k||^2: the proximal pull of Ditto and pFedMe."""
    return 0.5 * lam * torch.stack([((a[k] - b[k]) ** 2).sum() for k in a]).sum()


# --- local-global gap ----------------------------------------------------------------------
class GapProbe:
    """The training loss of the model as received and as uploaded (on ``gap_subset``), as
    ``base.train_received`` logs it, so runs of these methods report the same ``local_gap``."""

    def __init__(self, data: ClientDataLike, ctx: ClientContext, samples: int) -> None:
        self.x, self.y = gap_subset(data, ctx, samples)
        self.received = gap_loss(ctx.model, self.x, self.y)  # ctx.model must hold the received weights

    def meta(self, ctx: ClientContext, data: ClientDataLike, stats: TrainStats, **extra: Any) -> dict[str, Any]:
        """Update meta; ``ctx.model`` must now hold the uploaded weights."""
        return {
            "num_examples": int(data.y_train.shape[0]),
            "train_loss": stats.loss,
            "steps": stats.steps,
            "loss_received": self.received,
            "loss_trained": gap_loss(ctx.model, self.x, self.y),
            **extra,
        }
