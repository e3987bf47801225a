"""Large populations: the vectorised partitioners give the partitions of the per-client implementation
(the digests below were computed with it, before vectorising) and keep their promises at 10,000 clients."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from fedmerge.core.seeding import numpy_rng
from fedmerge.data import PARTITIONERS, Pool, SplitConfig
from fedmerge.data.partitioners.base import MIN_CLIENT_SAMPLES
from fedmerge.data.split import split_indices


def synthetic(n: int, classes: int, seed: int, natural_ids: int = 30) -> Pool:
    rng = np.random.default_rng(seed)
    return Pool(
        x=np.zeros((n, 1), np.float32),
        y=rng.integers(0, classes, n),
        num_classes=classes,
        name="synthetic",
        natural_id=rng.integers(0, natural_ids, n),
        domain=rng.integers(0, 3, n),
    )


def build(pool: Pool, seed: int = 0, **cfg):
    config = PARTITIONERS.parse(cfg)
    part = PARTITIONERS.get(config.name).obj(config, pool, numpy_rng(seed, purpose="partition"))
    part.validate(len(pool))
    return part


def digest(part) -> str:
    h = hashlib.sha256()
    for idx in part.indices:
        h.update(np.asarray(idx, np.int64).tobytes())
        h.update(b"|")
    h.update(json.dumps(part.groups).encode())
    return h.hexdigest()[:16]


@pytest.mark.parametrize(
    ("cfg", "n", "classes", "seed", "expected"),
    [
        ({"name": "iid", "num_clients": 37}, 2000, 10, 0, "9f5c1ef0dc576452"),
        ({"name": "dirichlet", "num_clients": 40, "alpha": 0.3}, 3000, 10, 0, "05330f0ed71d0e9e"),
        ({"name": "dirichlet", "num_clients": 25, "alpha": 0.1, "min_samples": 5}, 2000, 7, 0, "331f4aae1d05e7e1"),
        ({"name": "shards", "num_clients": 45, "classes_per_client": 2}, 2000, 10, 0, "6e1faf44ec91dba3"),
        ({"name": "shards", "num_clients": 30, "classes_per_client": 3}, 2000, 8, 0, "11e24e2f2d042b71"),
        ({"name": "cluster", "num_clients": 33, "num_groups": 4}, 3000, 10, 0, "89eb5580b662bf8b"),
        (
            {"name": "cluster", "num_clients": 20, "num_groups": 3, "group_sizes": "random", "classes_per_group": 5},
            2000,
            10,
            0,
            "3d7ac3bbeb548ef7",
        ),
        ({"name": "domain", "num_clients": 12}, 1500, 10, 0, "41589541960d19ec"),
        ({"name": "natural"}, 1500, 10, 0, "e3ddfdeb3f6b0749"),
        ({"name": "iid", "num_clients": 37}, 2000, 10, 1, "20f3718b874105eb"),
        ({"name": "dirichlet", "num_clients": 40, "alpha": 0.3}, 3000, 10, 1, "aae5338474210229"),
        ({"name": "dirichlet", "num_clients": 25, "alpha": 0.1, "min_samples": 5}, 2000, 7, 1, "bab2415365e62a50"),
        ({"name": "shards", "num_clients": 45, "classes_per_client": 2}, 2000, 10, 1, "c7daebb035ca4191"),
        ({"name": "shards", "num_clients": 30, "classes_per_client": 3}, 2000, 8, 1, "e2501cda057b98fa"),
        ({"name": "cluster", "num_clients": 33, "num_groups": 4}, 3000, 10, 1, "2c825616b36c4384"),
        (
            {"name": "cluster", "num_clients": 20, "num_groups": 3, "group_sizes": "random", "classes_per_group": 5},
            2000,
            10,
            1,
            "6c4e8f15166daeaa",
        ),
        ({"name": "domain", "num_clients": 12}, 1500, 10, 1, "8a8c40b61301a266"),
        ({"name": "natural"}, 1500, 10, 1, "387b4a41f00f6890"),
    ],
)
def test_partitions_are_those_of_the_per_client_implementation(cfg, n, classes, seed, expected):
    assert digest(build(synthetic(n, classes, seed), seed, **cfg)) == expected


def test_split_indices_are_those_of_the_per_class_implementation():
    h = hashlib.sha256()
    for cid in range(200):
        r = np.random.default_rng(cid)
        labels = r.integers(0, int(r.integers(1, 12)), int(r.integers(3, 60)))
        for part in split_indices(labels, SplitConfig(), np.random.default_rng(1000 + cid)):
            h.update(part.astype(np.int64).tobytes())
            h.update(b"|")
    assert h.hexdigest()[:16] == SPLIT_DIGEST


SPLIT_DIGEST = "e50dec1af543e81e"  # split_indices before vectorising

N = 10_000


@pytest.fixture(scope="module")
def big() -> Pool:
    return synthetic(30 * N, 10, 0, natural_ids=N)


def assert_every_sample_once(part, pool_size: int) -> np.ndarray:
    sizes = np.array([len(i) for i in part.indices])
    every = np.concatenate(part.indices)
    assert np.array_equal(np.sort(every), np.arange(pool_size))
    assert all(np.all(np.diff(i) > 0) for i in part.indices)  # ascending within a client
    return sizes


def test_iid_at_10k_clients(big):
    part = build(big, name="iid", num_clients=N)
    sizes = assert_every_sample_once(part, len(big))
    assert part.num_clients == N and sizes.max() - sizes.min() <= 1


def test_dirichlet_at_10k_clients(big):
    part = build(big, name="dirichlet", num_clients=N, alpha=10.0, min_samples=5)
    sizes = assert_every_sample_once(part, len(big))
    assert part.num_clients == N and sizes.min() >= 5


def test_shards_at_10k_clients(big):
    part = build(big, name="shards", num_clients=N, classes_per_client=2)
    sizes = assert_every_sample_once(part, len(big))
    classes = np.array([len(np.unique(big.y[i])) for i in part.indices])
    assert np.all(classes == 2) and sizes.min() >= MIN_CLIENT_SAMPLES
    holders = np.bincount(np.concatenate([np.unique(big.y[i]) for i in part.indices]), minlength=10)
    assert holders.max() - holders.min() <= 1  # class usage balanced


def test_cluster_at_10k_clients(big):
    part = build(big, name="cluster", num_clients=N, num_groups=5)
    assert_every_sample_once(part, len(big))
    groups = np.array(part.groups)
    assert np.array_equal(np.bincount(groups), [N // 5] * 5)
    for g in range(5):  # group g owns classes 2g and 2g+1 (disjoint blocks of 10 // 5)
        labels = np.unique(big.y[np.concatenate([part.indices[c] for c in np.flatnonzero(groups == g)])])
        assert labels.tolist() == [2 * g, 2 * g + 1]


def test_natural_at_10k_clients(big):
    part = build(big, name="natural")
    assert_every_sample_once(part, len(big))
    ids = np.unique(big.natural_id)
    assert part.num_clients == len(ids)
    for cid in (0, 1, len(ids) // 2, len(ids) - 1):
        assert np.array_equal(part.indices[cid], np.flatnonzero(big.natural_id == ids[cid]))
