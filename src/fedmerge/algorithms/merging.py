"""Model-merging math on a ``(d, P)`` stack of flat parameters, written once for every merging method.

    theta_i = sum_j w_ij Theta_j,   w_i = softmax(a_i)                     (merge)

For a loss L = sum_i p_i l_i(theta_i) with client gradients g_i = dl_i/dtheta_i (FedMerge, App. D):

    dL/dTheta_j = sum_i p_i w_ij g_i                                      (theta_gradient)
    dL/da_ij    = p_i w_ij <Theta_j - theta_i, g_i>                       (logit_gradient)

``<theta_i, g_i> = sum_k w_ik <Theta_k, g_i>``, so the logit gradient needs only the (s, d) matrix of
inner products ``M = G @ Theta.T`` and never the merged models: one matmul over P instead of s
merges. Every function is dtype-generic (the gradient check runs them in float64) and touches only
the rows it is given (the clients selected this round).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

MAX_GRID_STEPS = 10000  # the reference loop gives up after this many increments
# Float32 products carry a relative rounding of about 1e-7 (2e-6 summed over 1e5 entries); below this
# cancellation factor that leaves at most about 1e-5 (2e-4) of the logit step to rounding. Runs with
# separately initialised models stay far below it (4-25 measured over 50-150 rounds of digits runs).
CANCELLATION_LIMIT = 100.0


def merge_weights(logits: Tensor) -> Tensor:
    """Row softmax in float64 (logits are tiny; exact weights matter for the fixed ablation and d=1)."""
    return torch.softmax(logits.double(), dim=1)


def merge(weights: Tensor, theta: Tensor, out: Tensor | None = None) -> Tensor:
    """(s, d) @ (d, P) -> (s, P): the merged model of each given row."""
    return torch.mm(weights.to(theta.dtype), theta, out=out)


def inner_products(grads: Tensor, theta: Tensor, weights: Tensor | None = None) -> Tensor:
    """M_ij = <Theta_j, g_i> over the given columns, as float64: (s, P') x (d, P') -> (s, d).

    The logit gradient needs only the centred ``M_ij - sum_k w_ik M_ik = <Theta_j - theta_i, g_i>``.
    When the d models nearly agree that difference is far smaller than M itself, and products formed
    in float32 lose it (0.5% or more of the step at a 1e-5 relative spread between the models). With
    the merge ``weights`` given, M is therefore recomputed with float64 accumulation when some row's
    centred values are more than ``CANCELLATION_LIMIT`` times smaller than its products; otherwise the
    float32 products are returned as they are (well-separated models: the step is bit for bit what it
    was before this check existed). The check reads one boolean back from the device.
    """
    # Theta @ G^T, transposed back: the (d, P) x (P, s) order is ~20% faster with CPU BLAS here.
    inner = torch.mm(theta, grads.t()).t().double()
    if weights is None or inner.shape[1] < 2 or theta.dtype == torch.float64:
        return inner
    w = weights.to(inner.dtype)
    centred = inner - (w * inner).sum(dim=1, keepdim=True)
    if bool((inner.abs().amax(dim=1) > CANCELLATION_LIMIT * centred.abs().amax(dim=1)).any()):
        return inner_products_float64(grads, theta)
    return inner


def inner_products_float64(grads: Tensor, theta: Tensor, block: int = 1 << 16) -> Tensor:
    """``inner_products`` with float64 products and sums, ``block`` columns at a time (the float64
    copies of Theta and G never exist whole)."""
    out = torch.zeros(grads.shape[0], theta.shape[0], dtype=torch.float64, device=theta.device)
    for start in range(0, theta.shape[1], block):
        cols = slice(start, start + block)
        out.addmm_(grads[:, cols].double(), theta[:, cols].double().t())
    return out


def theta_gradient(weights: Tensor, p: Tensor, grads: Tensor) -> Tensor:
    """dL/dTheta = (p * W)^T @ G, shape (d, P)."""
    coef = (p[:, None] * weights).to(grads.dtype)
    return torch.mm(coef.t(), grads)


def logit_gradient(weights: Tensor, inner: Tensor, p: Tensor | None = None) -> Tensor:
    """dL/da_ij = p_i w_ij (M_ij - sum_k w_ik M_ik); each row sums to 0 (softmax shift invariance).

    With ``p=None`` the client weights are left out (the reference normalises before applying them).
    """
    w = weights.to(inner.dtype)
    grad = w * (inner - (w * inner).sum(dim=1, keepdim=True))
    return grad if p is None else p.to(grad.dtype)[:, None] * grad


def fixed_magnitude_step(grad: Tensor, p: Tensor, lr: float, increment: float | None = None) -> Tensor:
    """The reference's logit update in closed form: returns Delta a (to add to the logits).

    The reference normalises G (no p) by its global L1 norm, then repeats ``a -= increment * p *
    G_hat`` until the largest logit change exceeds the threshold ``lr`` or the loop has run 10,000
    times. The steps are identical, so this is one step of k increments with
    k = min(floor(lr / (increment * c)) + 1, 10001), c = max_ij p_i |G_hat_ij|: the largest change
    lands just above ``lr`` whatever the gradient's scale, unless the cap binds (many clients, tiny
    normalised gradients), when it stays below. The reference hard-codes ``increment`` = 0.01;
    ``None`` takes ``increment = lr``. A zero gradient (e.g. d = 1) gives a zero step instead of the
    reference's division by zero.
    """
    pg = p.to(grad.dtype)[:, None] * grad
    total = grad.abs().sum()
    # Computed where grad lives, without reading a value back: on a GPU the host then queues the
    # server step's next products without waiting. Equal, bit for bit, to the same arithmetic on
    # Python floats (tested): k is an exact integer in float64, and the quotient a true division.
    usable = torch.isfinite(total) & (total != 0)
    pg_hat = pg / torch.where(usable, total, torch.ones_like(total))
    c = pg_hat.abs().max().double()
    inc = lr if increment is None else increment
    k = torch.clamp(torch.floor(torch.full_like(c, lr) / (inc * c)) + 1, max=MAX_GRID_STEPS + 1)
    step = (-(inc * k)).to(pg_hat.dtype) * pg_hat
    return torch.where(usable & (c > 0), step, torch.zeros_like(step))


def topk_mask(grads: Tensor, fraction: float) -> Tensor:
    """Zero all but the ``fraction`` largest-magnitude entries of each row (pruning before the
    inner product, the paper's remedy for inner products drowned by many small entries)."""
    cols = grads.shape[1]
    keep = max(1, min(cols, int(math.ceil(fraction * cols))))
    if keep == cols:
        return grads
    mag = grads.abs()
    thresh = torch.kthvalue(mag, cols - keep + 1, dim=1, keepdim=True).values
    return torch.where(mag >= thresh, grads, torch.zeros((), dtype=grads.dtype))


def column_normalized(coef: Tensor) -> Tensor:
    """omega_ij = c_ij / sum_i' c_i'j; columns with no mass (a model nobody selected uses) get 0."""
    total = coef.sum(dim=0, keepdim=True)
    return torch.where(total > 0, coef / torch.where(total > 0, total, torch.ones_like(total)), 0.0)
