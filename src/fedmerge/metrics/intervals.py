"""95% intervals for a paired difference between two rows of a table, and the verdict they give.

Two rows are paired by seed (a seed fixes the partition, the splits and the initial weights) and, within
a seed, by client (each client's test split is the same for both rows). Two intervals:

* ``bootstrap_interval``: a two-level bootstrap. Each resample draws the seeds with replacement, then,
  within each drawn seed, its clients with replacement; the statistic is the mean over the drawn seeds
  of the mean per-client difference. Drawing the seeds too keeps the seed-to-seed spread (training
  randomness, the partition) in the interval, which resampling clients alone would leave out; with a
  single seed it is the plain bootstrap over clients. Percentile interval.
* ``paired_t_interval``: Student's t over the per-seed differences of the rows' means, for tables whose
  clients are too few to resample (or whose metric is not a mean over clients).

``verdict``: "reproduced" where the interval lies above zero (the claimed side), "not reproduced" where
it lies below, "level" where it contains zero (an end at exactly zero included).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

REPRODUCED, LEVEL, NOT_REPRODUCED = "reproduced", "level", "not reproduced"


def paired_t_interval(diffs: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high) of the paired differences ``diffs`` (one per seed): mean ± t(n-1) · sd / sqrt(n)."""
    from scipy.stats import t

    if len(diffs) < 2:
        raise ValueError("a paired t interval needs at least 2 differences")
    values = np.asarray(diffs, dtype=np.float64)
    mean = float(values.mean())
    half = float(t.ppf(0.5 + level / 2, len(values) - 1)) * float(values.std(ddof=1)) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def bootstrap_interval(
    groups: Sequence[Sequence[float]], level: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float, float]:
    """(estimate, low, high): ``groups`` holds one list of per-client differences per seed; the estimate
    is the mean over seeds of each seed's mean difference, the interval the two-level percentile
    bootstrap's (seeds, then clients within each drawn seed). Seeded: the same input gives the same
    interval."""
    if not groups or any(len(g) == 0 for g in groups):
        raise ValueError("every seed needs at least one client difference")
    rng = np.random.default_rng(seed)
    arrays = [np.asarray(g, dtype=np.float64) for g in groups]
    k = len(arrays)
    picked = rng.integers(0, k, size=(resamples, k))  # which seed fills each of the k places
    stats = np.zeros(resamples)
    for s, values in enumerate(arrays):
        # a client resample for every place, used where seed s was drawn there (independent copies)
        means = values[rng.integers(0, len(values), size=(resamples, k, len(values)))].mean(axis=2)
        stats += np.where(picked == s, means, 0.0).sum(axis=1)
    stats /= k
    tail = (1 - level) / 2
    low, high = np.quantile(stats, [tail, 1 - tail])
    return float(np.mean([a.mean() for a in arrays])), float(low), float(high)


def verdict(low: float, high: float) -> str:
    """The claim "higher > lower", judged by the interval of higher - lower."""
    if low > 0:
        return REPRODUCED
    if high < 0:
        return NOT_REPRODUCED
    return LEVEL
