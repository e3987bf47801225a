"""The Partition result, the partitioner registry and splitting helpers shared by the partitioners."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from pydantic import Field

from fedmerge.core.registry import ComponentConfig, Registry
from fedmerge.data.pool import Pool

# Each client needs one sample for each of train, val and test.
MIN_CLIENT_SAMPLES = 3


@dataclass
class Partition:
    """Which pool samples each client holds.

    ``groups`` is the ground-truth cluster/domain of each client, when the partition defines one;
    ``rotations`` (degrees per client) is applied to the clients' images when the dataset is built.
    """

    indices: list[np.ndarray]
    groups: list[int] | None = None
    rotations: list[float] | None = None

    @property
    def num_clients(self) -> int:
        return len(self.indices)

    def validate(self, pool_size: int) -> None:
        """Every index valid and used at most once; each client large enough to split."""
        for field in ("groups", "rotations"):
            values = getattr(self, field)
            if values is not None and len(values) != self.num_clients:
                raise ValueError(f"partition has {self.num_clients} clients but {len(values)} {field}")
        sizes = np.fromiter((len(idx) for idx in self.indices), dtype=np.int64, count=self.num_clients)
        if sizes.size and sizes.min() < MIN_CLIENT_SAMPLES:
            cid = int(np.flatnonzero(sizes < MIN_CLIENT_SAMPLES)[0])
            raise ValueError(
                f"partition.num_clients: client {cid} received only {sizes[cid]} sample(s), but every "
                f"client needs at least {MIN_CLIENT_SAMPLES} (train/val/test); "
                "use fewer clients or more data"
            )
        every = np.concatenate(self.indices) if self.indices else np.empty(0, dtype=np.int64)
        if every.size and (every.min() < 0 or every.max() >= pool_size):
            raise ValueError(f"partition refers to samples outside the pool of {pool_size}")
        if np.bincount(every, minlength=pool_size).max(initial=0) > 1:
            raise ValueError("partition assigns some sample to more than one client")


class PartitionConfig(ComponentConfig):
    """Options every partitioner (except ``natural``) accepts."""

    num_clients: int = Field(10, ge=1, description="how many clients the data is split among")


Partitioner = Callable[[ComponentConfig, Pool, np.random.Generator], Partition]
PARTITIONERS: Registry[Partitioner] = Registry("partitioner")


def check_capacity(num_clients: int, num_samples: int, per_client: int = MIN_CLIENT_SAMPLES) -> None:
    """Fail early, naming the config key, when the clients cannot all get enough samples."""
    if num_clients * per_client > num_samples:
        raise ValueError(
            f"partition.num_clients: {num_clients} clients need at least {per_client} samples each "
            f"({num_clients * per_client}), but the dataset has only {num_samples}; "
            "use fewer clients or more data"
        )


def split_evenly(idx: np.ndarray, parts: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle, then cut into ``parts`` pieces whose sizes differ by at most one."""
    return np.array_split(rng.permutation(idx), parts)


def even_pieces(n: int, parts: int) -> np.ndarray:
    """Piece number of each of ``n`` positions cut as ``np.array_split(..., parts)`` cuts them."""
    size, extra = divmod(n, parts)
    return np.repeat(np.arange(parts), np.full(parts, size) + (np.arange(parts) < extra))


def shuffle_evenly(idx: np.ndarray, parts: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """[`split_evenly()`][fedmerge.data.partitioners.base.split_evenly] without the list of arrays: the shuffled
    ``idx`` and each one's piece number
    (the same random draws, so the same pieces)."""
    return rng.permutation(idx), even_pieces(len(idx), parts)


def shuffle_by_proportions(
    idx: np.ndarray, proportions: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Shuffle, then cut into pieces of (rounded) the given proportions: the shuffled ``idx`` and the
    piece number of each (piece j is ``shuffled[cut[j-1]:cut[j]]``)."""
    cuts = (np.cumsum(proportions)[:-1] * len(idx)).astype(np.int64)
    return rng.permutation(idx), np.searchsorted(cuts, np.arange(len(idx)), side="right")


def assemble(num_clients: int, samples: list[np.ndarray], owners: list[np.ndarray]) -> list[np.ndarray]:
    """Each client's sample indices, ascending: ``owners[i][j]`` holds ``samples[i][j]``. One sort of all
    samples; the clients' arrays are views into one array, not one Python step per client and piece."""
    every = np.concatenate(samples).astype(np.int64) if samples else np.empty(0, np.int64)
    client = np.concatenate(owners).astype(np.int64) if owners else np.empty(0, np.int64)
    # sort by (client, sample) through one int64 key: samples are distinct, so the key is too
    span = int(every.max()) + 1 if every.size else 1
    every = np.sort(client * span + every) % span
    return np.split(every, np.cumsum(np.bincount(client, minlength=num_clients))[:-1])


def group_sizes_equal(num_clients: int, num_groups: int) -> np.ndarray:
    return np.array([len(a) for a in np.array_split(np.arange(num_clients), num_groups)], dtype=np.int64)


def check_groups(num_clients: int, num_groups: int) -> None:
    if num_clients < num_groups:
        raise ValueError(
            f"partition.num_clients: {num_clients} clients cannot fill {num_groups} groups; "
            "use at least one client per group"
        )
