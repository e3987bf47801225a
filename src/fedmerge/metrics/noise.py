"""The noise floor of a reported accuracy: how much of a row's mean is test-sampling noise alone.

Each client's test accuracy is a binomial proportion over its ``n`` test samples. A row reports the
plain mean of its clients' accuracies (``mean``), or a sample-weighted one (``weighted_mean``, and the
server model on the pooled test split: one binomial over every test sample). With ``p`` the row's observed
accuracy as every client's success rate:

* mean of ``K`` clients: ``SE = sqrt(sum_k p (1 - p) / n_k) / K``
* sample-weighted mean, or pooled: ``SE = sqrt(p (1 - p) / sum_k n_k)``

This is the spread a row would show from resampling the test sets alone (fixed models); differences
between rows smaller than about twice it cannot be told apart on one seed. Clients' test sets must be
disjoint for the clients' errors to be independent (``split.test_per_client`` draws them so).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

Weighting = Literal["clients", "samples"]


def mean_accuracy_standard_error(test_sizes: Sequence[int], accuracy: float, weighting: Weighting = "clients") -> float:
    """Standard error of a row's mean accuracy (a fraction in [0, 1], as is the result) from the test-set
    sizes of its clients alone: binomial, with the row's observed ``accuracy`` as every client's ``p``.
    ``weighting``: ``clients`` for the plain mean over clients, ``samples`` for a sample-weighted mean or
    one model on the pooled test split. Clients without test samples are left out, as in the summaries."""
    if not 0.0 <= accuracy <= 1.0:
        raise ValueError(f"accuracy must be a fraction in [0, 1], got {accuracy}")
    sizes = [int(n) for n in test_sizes if n > 0]
    if not sizes:
        raise ValueError("no client has test samples")
    variance = accuracy * (1.0 - accuracy)
    if weighting == "samples":
        return math.sqrt(variance / sum(sizes))
    return math.sqrt(sum(variance / n for n in sizes)) / len(sizes)


def required_test_size(num_clients: int, accuracy: float, target: float) -> int:
    """The smallest equal test size per client at which the mean over ``num_clients`` clients of
    accuracy ``accuracy`` has a standard error of at most ``target`` (both fractions)."""
    if num_clients < 1 or target <= 0:
        raise ValueError("num_clients must be >= 1 and target > 0")
    # less a hair: 0.25 / (50 * 0.01**2) is 50.000000000000014 in floating point, and 50 samples suffice
    return max(1, math.ceil(accuracy * (1.0 - accuracy) / (num_clients * target**2) - 1e-9))
