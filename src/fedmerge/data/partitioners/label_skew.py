"""Label-skew partitioners: IID, Dirichlet (Hsu et al. 2019) and pathological shards (McMahan et al. 2017)."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from fedmerge.data.partitioners.base import (
    MIN_CLIENT_SAMPLES,
    PARTITIONERS,
    Partition,
    PartitionConfig,
    assemble,
    check_capacity,
    shuffle_by_proportions,
    shuffle_evenly,
)
from fedmerge.data.pool import Pool


def class_indices(pool: Pool) -> list[np.ndarray]:
    """Sample indices of every class present in the pool."""
    return [idx for c in range(pool.num_classes) if (idx := np.flatnonzero(pool.y == c)).size]


class IidConfig(PartitionConfig):
    name: Literal["iid"] = "iid"


@PARTITIONERS.register("iid", config=IidConfig, description="uniform random split into near-equal parts")
def partition_iid(cfg: IidConfig, pool: Pool, rng: np.random.Generator) -> Partition:
    check_capacity(cfg.num_clients, len(pool))
    samples, owners = shuffle_evenly(np.arange(len(pool)), cfg.num_clients, rng)
    return Partition(assemble(cfg.num_clients, [samples], [owners]))


class DirichletConfig(PartitionConfig):
    name: Literal["dirichlet"] = "dirichlet"
    alpha: float = Field(0.5, gt=0, description="concentration: small = strong label skew, large = near IID")
    min_samples: int = Field(10, ge=MIN_CLIENT_SAMPLES, description="redraw until every client has this many")
    max_tries: int = Field(1000, ge=1, description="give up after this many redraws")


@PARTITIONERS.register(
    "dirichlet",
    config=DirichletConfig,
    description="label skew: each class spread over clients by Dir(alpha)",
)
def partition_dirichlet(cfg: DirichletConfig, pool: Pool, rng: np.random.Generator) -> Partition:
    k = cfg.num_clients
    check_capacity(k, len(pool), cfg.min_samples)
    classes = class_indices(pool)
    for _ in range(cfg.max_tries):
        samples, owners = [], []
        for idx in classes:
            shuffled, client = shuffle_by_proportions(idx, rng.dirichlet(np.full(k, cfg.alpha)), rng)
            samples.append(shuffled)
            owners.append(client)
        if np.bincount(np.concatenate(owners), minlength=k).min() >= cfg.min_samples:
            return Partition(assemble(k, samples, owners))
    raise ValueError(
        f"partition.num_clients: after {cfg.max_tries} Dirichlet draws (alpha={cfg.alpha}) some of the {k} "
        f"clients still had fewer than min_samples={cfg.min_samples} samples; use fewer clients, a larger "
        "alpha or a smaller partition.min_samples"
    )


class ShardsConfig(PartitionConfig):
    name: Literal["shards"] = "shards"
    classes_per_client: int = Field(2, ge=1, description="classes (shards) each client holds")


def assign_classes(num_clients: int, classes: np.ndarray, per_client: int, rng: np.random.Generator) -> np.ndarray:
    """Give each client ``per_client`` distinct classes (a row, ascending), least-used classes first
    (random tie-break), so that class usage counts differ by at most one while the combinations stay
    random."""
    # one draw for all clients: the same numbers as one draw of len(classes) per client, in order
    ties = 0.5 * rng.random((num_clients, len(classes)))
    usage = np.zeros(len(classes))
    picks = np.empty((num_clients, per_client), dtype=np.int64)
    for client in range(num_clients):  # sequential: each pick depends on the usage so far
        pick = np.argsort(usage + ties[client])[:per_client]
        usage[pick] += 1
        picks[client] = pick
    return np.sort(classes[picks], axis=1)


@PARTITIONERS.register(
    "shards",
    config=ShardsConfig,
    description="pathological: every client holds exactly classes_per_client classes",
)
def partition_shards(cfg: ShardsConfig, pool: Pool, rng: np.random.Generator) -> Partition:
    check_capacity(cfg.num_clients, len(pool))
    present = np.unique(pool.y)
    if cfg.classes_per_client > len(present):
        raise ValueError(
            f"partition.classes_per_client: {cfg.classes_per_client} exceeds the {len(present)} classes "
            f"of dataset {pool.name!r}"
        )
    owned = assign_classes(cfg.num_clients, present, cfg.classes_per_client, rng)
    samples, owners = [], []
    for c in present:
        holders = np.flatnonzero((owned == c).any(axis=1))
        if not holders.size:
            continue  # fewer clients than classes: a class nobody was given stays out
        idx = np.flatnonzero(pool.y == c)
        if len(idx) < len(holders):
            raise ValueError(
                f"partition.num_clients: class {c} has {len(idx)} samples but would be shared by "
                f"{len(holders)} clients; use fewer clients or a smaller classes_per_client"
            )
        shuffled, piece = shuffle_evenly(idx, len(holders), rng)
        samples.append(shuffled)
        owners.append(holders[piece])
    return Partition(assemble(cfg.num_clients, samples, owners))
