"""Per-dataset classification metrics computed from logits: accuracy, top-k, NLL, ECE and MCE."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def _check(logits: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    if logits.ndim != 2 or y.ndim != 1 or logits.shape[0] != y.shape[0]:
        raise ValueError(f"expected logits (N, C) and labels (N,), got {tuple(logits.shape)} and {tuple(y.shape)}")
    # float64 so that sums over large evaluation sets do not drift with the batch order.
    return logits.detach().double(), y.detach().long().to(logits.device)


def topk_accuracy(logits: Tensor, y: Tensor, k: int = 1) -> float:
    """Fraction of samples whose label is among the ``k`` largest logits (k clipped to the class count)."""
    logits, y = _check(logits, y)
    if y.numel() == 0:
        return math.nan
    k = max(1, min(int(k), logits.shape[1]))
    top = logits.topk(k, dim=1).indices
    return (top == y[:, None]).any(dim=1).double().mean().item()


def nll(logits: Tensor, y: Tensor) -> float:
    """Mean cross-entropy (negative log-likelihood of the softmax)."""
    logits, y = _check(logits, y)
    if y.numel() == 0:
        return math.nan
    return F.cross_entropy(logits, y).item()


def calibration_errors(logits: Tensor, y: Tensor, n_bins: int = 15) -> tuple[float, float]:
    """(ECE, MCE) of the max-softmax confidence, Guo et al. (2017).

    Equal-width bins (lo, hi] over [0, 1]; ECE = sum_b |B_b|/n * |acc(B_b) - conf(B_b)|, MCE is the
    largest gap over non-empty bins.
    """
    logits, y = _check(logits, y)
    n = y.numel()
    if n == 0:
        return math.nan, math.nan
    conf, pred = logits.softmax(dim=1).max(dim=1)
    correct = (pred == y).double()
    # Bin b holds confidences in (edges[b], edges[b+1]]; bucketize(right=False) uses the same
    # strict-lower/inclusive-upper rule as the usual `conf.gt(lo) * conf.le(hi)` loop.
    edges = torch.linspace(0.0, 1.0, n_bins + 1, dtype=conf.dtype, device=conf.device)
    bins = (torch.bucketize(conf, edges) - 1).clamp(0, n_bins - 1)
    count = torch.bincount(bins, minlength=n_bins).double()
    acc_sum = torch.bincount(bins, weights=correct, minlength=n_bins)
    conf_sum = torch.bincount(bins, weights=conf, minlength=n_bins)
    nonempty = count > 0
    gap = (acc_sum[nonempty] - conf_sum[nonempty]).abs() / count[nonempty]
    ece = (gap * count[nonempty]).sum().item() / n
    mce = gap.max().item()
    return ece, mce


def classification_metrics(logits: Tensor, y: Tensor, n_bins: int = 15) -> dict[str, float]:
    """acc, top5, nll, ece, mce and the sample count n (the weight for client summaries)."""
    ece, mce = calibration_errors(logits, y, n_bins)
    return {
        "acc": topk_accuracy(logits, y, 1),
        "top5": topk_accuracy(logits, y, 5),
        "nll": nll(logits, y),
        "ece": ece,
        "mce": mce,
        "n": float(y.numel()),
    }
