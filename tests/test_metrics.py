"""Metrics on logits and their client summaries, checked against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedmerge.metrics import (
    calibration_errors,
    classification_metrics,
    lower_is_better,
    nll,
    summarize,
    summarize_clients,
    topk_accuracy,
)


def test_ece_mce_hand_computed() -> None:
    # Logits = log p, so the softmax gives back p exactly (rows sum to 1).
    probs = torch.tensor(
        [
            [0.90, 0.05, 0.05],  # y=0: conf .90, correct
            [0.85, 0.10, 0.05],  # y=1: conf .85, wrong
            [0.20, 0.70, 0.10],  # y=1: conf .70, correct
            [0.30, 0.65, 0.05],  # y=1: conf .65, correct
            [0.55, 0.40, 0.05],  # y=1: conf .55, wrong
            [0.45, 0.30, 0.25],  # y=0: conf .45, correct
        ],
        dtype=torch.float64,
    )
    y = torch.tensor([0, 1, 1, 1, 1, 0])
    # 5 bins (0,.2] (.2,.4] (.4,.6] (.6,.8] (.8,1]:
    #   (.8,1]: {.90 ok, .85 wrong}  acc .5, conf .875, gap .375, weight 2/6
    #   (.6,.8]: {.70 ok, .65 ok}    acc 1,  conf .675, gap .325, weight 2/6
    #   (.4,.6]: {.55 wrong, .45 ok} acc .5, conf .500, gap 0,    weight 2/6
    # ECE = (2*.375 + 2*.325 + 2*0) / 6 = 1.4/6 = 0.2333...; MCE = .375
    ece, mce = calibration_errors(probs.log(), y, n_bins=5)
    assert ece == pytest.approx(1.4 / 6, abs=1e-12)
    assert mce == pytest.approx(0.375, abs=1e-12)


def test_ece_matches_guo_loop_on_random_data() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(500, 10, generator=gen) * 3
    y = torch.randint(0, 10, (500,), generator=gen)
    conf, pred = logits.double().softmax(1).max(1)
    correct = (pred == y).double()
    edges = torch.linspace(0, 1, 16, dtype=torch.float64)
    ece, gaps = 0.0, []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        m = (conf > lo) & (conf <= hi)
        if m.any():
            gap = (correct[m].mean() - conf[m].mean()).abs().item()
            ece += m.double().mean().item() * gap
            gaps.append(gap)
    got_ece, got_mce = calibration_errors(logits, y)
    assert got_ece == pytest.approx(ece, abs=1e-12)
    assert got_mce == pytest.approx(max(gaps), abs=1e-12)


def test_confident_correct_predictions_have_zero_calibration_error() -> None:
    y = torch.tensor([0, 2, 1, 3])
    logits = 1000.0 * F.one_hot(y, 4).double()  # softmax is exactly one-hot in float64
    assert calibration_errors(logits, y) == (0.0, 0.0)


def test_topk_accuracy_rank_five_counts_rank_six_does_not() -> None:
    logits = torch.tensor([[6.0, 5.0, 4.0, 3.0, 2.0, 1.0]] * 2)
    y = torch.tensor([4, 5])  # true class ranked 5th, then 6th
    assert topk_accuracy(logits[:1], y[:1], k=5) == 1.0
    assert topk_accuracy(logits[1:], y[1:], k=5) == 0.0
    assert topk_accuracy(logits, y, k=5) == 0.5
    assert topk_accuracy(logits, y, k=1) == 0.0
    assert topk_accuracy(logits, y, k=10) == 1.0  # k clipped to the 6 classes


def test_nll_equals_cross_entropy() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 7, generator=gen)
    y = torch.randint(0, 7, (32,), generator=gen)
    assert nll(logits, y) == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-6)


def test_classification_metrics_keys_and_empty_input() -> None:
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]])
    out = classification_metrics(logits, torch.tensor([0, 1, 1]))
    assert set(out) == {"acc", "top5", "nll", "ece", "mce", "n"}
    assert out["acc"] == pytest.approx(2 / 3)
    assert out["top5"] == 1.0 and out["n"] == 3.0
    empty = classification_metrics(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long))
    assert empty["n"] == 0.0 and math.isnan(empty["acc"])


def test_summarize_known_numbers() -> None:
    s = summarize([0.9, 0.5, 0.7, 0.1], weights=[1, 1, 2, 4])
    assert s["mean"] == pytest.approx(0.55)
    assert s["weighted_mean"] == pytest.approx((0.9 + 0.5 + 1.4 + 0.4) / 8)  # 0.4
    # deviations .35 -.05 .15 -.45 -> squares sum .35 -> population variance .0875
    assert s["std"] == pytest.approx(math.sqrt(0.0875))
    assert s["worst10"] == pytest.approx(0.1)  # ceil(10% of 4) = 1 value, the lowest
    assert (s["min"], s["max"]) == (pytest.approx(0.1), pytest.approx(0.9))
    assert summarize([0.9, 0.5, 0.7, 0.1], higher_is_better=False)["worst10"] == pytest.approx(0.9)
    assert summarize([0.9, 0.5, 0.7, 0.1])["weighted_mean"] == pytest.approx(0.55)


def test_worst10_uses_integer_ceiling() -> None:
    # 10% of 30 is 3 values (float 0.1*30 would round up to 4); 10% of 11 rounds up to 2.
    assert summarize(list(range(1, 31)))["worst10"] == pytest.approx(2.0)
    assert summarize(list(range(1, 12)))["worst10"] == pytest.approx(1.5)
    assert summarize(list(range(1, 12)), higher_is_better=False)["worst10"] == pytest.approx(10.5)


def test_summarize_clients_weights_and_direction() -> None:
    per_client = {
        3: {"acc": 0.5, "nll": 1.0, "ece": 0.2, "n": 30},
        1: {"acc": 0.9, "nll": 0.2, "ece": 0.1, "n": 10},
        7: {"acc": float("nan"), "nll": float("nan"), "ece": float("nan"), "n": 0},  # no test data: skipped
    }
    out = summarize_clients(per_client)
    assert set(out) == {"acc", "nll", "ece"}
    assert out["acc"]["weighted_mean"] == pytest.approx((0.9 * 10 + 0.5 * 30) / 40)
    assert out["acc"]["worst10"] == pytest.approx(0.5)
    assert out["nll"]["worst10"] == pytest.approx(1.0)  # loss-like: the worst is the highest
    assert out["ece"]["worst10"] == pytest.approx(0.2)
    assert lower_is_better("train_loss") and lower_is_better("mce") and not lower_is_better("top5")
    unweighted = summarize_clients(per_client, weight_key=None)
    assert math.isnan(unweighted["acc"]["mean"])  # no weights: every client counts, NaN included
    with pytest.raises(KeyError):
        summarize_clients({0: {"acc": 1.0}})
