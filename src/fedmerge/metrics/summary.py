"""Summaries of one metric across clients: mean, sample-weighted mean, spread and the worst 10%."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

_LOWER_IS_BETTER = ("nll", "loss", "ece", "mce")


def lower_is_better(metric: str) -> bool:
    """Loss-like metrics (names containing nll, loss, ece or mce) are worst when highest."""
    name = metric.lower()
    return any(part in name for part in _LOWER_IS_BETTER)


def summarize(
    values: Sequence[float], weights: Sequence[float] | None = None, higher_is_better: bool = True
) -> dict[str, float]:
    """mean, weighted_mean, std (population), worst10 (mean of the worst ceil(10%) values, >= 1), min, max."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    keys = ("mean", "weighted_mean", "std", "worst10", "min", "max")
    if v.size == 0:
        return dict.fromkeys(keys, math.nan)
    if weights is None:
        weighted = float(v.mean())
    else:
        w = np.asarray(weights, dtype=np.float64).reshape(-1)
        if w.shape != v.shape:
            raise ValueError(f"{w.size} weights for {v.size} values")
        weighted = float((w * v).sum() / w.sum()) if w.sum() > 0 else math.nan
    k = max(1, -(-v.size // 10))  # integer ceil: 0.1 * 30 is 3.0000000000000004 in floating point
    ordered = np.sort(v)
    worst = ordered[:k] if higher_is_better else ordered[-k:]
    return {
        "mean": float(v.mean()),
        "weighted_mean": weighted,
        "std": float(v.std()),
        "worst10": float(worst.mean()),
        "min": float(v.min()),
        "max": float(v.max()),
    }


def summarize_clients(
    per_client: Mapping[int, Mapping[str, float]], weight_key: str | None = "n"
) -> dict[str, dict[str, float]]:
    """Summarise every metric across clients, weighted by ``per_client[c][weight_key]``.

    Clients with weight 0 (no evaluation samples) are left out, since their metrics are undefined;
    a metric missing for a client is summarised over the clients that report it. With
    ``weight_key=None`` the weighted mean equals the plain mean.
    """
    clients = sorted(per_client)  # fixed order so float sums do not depend on dict order
    weight: dict[int, float] = {}
    for c in clients:
        if weight_key is None:
            weight[c] = 1.0
        elif weight_key not in per_client[c]:
            raise KeyError(f"client {c} has no weight {weight_key!r}")
        else:
            weight[c] = float(per_client[c][weight_key])
    names = sorted({m for c in clients for m in per_client[c] if m != weight_key})
    out: dict[str, dict[str, float]] = {}
    for name in names:
        have = [c for c in clients if name in per_client[c] and weight[c] > 0]
        out[name] = summarize(
            [float(per_client[c][name]) for c in have],
            [weight[c] for c in have],
            higher_is_better=not lower_is_better(name),
        )
    return out
