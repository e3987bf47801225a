"""Clients as index views into one pooled tensor: a population's data costs the pool plus a few
integers per client, not one set of tensors per client.

``PooledClients`` is a sequence of `ClientData`: ``clients[cid]`` gathers that client's rows
from the pool when it is asked for (a client's work, once per round), so nothing per client is held
but its slice of one flat index array. Several clients may index the same pool rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .federated import ClientData


@dataclass(frozen=True)
class PooledClients(Sequence):
    """Client ``cid``'s samples are ``x[rows[bounds[cid, 0]:bounds[cid, 3]]]``: its train split up to
    ``bounds[cid, 1]``, validation up to ``bounds[cid, 2]``, then test. ``labels`` are per entry of
    ``rows`` (a client's own, possibly noisy, labels), ``groups`` one per client or None."""

    x: torch.Tensor
    rows: torch.Tensor  # int64, client-major
    labels: torch.Tensor  # int64, one per entry of rows
    bounds: np.ndarray  # (num_clients, 4) int64 offsets into rows
    groups: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.bounds.ndim != 2 or self.bounds.shape[1] != 4:
            raise ValueError(f"bounds must be (num_clients, 4), got {self.bounds.shape}")
        if len(self.rows) != len(self.labels) or (len(self.bounds) and self.bounds[-1, 3] != len(self.rows)):
            raise ValueError("rows, labels and the last bound must have the same length")

    def __len__(self) -> int:
        return len(self.bounds)

    def __getitem__(self, cid: int) -> ClientData:  # type: ignore[override]
        if not -len(self) <= cid < len(self):
            raise IndexError(f"client {cid} out of range for {len(self)} clients")
        cid = int(cid) % len(self)
        start, val, test, end = (int(b) for b in self.bounds[cid])
        x = self.x[self.rows[start:end]]  # one gather; the splits below are views of it
        y = self.labels[start:end]
        a, b = val - start, test - start
        return ClientData(
            cid=cid,
            x_train=x[:a],
            y_train=y[:a],
            x_val=x[a:b],
            y_val=y[a:b],
            x_test=x[b:],
            y_test=y[b:],
            group=None if self.groups is None else int(self.groups[cid]),
        )

    def __iter__(self) -> Iterator[ClientData]:
        return (self[cid] for cid in range(len(self)))

    def to(self, device: torch.device | str) -> PooledClients:
        """The same views over a pool moved once (not once per client)."""
        return PooledClients(self.x.to(device), self.rows.to(device), self.labels.to(device), self.bounds, self.groups)

    def group_list(self) -> list[int | None]:
        return [None] * len(self) if self.groups is None else [int(g) for g in self.groups]

    def has_test(self) -> bool:
        return bool((self.bounds[:, 3] > self.bounds[:, 2]).any())
