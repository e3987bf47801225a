"""metrics.noise: the standard error of a row's mean accuracy from its clients' test sizes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedmerge.metrics import mean_accuracy_standard_error, required_test_size


def test_standard_error_against_hand_computed_values() -> None:
    # two clients with 4 and 16 test samples at p = 0.5: sqrt(0.25/4 + 0.25/16) / 2 = sqrt(0.078125) / 2
    assert mean_accuracy_standard_error([4, 16], 0.5) == pytest.approx(0.13975424859373686, rel=1e-12)
    # weighted by samples (or one model on the pooled 20 samples): sqrt(0.25 / 20)
    assert mean_accuracy_standard_error([4, 16], 0.5, "samples") == pytest.approx(0.11180339887498948, rel=1e-12)
    # p = 0.8 over two clients of 100 (a client without test samples does not count): sqrt(2 * 0.0016) / 2
    assert mean_accuracy_standard_error([100, 0, 100], 0.8) == pytest.approx(0.028284271247461905, rel=1e-12)
    assert mean_accuracy_standard_error([7, 9], 1.0) == 0.0
    with pytest.raises(ValueError, match="no client has test samples"):
        mean_accuracy_standard_error([0, 0], 0.5)
    with pytest.raises(ValueError, match="fraction"):
        mean_accuracy_standard_error([10], 72.0)  # percent instead of a fraction


def test_standard_error_matches_simulated_binomial_test_sets() -> None:
    sizes, p = np.array([3, 5, 8, 20, 40]), 0.7
    rng = np.random.default_rng(0)
    means = (rng.binomial(sizes, p, size=(200_000, len(sizes))) / sizes).mean(axis=1)
    assert means.std() == pytest.approx(mean_accuracy_standard_error(sizes.tolist(), p), rel=0.01)


def test_required_test_size() -> None:
    assert required_test_size(50, 0.5, 0.01) == 50  # 0.25 / (50 * 1e-4), exactly
    assert required_test_size(10, 0.7, 0.02) == 53  # 0.21 / (10 * 4e-4) = 52.5
    n = required_test_size(10, 0.7, 0.01)
    assert mean_accuracy_standard_error([n] * 10, 0.7) <= 0.01 < mean_accuracy_standard_error([n - 1] * 10, 0.7)
    assert math.isclose(mean_accuracy_standard_error([210] * 10, 0.7), 0.01)
