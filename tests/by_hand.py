"""Hand formulas for the tests' tiny linear classifier (``MLPConfig(hidden=())``: logits = x W^T + b), written
out without autograd or the library, so a test compares the code under test with an independent value."""

from __future__ import annotations

import torch


def softmax_rows(z: torch.Tensor) -> torch.Tensor:
    e = torch.exp(z - z.max(dim=1, keepdim=True).values)
    return e / e.sum(dim=1, keepdim=True)


def ce_gradient(
    weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """d/dW and d/db of the mean cross-entropy of logits x W^T + b: dz = (softmax(z) - onehot(y)) / n,
    dW = dz^T x, db = sum of dz over the rows (float64)."""
    x, weight, bias = x.double(), weight.double(), bias.double()
    z = x @ weight.T + bias
    dz = softmax_rows(z)
    dz[torch.arange(len(y)), y] -= 1.0
    dz /= len(y)
    return dz.T @ x, dz.sum(dim=0)


def ce_loss(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
    z = x.double() @ weight.double().T + bias.double()
    p = softmax_rows(z)
    return float(-torch.log(p[torch.arange(len(y)), y]).mean())
