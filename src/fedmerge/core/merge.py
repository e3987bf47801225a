"""The merge math every aggregation rule shares: client tensors + statistics -> one merged tensor.

Every rule here is a *precision-weighted* mean ``(sum_i M_i)^-1 sum_i M_i t_i`` that differs only by
what the client "precision" ``M_i`` is:

===================  ======================================  ===============================
rule                 M_i                                     call
===================  ======================================  ===============================
FedAvg               n_i (a scalar)                          ``weighted_merge(ts, n)``
LIVAR, LoRA layer    alpha_i^l (a scalar per layer)          ``weighted_merge(ts, alpha)``
LIVAR, head          sigma_i^(c) (one weight per class row)  ``weighted_merge(ts, rows)``
Fisher averaging     diagonal Fisher F_i (elementwise)       ``weighted_merge(ts, fishers)``
RegMean              input Gram G_i (a matrix on the input)  ``gram_merge(ws, grams)``
FedMerge             softmax(a_i) over d stacked models      ``merging.merge`` (the batched row form)
===================  ======================================  ===============================

``weighted_merge`` with scalar weights is one row of FedMerge's ``merge(W, Theta)`` (a test checks it);
FedMerge keeps its own batched matmul because it merges many rows of a ``(d, P)`` stack at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

Weight = Tensor | float


def weighted_merge(
    tensors: Sequence[Tensor],
    weights: Sequence[Weight],
    fallback: Tensor | None = None,
    floor: float = 0.0,
) -> Tensor:
    """``sum_i w_i t_i / sum_i w_i`` with non-negative ``w_i`` broadcastable to ``t_i``.

    A weight is a scalar (FedAvg, a LoRA layer coefficient), a per-row column such as ``(C, 1)`` or
    ``(C,)`` for a ``(C,)`` bias (LIVAR's per-class head weights), or a full tensor (a diagonal Fisher).
    ``floor`` is added to every weight (Fisher merging's epsilon). Where the weights sum to zero the
    entry comes from ``fallback`` (e.g. the previous server value of a class nobody holds) or, without
    one, from the plain mean. Accumulates in float64 and returns ``tensors[0]``'s dtype.
    """
    if not tensors:
        raise ValueError("weighted_merge needs at least one tensor")
    if len(tensors) != len(weights):
        raise ValueError(f"{len(tensors)} tensors but {len(weights)} weights")
    ref = tensors[0]
    num = torch.zeros(ref.shape, dtype=torch.float64, device=ref.device)
    # each term w_i * t_i is made in one reused buffer and added in place: the same float64 operations as
    # num + w64 * t.double() (a conversion is exact, a product or sum rounds alike wherever it is written),
    # without allocating three model-sized float64 arrays per tensor (the server step's cost, issue 56)
    term = torch.empty(ref.shape, dtype=torch.float64, device=ref.device)
    # the denominator keeps the weights' own shape (a scalar for FedAvg), broadcast only when dividing
    den = torch.zeros((), dtype=torch.float64, device=ref.device)
    for t, w in zip(tensors, weights):
        if t.shape != ref.shape:
            raise ValueError(f"cannot merge tensors of shapes {tuple(ref.shape)} and {tuple(t.shape)}")
        w64 = torch.as_tensor(w, dtype=torch.float64, device=ref.device) + floor
        if bool((w64 < 0).any()):
            raise ValueError("merge weights must be non-negative")
        try:
            fits = torch.broadcast_shapes(w64.shape, ref.shape) == ref.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"a weight of shape {tuple(w64.shape)} does not broadcast to {tuple(ref.shape)}")
        num.add_(term.copy_(t).mul_(w64))
        den = den + w64
    missing = den <= 0
    out = num / torch.where(missing, torch.ones_like(den), den)
    if bool(missing.any()):
        if fallback is None:
            fallback = torch.stack([t.double() for t in tensors]).mean(0)
        out = torch.where(missing, fallback.double().to(out.device), out)
    return out.to(ref.dtype)


def scale_off_diagonal(gram: Tensor, alpha: float) -> Tensor:
    """``alpha G + (1 - alpha) diag(G)``: RegMean's shrinkage of the Gram towards its diagonal."""
    if alpha == 1.0:
        return gram
    return alpha * gram + (1.0 - alpha) * torch.diag_embed(torch.diagonal(gram, dim1=-2, dim2=-1))


def gram_merge(
    weights: Sequence[Tensor],
    grams: Sequence[Tensor],
    alpha: float = 1.0,
    coefficients: Sequence[float] | None = None,
    rtol: float = 1e-7,
) -> Tensor:
    """RegMean's closed form for a linear map ``y = W x`` (``W`` is ``(out, in)``, ``G_i`` is ``(in, in)``):

        W* = (sum_i c_i W_i G~_i) (sum_i c_i G~_i)^+,   G~_i = alpha G_i + (1 - alpha) diag(G_i)

    i.e. the ``W`` minimising ``sum_i c_i ||X_i W^T - X_i W_i^T||^2`` when ``G_i = X_i^T X_i``.
    ``coefficients`` (default 1) are per-client model weights. Solved in float64 with a pseudo-inverse
    (eigenvalues below ``rtol`` x the largest count as zero): along input directions no client's inputs
    span, where the objective says nothing, the merged map is the coefficient-weighted average of the
    ``W_i`` instead of zero (e.g. the columns of always-blank pixels keep their averaged weights).
    """
    if not weights or len(weights) != len(grams):
        raise ValueError("gram_merge needs one Gram matrix per weight matrix")
    coefficients = [1.0] * len(weights) if coefficients is None else list(coefficients)
    w0 = weights[0]
    if w0.dim() != 2:
        raise ValueError(f"gram_merge merges (out, in) matrices, got shape {tuple(w0.shape)}")
    n_in = w0.shape[1]
    lhs = torch.zeros((w0.shape[0], n_in), dtype=torch.float64, device=w0.device)
    total = torch.zeros((n_in, n_in), dtype=torch.float64, device=w0.device)
    mean = torch.zeros_like(lhs)
    for w, g, c in zip(weights, grams, coefficients):
        if g.shape != (n_in, n_in):
            raise ValueError(f"Gram of shape {tuple(g.shape)} does not match a weight with {n_in} inputs")
        g = scale_off_diagonal(g.double(), alpha) * float(c)
        lhs = lhs + w.double() @ g
        total = total + g
        mean = mean + float(c) * w.double()
    inv = torch.linalg.pinv(total, rtol=rtol, hermitian=True)
    unspanned = torch.eye(n_in, dtype=torch.float64, device=w0.device) - total @ inv
    return (lhs @ inv + (mean / sum(coefficients)) @ unspanned).to(w0.dtype)
