"""Partitioners: coverage, skew, groups, rotation, natural ids, config errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from fedmerge.core.seeding import numpy_rng
from fedmerge.data import (
    PARTITIONERS,
    NoiseConfig,
    Pool,
    SplitConfig,
    build_federated_dataset,
    load_pool,
    rotate_images,
)


@pytest.fixture(scope="module")
def digits() -> Pool:
    return load_pool({"name": "digits"})


def partition(pool: Pool, seed: int = 0, **cfg):
    config = PARTITIONERS.parse(cfg)
    part = PARTITIONERS.get(config.name).obj(config, pool, numpy_rng(seed, purpose="partition"))
    part.validate(len(pool))
    return part


def class_hist(pool: Pool, idx: np.ndarray) -> np.ndarray:
    return np.bincount(pool.y[idx], minlength=pool.num_classes) / len(idx)


def assert_exact_cover(part, n: int) -> None:
    every = np.concatenate(part.indices)
    assert len(every) == len(np.unique(every)), "a sample was given to two clients"
    np.testing.assert_array_equal(np.sort(every), np.arange(n))


@pytest.mark.parametrize(
    "cfg",
    [
        {"name": "iid", "num_clients": 7},
        {"name": "dirichlet", "num_clients": 10, "alpha": 0.3},
        {"name": "shards", "num_clients": 10, "classes_per_client": 2},
        {"name": "shards", "num_clients": 13, "classes_per_client": 3},
        {"name": "domain", "num_clients": 8, "by": "rotation"},
    ],
)
def test_whole_pool_partitioners_cover_every_sample_once(digits: Pool, cfg: dict) -> None:
    part = partition(digits, **cfg)
    assert part.num_clients == cfg["num_clients"]
    assert_exact_cover(part, len(digits))


def test_iid_sizes_are_near_equal(digits: Pool) -> None:
    sizes = [len(i) for i in partition(digits, name="iid", num_clients=7).indices]
    assert max(sizes) - min(sizes) <= 1


def test_dirichlet_large_alpha_is_near_iid(digits: Pool) -> None:
    part = partition(digits, name="dirichlet", num_clients=10, alpha=1e4)
    overall = class_hist(digits, np.arange(len(digits)))
    tv = [0.5 * np.abs(class_hist(digits, idx) - overall).sum() for idx in part.indices]
    assert max(tv) < 0.1


def test_dirichlet_small_alpha_is_skewed(digits: Pool) -> None:
    part = partition(digits, name="dirichlet", num_clients=10, alpha=0.05)
    overall = class_hist(digits, np.arange(len(digits)))
    tv = [0.5 * np.abs(class_hist(digits, idx) - overall).sum() for idx in part.indices]
    assert np.mean(tv) > 0.4
    assert min(len(i) for i in part.indices) >= 10  # min_samples default


def test_dirichlet_gives_up_with_a_clear_error(digits: Pool) -> None:
    with pytest.raises(ValueError, match=r"^partition\.num_clients: after 5 Dirichlet draws"):
        partition(digits, name="dirichlet", num_clients=100, alpha=0.01, min_samples=15, max_tries=5)


def test_shards_give_each_client_exactly_k_classes_balanced(digits: Pool) -> None:
    part = partition(digits, name="shards", num_clients=15, classes_per_client=3)
    class_sets = [set(np.unique(digits.y[idx]).tolist()) for idx in part.indices]
    assert all(len(s) == 3 for s in class_sets)
    usage = np.bincount([c for s in class_sets for c in s], minlength=10)
    assert usage.max() - usage.min() <= 1
    assert len({frozenset(s) for s in class_sets}) > 3  # combinations are not one repeated block


def test_shards_rejects_more_classes_than_exist(digits: Pool) -> None:
    with pytest.raises(ValueError, match=r"^partition\.classes_per_client: 11 exceeds the 10 classes"):
        partition(digits, name="shards", num_clients=4, classes_per_client=11)


def test_cluster_groups_own_disjoint_class_blocks(digits: Pool) -> None:
    part = partition(digits, name="cluster", num_clients=10, num_groups=5)
    assert part.groups == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert_exact_cover(part, len(digits))  # 5 groups x 2 classes use all 10 classes
    for cid, idx in enumerate(part.indices):
        g = part.groups[cid]
        assert set(np.unique(digits.y[idx]).tolist()) == {2 * g, 2 * g + 1}


def test_cluster_overlapping_classes_are_spread_evenly(digits: Pool) -> None:
    part = partition(digits, name="cluster", num_clients=8, num_groups=4, classes_per_group=5)
    group_sets = {}
    for cid, idx in enumerate(part.indices):
        classes = frozenset(np.unique(digits.y[idx]).tolist())
        group_sets.setdefault(part.groups[cid], set()).add(classes)
    assert all(len(sets) == 1 for sets in group_sets.values()), "clients of a group share one class set"
    owned = [next(iter(group_sets[g])) for g in range(4)]
    assert owned[0] == {0, 1, 2, 3, 4} and owned[1] == {5, 6, 7, 8, 9} and owned[2] == {0, 1, 2, 3, 4}
    assert np.bincount([c for s in owned for c in s]).tolist() == [2] * 10
    every = np.concatenate(part.indices)
    assert len(every) == len(np.unique(every))


def test_cluster_random_group_sizes_keep_every_group(digits: Pool) -> None:
    part = partition(digits, name="cluster", num_clients=12, num_groups=5, group_sizes="random")
    assert set(part.groups) == set(range(5))


def test_cluster_needs_a_client_per_group(digits: Pool) -> None:
    with pytest.raises(ValueError, match=r"^partition\.num_clients: 3 clients cannot fill 5 groups"):
        partition(digits, name="cluster", num_clients=3, num_groups=5)


def test_domain_by_source_gives_each_group_one_domain() -> None:
    rng = np.random.default_rng(0)
    domain = np.repeat([0, 1, 2], [40, 60, 50])
    pool = Pool(rng.random((150, 4), dtype=np.float32), rng.integers(0, 3, 150), 3, "toy", domain=domain)
    part = partition(pool, name="domain", num_clients=6)
    assert part.groups == [0, 0, 1, 1, 2, 2]
    assert_exact_cover(part, 150)
    for cid, idx in enumerate(part.indices):
        assert set(domain[idx].tolist()) == {part.groups[cid]}
    with pytest.raises(ValueError, match=r"^partition\.num_groups: dataset 'toy' has 3 domains"):
        partition(pool, name="domain", num_clients=6, num_groups=2)


def test_domain_by_source_needs_domains(digits: Pool) -> None:
    with pytest.raises(ValueError, match=r"^partition\.by: dataset 'digits' has no domains"):
        partition(digits, name="domain", num_clients=4)


def test_domain_rotation_rotates_group_images(digits: Pool) -> None:
    fed = build_federated_dataset(
        {"name": "digits"},
        {"name": "domain", "num_clients": 8, "by": "rotation", "num_groups": 4},
        SplitConfig(),
        NoiseConfig(),
        seed=3,
    )
    assert [c.group for c in fed.clients] == [0, 0, 1, 1, 2, 2, 3, 3]
    originals = {x.tobytes() for x in digits.x}
    for client in fed.clients:
        images = torch.cat([client.x_train, client.x_val, client.x_test])
        # Undo the group's rotation: the result must be an original sample, byte for byte.
        unrotated = torch.rot90(images, -client.group, dims=(-2, -1)).contiguous().numpy()
        assert all(x.tobytes() in originals for x in unrotated)
        if client.group == 1:
            assert not any(x.tobytes() in originals for x in images.numpy())


def test_rotation_by_other_angles_is_affine_and_matches_rot90_direction() -> None:
    x = torch.rand(3, 1, 9, 9)
    np.testing.assert_allclose(rotate_images(x, 90.0 + 1e-9), torch.rot90(x, 1, (-2, -1)), atol=1e-5)
    assert rotate_images(x, 45.0).shape == x.shape


def test_rotation_needs_images() -> None:
    pool = Pool(np.zeros((30, 4), np.float32), np.zeros(30, np.int64), 1, "tab")
    with pytest.raises(ValueError, match=r"^partition\.by: rotation needs image data"):
        partition(pool, name="domain", num_clients=2, by="rotation")


def test_natural_partition_follows_client_ids() -> None:
    ids = np.array([5, 2, 5, 9, 2, 2, 9, 5, 9, 5, 2, 9])
    pool = Pool(np.zeros((12, 2), np.float32), np.arange(12) % 2, 2, "nat", natural_id=ids)
    part = partition(pool, name="natural")
    assert [sorted(set(ids[i].tolist())) for i in part.indices] == [[2], [5], [9]]
    assert_exact_cover(part, 12)
    assert partition(pool, name="natural", num_clients=3).num_clients == 3
    with pytest.raises(ValueError, match=r"^partition\.num_clients: dataset 'nat' has 3 client ids"):
        partition(pool, name="natural", num_clients=4)


def test_natural_needs_ids(digits: Pool) -> None:
    with pytest.raises(ValueError, match="natural needs per-sample client ids"):
        partition(digits, name="natural")


@pytest.mark.parametrize("name", ["iid", "dirichlet", "shards", "cluster", "domain"])
def test_too_many_clients_names_the_key(digits: Pool, name: str) -> None:
    with pytest.raises(ValueError, match=r"^partition\.num_clients: "):
        partition(digits, name=name, num_clients=5000)


def test_configs_reject_impossible_values_and_unknown_keys() -> None:
    with pytest.raises(ValidationError, match="alpha"):
        PARTITIONERS.parse({"name": "dirichlet", "alpha": 0})
    with pytest.raises(ValidationError, match="alpha"):
        PARTITIONERS.parse({"name": "dirichlet", "alpha": -1.0})
    with pytest.raises(ValidationError, match="num_clinets"):
        PARTITIONERS.parse({"name": "iid", "num_clinets": 3})
    with pytest.raises(ValidationError, match="num_clients"):
        PARTITIONERS.parse({"name": "shards", "num_clients": 0})
    cfg = PARTITIONERS.parse({"name": "cluster"})
    with pytest.raises(ValidationError):
        cfg.num_groups = 3  # frozen
