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


def segment_metrics(logits: Tensor, y: Tensor, bounds: list[int], n_bins: int = 15) -> list[dict[str, float]]:
    """``classification_metrics`` of each segment ``bounds[i]:bounds[i+1]`` of the rows, bit for bit,
    at a fraction of the cost of calling it per segment (many clients' splits in one pass).

    Row-wise quantities (top-k hits, confidences, bins) are computed once for all rows: each row's
    value does not depend on the other rows. The sums are taken as the per-segment call takes them:
    hit counts are exact integers, a bin's accuracy and confidence sums accumulate in row order
    (``bincount`` over segment-and-bin keys), and the mean cross-entropy and each segment's ECE sum
    are the same reductions over the same contiguous values.
    """
    logits, y = _check(logits, y)
    sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if not sizes:
        return []
    if min(sizes) == 0:
        raise ValueError("segment_metrics needs non-empty segments")
    segments = len(sizes)
    seg = torch.repeat_interleave(torch.arange(segments, device=y.device), torch.tensor(sizes, device=y.device))
    k5 = max(1, min(5, logits.shape[1]))
    hits = torch.stack(
        [
            torch.bincount(
                seg, weights=(logits.topk(k, dim=1).indices == y[:, None]).any(dim=1).double(), minlength=segments
            )
            for k in (1, k5)
        ]
    )
    conf, pred = logits.softmax(dim=1).max(dim=1)
    correct = (pred == y).double()
    edges = torch.linspace(0.0, 1.0, n_bins + 1, dtype=conf.dtype, device=conf.device)
    key = seg * n_bins + (torch.bucketize(conf, edges) - 1).clamp(0, n_bins - 1)
    size = segments * n_bins
    count = torch.bincount(key, minlength=size).double().view(segments, n_bins)
    acc_sum = torch.bincount(key, weights=correct, minlength=size).view(segments, n_bins)
    conf_sum = torch.bincount(key, weights=conf, minlength=size).view(segments, n_bins)
    nonempty = count > 0
    gap = (acc_sum - conf_sum).abs() / count  # NaN in empty bins, which are left out below
    mce = torch.where(nonempty, gap, -torch.inf).amax(dim=1)
    weighted = (gap * count)[nonempty]  # segment by segment, each segment's non-empty bins in order
    ends = nonempty.sum(dim=1).cumsum(0).tolist()
    sums = [weighted[a:b].sum() for a, b in zip([0, *ends[:-1]], ends)]
    nlls = [F.cross_entropy(logits[a:b], y[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    ece_sum, nll_mean = torch.stack(sums).tolist(), torch.stack(nlls).tolist()
    hit1, hit5 = hits.tolist()
    return [
        {
            "acc": hit1[i] / n,
            "top5": hit5[i] / n,
            "nll": nll_mean[i],
            "ece": ece_sum[i] / n,
            "mce": m,
            "n": float(n),
        }
        for i, (n, m) in enumerate(zip(sizes, mce.tolist()))
    ]
