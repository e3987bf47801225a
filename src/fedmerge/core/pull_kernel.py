"""One pass for a proximal pull's gradient on the CPU: ``g += c * (w - a)``, element by element.

PyTorch has no single op with these roundings: three in-place ops (a difference, a product, a sum) read
and write the parameters' size three times, and its fused ops (``addcmul_``, ``add_(alpha=)``) round the
product and the sum once, as one FMA, which changes the floats. A loop compiled by numba (without
``fastmath``, so LLVM does not contract the multiply and the add) rounds as the three ops do, in one pass.

numba is a dependency; without it (an install that left it out), or for tensors it cannot take (not on
the CPU, not contiguous, not float32/float64), [`pull_kernel`][fedmerge.core.pull_kernel.pull_kernel]
returns ``None`` and the caller keeps the three ops (on a GPU they are three kernels at its memory's
speed). Compiled once per process on first use, cached on disk where numba can write.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cache

import numpy as np
import torch

DISABLE_ENV = "FEDMERGE_PULL_KERNEL"  # "0": always the three PyTorch ops (a check, or a numba that misbehaves)
KERNEL_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}

Kernel = Callable[[np.ndarray, np.ndarray, np.ndarray, np.floating], None]


def _pull_loop(g: np.ndarray, w: np.ndarray, a: np.ndarray, c: np.floating) -> None:  # compiled by numba
    for i in range(g.size):
        g[i] = g[i] + c * (w[i] - a[i])


@cache
def _compiled() -> Kernel | None:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    try:
        import numba
    except ImportError:
        return None
    options = {"fastmath": False, "boundscheck": False, "nogil": True}
    try:
        return numba.njit(cache=True, **options)(_pull_loop)
    except RuntimeError:  # no writable cache directory: compile in memory, once per process
        return numba.njit(cache=False, **options)(_pull_loop)


def pull_kernel(*tensors: torch.Tensor) -> Kernel | None:
    """The compiled ``g += c (w - a)`` if every tensor can go through it (CPU, contiguous, one kernel dtype)."""
    first = tensors[0]
    if first.dtype not in KERNEL_DTYPES:
        return None
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != first.dtype or not t.is_contiguous() or t.shape != first.shape:
            return None
    return _compiled()


def add_pull(kernel: Kernel, grad: torch.Tensor, weight: torch.Tensor, anchor: torch.Tensor, coeff: float) -> None:
    """``grad += coeff * (weight - anchor)`` in place, through ``kernel``
    (see [`pull_kernel`][fedmerge.core.pull_kernel.pull_kernel])."""
    kernel(
        grad.detach().view(-1).numpy(),
        weight.detach().view(-1).numpy(),
        anchor.detach().view(-1).numpy(),
        KERNEL_DTYPES[grad.dtype](coeff),  # the product in the tensors' dtype: a float64 scalar would widen it
    )
