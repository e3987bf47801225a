"""The shared merge function (fedmerge.core.merge) that FedAvg, LIVAR, Fisher and RegMean call."""

from __future__ import annotations

import pytest
import torch

from fedmerge.algorithms.merging import merge, merge_weights
from fedmerge.core.merge import gram_merge, scale_off_diagonal, weighted_merge
from fedmerge.core.params import weighted_average


def test_scalar_weights_are_one_row_of_fedmerges_merge():
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(4, 50, generator=gen, dtype=torch.float64)
    logits = torch.randn(1, 4, generator=gen)
    w = merge_weights(logits)
    rows = merge(w, theta)
    ours = weighted_merge(list(theta), w[0].tolist())
    assert torch.allclose(ours, rows[0], atol=1e-12)


def test_fedavg_average_goes_through_it_with_sample_counts():
    a, b = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}, {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(5)}
    avg = weighted_average([a, b], [1, 3])
    assert torch.allclose(avg["w"], torch.tensor([2.5, 5.0]))
    assert avg["n"].dtype == torch.int64 and int(avg["n"]) == 4  # integer counters are rounded


def test_per_row_weights_with_fallback_and_elementwise_weights():
    t0, t1 = torch.ones(3, 2), 3 * torch.ones(3, 2)
    prev = torch.full((3, 2), -1.0)
    rows = weighted_merge([t0, t1], [torch.tensor([[1.0], [0.0], [0.0]]), torch.tensor([[1.0], [2.0], [0.0]])], prev)
    assert torch.equal(rows, torch.tensor([[2.0, 2.0], [3.0, 3.0], [-1.0, -1.0]]))
    elem = weighted_merge([t0, t1], [torch.tensor([[1.0, 0.0]] * 3), torch.tensor([[1.0, 1.0]] * 3)])
    assert torch.equal(elem[:, 0], torch.full((3,), 2.0)) and torch.equal(elem[:, 1], torch.full((3,), 3.0))
    # no weight anywhere and no fallback: the plain mean; a floor makes zero weights count equally
    assert torch.equal(weighted_merge([t0, t1], [0.0, 0.0]), 2 * torch.ones(3, 2))
    assert torch.allclose(weighted_merge([t0, t1], [0.0, 1e-12], floor=1.0), 2 * torch.ones(3, 2))


def test_bad_weights_are_refused():
    t = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="non-negative"):
        weighted_merge([t, t], [1.0, -1.0])
    with pytest.raises(ValueError, match="does not broadcast"):
        weighted_merge([t, t], [torch.ones(3, 3), torch.ones(3, 3)])
    with pytest.raises(ValueError, match="shapes"):
        weighted_merge([t, torch.zeros(2, 3)], [1.0, 1.0])
    with pytest.raises(ValueError, match="2 tensors but 1 weights"):
        weighted_merge([t, t], [1.0])


def test_gram_merge_shrinks_off_diagonals_and_matches_the_least_squares_solution():
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(20, 4, generator=gen, dtype=torch.float64) for _ in range(2)]
    ws = [torch.randn(3, 4, generator=gen, dtype=torch.float64) for _ in range(2)]
    merged = gram_merge(ws, [x.T @ x for x in xs])
    # argmin_W sum_i ||X_i W^T - X_i W_i^T||^2 by ordinary least squares on the stacked problem
    x = torch.cat(xs)
    y = torch.cat([xi @ wi.T for xi, wi in zip(xs, ws)])
    lstsq = torch.linalg.lstsq(x, y).solution.T
    assert torch.allclose(merged, lstsq, atol=1e-10)
    g = torch.tensor([[2.0, 1.0], [1.0, 4.0]])
    assert torch.equal(scale_off_diagonal(g, 0.5), torch.tensor([[2.0, 0.5], [0.5, 4.0]]))
    # alpha = 0 keeps only the diagonals: an elementwise, per-input-column weighted mean
    d = gram_merge([torch.ones(1, 2), 3 * torch.ones(1, 2)], [g, 3 * g], alpha=0.0)
    assert torch.allclose(d, torch.full((1, 2), 2.5))


def test_gram_merge_keeps_the_average_along_directions_no_client_spans():
    w1, w2 = torch.tensor([[1.0, 2.0, 5.0]]), torch.tensor([[3.0, 4.0, 7.0]])
    g1 = torch.diag(torch.tensor([1.0, 0.0, 0.0]))  # client 1 only sees input 0, client 2 only input 1
    g2 = torch.diag(torch.tensor([0.0, 1.0, 0.0]))
    merged = gram_merge([w1, w2], [g1, g2])
    assert torch.allclose(merged, torch.tensor([[1.0, 4.0, 6.0]]))  # input 2: nobody, the average


def test_gram_merge_without_shrinkage_inflates_weights_along_rare_input_directions():
    # Why RegMean needs alpha < 1 on correlated features (docs: the LIVAR beta 0.2 study): both clients'
    # inputs lie along (1, 1) up to +-1e-3 on (1, -1), and their layers differ by 0.1. alpha = 1 fits
    # both clients exactly by a weight of size ~1/1e-3 on the rare direction; the off-diagonal shrinkage
    # adds (1 - alpha) diag(G), a ridge as large as the common direction, and keeps W near the clients'.
    r = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64) / 2**0.5
    xs = [torch.tensor([[1.0, 0.0], [1.0, s * 1e-3]], dtype=torch.float64) @ r for s in (1, -1)]
    ws = [torch.tensor([[1.0, 0.0]], dtype=torch.float64) @ r, torch.tensor([[1.1, 0.0]], dtype=torch.float64) @ r]
    grams = [x.T @ x for x in xs]
    exact = gram_merge(ws, grams)
    x, y = torch.cat(xs), torch.cat([xi @ wi.T for xi, wi in zip(xs, ws)])
    torch.testing.assert_close(exact, torch.linalg.lstsq(x, y).solution.T)  # the least-squares solution
    assert float(exact.norm()) > 40  # 1.05 along (1, 1), -50 along (1, -1); the clients' are 1.0 and 1.1
    for alpha in (0.9, 0.5):
        shrunk = gram_merge(ws, grams, alpha=alpha)
        assert float(shrunk.norm()) < 1.1
        torch.testing.assert_close(shrunk @ r.T[:, :1], torch.tensor([[1.05]], dtype=torch.float64), atol=1e-3, rtol=0)


@pytest.mark.parametrize("weight_shape", [(), (7, 1), (7, 5)], ids=["scalar", "per-row", "elementwise"])
def test_the_merge_is_the_plain_float64_sum_bit_for_bit(weight_shape):
    # the sum written out as the server step wrote it before issue 56 (a new array per term): the same bits
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(7, 5, generator=gen) * 10.0 ** float(i - 2) for i in range(6)]
    weights = [torch.rand(weight_shape, generator=gen, dtype=torch.float64) for _ in tensors]
    num = torch.zeros(7, 5, dtype=torch.float64)
    den = torch.zeros((), dtype=torch.float64)
    for t, w in zip(tensors, weights):
        num = num + w * t.double()
        den = den + w
    want = (num / den).to(torch.float32)
    got = weighted_merge(tensors, weights)
    assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), want.view(torch.int32))
