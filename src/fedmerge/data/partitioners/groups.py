"""Partitioners with ground-truth client groups: cluster (FedMerge's cluster non-IID), domain, natural."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from fedmerge.core.registry import ComponentConfig
from fedmerge.data.partitioners.base import (
    PARTITIONERS,
    Partition,
    PartitionConfig,
    assemble,
    check_capacity,
    check_groups,
    group_sizes_equal,
    shuffle_by_proportions,
    shuffle_evenly,
    split_evenly,
)
from fedmerge.data.pool import Pool


class ClusterConfig(PartitionConfig):
    name: Literal["cluster"] = "cluster"
    num_groups: int = Field(5, ge=1, description="groups of clients, each with its own classes")
    classes_per_group: int | None = Field(None, ge=1, description="default: num_classes // num_groups")
    group_sizes: Literal["equal", "random"] = Field("equal", description="clients per group: equal, or drawn at random")
    within_group_alpha: float = Field(10.0, gt=0, description="Dirichlet concentration inside a group")


def group_classes(num_groups: int, per_group: int, num_classes: int) -> list[list[int]]:
    """Consecutive blocks of classes, wrapping around: disjoint when they fit, otherwise every class is
    shared by the same number of groups (give or take one)."""
    return [[(g * per_group + j) % num_classes for j in range(per_group)] for g in range(num_groups)]


def client_groups(num_clients: int, num_groups: int, mode: str, rng: np.random.Generator) -> np.ndarray:
    """Group of each client; clients of one group are consecutive ids."""
    if mode == "equal":
        sizes = group_sizes_equal(num_clients, num_groups)
    else:
        sizes = 1 + rng.multinomial(num_clients - num_groups, np.full(num_groups, 1 / num_groups))
    return np.repeat(np.arange(num_groups), sizes)


@PARTITIONERS.register(
    "cluster",
    config=ClusterConfig,
    description="client groups, each owning its own set of classes (FedMerge)",
)
def partition_cluster(cfg: ClusterConfig, pool: Pool, rng: np.random.Generator) -> Partition:
    check_capacity(cfg.num_clients, len(pool))
    check_groups(cfg.num_clients, cfg.num_groups)
    num_classes = pool.num_classes
    per_group = cfg.classes_per_group or max(1, num_classes // cfg.num_groups)
    if per_group > num_classes:
        raise ValueError(f"partition.classes_per_group: {per_group} exceeds the {num_classes} classes of {pool.name!r}")
    owned = group_classes(cfg.num_groups, per_group, num_classes)
    groups = client_groups(cfg.num_clients, cfg.num_groups, cfg.group_sizes, rng)
    members = [np.flatnonzero(groups == g) for g in range(cfg.num_groups)]
    samples, holders = [], []
    for c in range(num_classes):
        owners = [g for g in range(cfg.num_groups) if c in owned[g]]
        if not owners:
            continue  # classes left over when the groups' blocks do not cover all classes
        for g, share in zip(owners, split_evenly(np.flatnonzero(pool.y == c), len(owners), rng), strict=True):
            weights = rng.dirichlet(np.full(len(members[g]), cfg.within_group_alpha))
            shuffled, piece = shuffle_by_proportions(share, weights, rng)
            samples.append(shuffled)
            holders.append(members[g][piece])
    return Partition(assemble(cfg.num_clients, samples, holders), groups=groups.tolist())


class DomainConfig(PartitionConfig):
    name: Literal["domain"] = "domain"
    by: Literal["source", "rotation"] = Field(
        "source",
        description="source: one group per pool domain; rotation: group g rotated by g*360/num_groups",
    )
    num_groups: int | None = Field(None, ge=1, description="default: number of domains (source) or 4 (rotation)")


@PARTITIONERS.register(
    "domain",
    config=DomainConfig,
    description="feature skew: client groups see different domains or rotations",
)
def partition_domain(cfg: DomainConfig, pool: Pool, rng: np.random.Generator) -> Partition:
    check_capacity(cfg.num_clients, len(pool))
    if cfg.by == "rotation":
        return rotation_partition(cfg, pool, rng)
    if pool.domain is None:
        raise ValueError(
            f"partition.by: dataset {pool.name!r} has no domains; use a multi-domain dataset such as "
            "digits_domains, or by: rotation"
        )
    domains = np.unique(pool.domain)
    if cfg.num_groups is not None and cfg.num_groups != len(domains):
        raise ValueError(
            f"partition.num_groups: dataset {pool.name!r} has {len(domains)} domains, got num_groups={cfg.num_groups}"
        )
    check_groups(cfg.num_clients, len(domains))
    groups = np.repeat(np.arange(len(domains)), group_sizes_equal(cfg.num_clients, len(domains)))
    samples, owners = [], []
    first = np.searchsorted(groups, np.arange(len(domains)))  # the group's clients are consecutive ids
    for g, d in enumerate(domains):
        shuffled, piece = shuffle_evenly(np.flatnonzero(pool.domain == d), int((groups == g).sum()), rng)
        samples.append(shuffled)
        owners.append(first[g] + piece)
    return Partition(assemble(cfg.num_clients, samples, owners), groups=groups.tolist())


def rotation_partition(cfg: DomainConfig, pool: Pool, rng: np.random.Generator) -> Partition:
    if not pool.is_image:
        raise ValueError(f"partition.by: rotation needs image data, but {pool.name!r} has x of shape {pool.x.shape}")
    num_groups = cfg.num_groups or 4
    check_groups(cfg.num_clients, num_groups)
    angles = [g * 360.0 / num_groups for g in range(num_groups)]
    height, width = pool.x.shape[-2:]
    if height != width and any(a % 180 for a in angles):
        raise ValueError(f"partition.by: rotation of non-square {height}x{width} images would change their shape")
    groups = np.repeat(np.arange(num_groups), group_sizes_equal(cfg.num_clients, num_groups))
    samples, owners = shuffle_evenly(np.arange(len(pool)), cfg.num_clients, rng)
    indices = assemble(cfg.num_clients, [samples], [owners])
    return Partition(indices, groups=groups.tolist(), rotations=[angles[g] for g in groups])


class NaturalConfig(ComponentConfig):
    name: Literal["natural"] = "natural"
    num_clients: int | None = Field(None, ge=1, description="optional; must equal the number of client ids")


@PARTITIONERS.register(
    "natural", config=NaturalConfig, description="one client per client id of the data (e.g. writer, user)"
)
def partition_natural(cfg: NaturalConfig, pool: Pool, rng: np.random.Generator) -> Partition:
    if pool.natural_id is None:
        raise ValueError(
            f"partition.name: natural needs per-sample client ids, which dataset {pool.name!r} lacks "
            "(give npz a client_id array or csv a client_column)"
        )
    ids = np.unique(pool.natural_id)
    if cfg.num_clients is not None and cfg.num_clients != len(ids):
        raise ValueError(
            f"partition.num_clients: dataset {pool.name!r} has {len(ids)} client ids, got num_clients={cfg.num_clients}"
        )
    # one stable sort instead of a scan of the pool per id: each client's indices stay ascending
    order = np.argsort(pool.natural_id, kind="stable")
    starts = np.flatnonzero(np.asarray(pool.natural_id)[order][1:] != np.asarray(pool.natural_id)[order][:-1]) + 1
    return Partition(np.split(order.astype(np.int64), starts))
