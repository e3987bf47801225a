"""The ceiling the benchmarks compare against: the plain training loop a user would write."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch.nn import functional as F

from fedmerge.core.training import batch_slices


def plain_loop(
    model: torch.nn.Module,
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
    batch_size: int,
    lr: float,
    epochs: int,
    generator: torch.Generator,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds to train ``model`` with one SGD optimizer on each part's samples in turn, in shuffled
    batches with the clients' batch boundaries (no batch spans two clients): the same samples, steps
    and batch sizes as a FedAvg round's local training, without anything federated around them."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    t0 = clock()
    for x, y in parts:
        for _ in range(epochs):
            perm = torch.randperm(len(y), generator=generator).to(x.device)  # once per epoch, as the engine does
            for sl in batch_slices(len(y), batch_size):
                idx = perm[sl]
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
    return clock() - t0
