"""Clients that never train (``split.unseen_clients``): which ones, and where they go in the client list.

They are drawn from the seed alone (not the method), so every method of an experiment leaves out the same
clients. The federated dataset puts them after the participants: participants keep ids ``0..S-1`` in their
partition order, newcomers take ``S..S+U-1``, so a method built for ``S`` clients never sees a newcomer's id.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from fedmerge.core.seeding import numpy_rng

T = TypeVar("T")


def unseen_count(num_clients: int, spec: float) -> int:
    """How many of ``num_clients`` clients ``spec`` (a fraction below 1, or a count) leaves out of training."""
    if spec == 0:
        return 0
    count = int(round(spec * num_clients)) if spec < 1 else int(spec)
    count = max(1, count)
    if count >= num_clients:
        raise ValueError(
            f"split.unseen_clients={spec:g} leaves {count} of {num_clients} clients out of training; "
            "at least one must train"
        )
    return count


def unseen_ids(num_clients: int, spec: float, seed: int) -> list[int]:
    """The partition indices of the clients that never train, sorted (a seeded draw keyed by the seed only)."""
    count = unseen_count(num_clients, spec)
    if count == 0:
        return []
    chosen = numpy_rng(seed, purpose="unseen-clients").choice(num_clients, size=count, replace=False)
    return sorted(int(c) for c in chosen)


def seen_first(items: Sequence[T], unseen: Sequence[int]) -> list[T]:
    """``items`` (one per partition index) reordered: participants in their order, then the unseen ones."""
    left_out = set(unseen)
    return [x for i, x in enumerate(items) if i not in left_out] + [items[i] for i in sorted(left_out)]
