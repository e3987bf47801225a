"""``split.test_from: publisher``: the rows a dataset's publisher fixed as its test set (``Pool.publisher_test``,
ImageNet-R's test list) are the global test set, kept out of the partition; the default is unchanged."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from fedmerge.config.schema import ConfigError, load_config, to_yaml
from fedmerge.data import NoiseConfig, Pool, SplitConfig
from fedmerge.data.federated import compute_partition, federate, without_rows
from fedmerge.data.partitioners import PARTITIONERS

N = 60
# the publisher's test rows, picked by hand: scattered, every class among them
TEST_ROWS = [2, 7, 8, 15, 23, 31, 40, 41, 52, 59]
DIRICHLET = {"name": "dirichlet", "num_clients": 4, "alpha": 1.0}
PUBLISHER = SplitConfig(val_fraction=0.1, test_fraction=0.2, test_from="publisher")


def marked_pool(standardize: bool = False) -> Pool:
    """60 rows of 3 classes; feature 0 is the row's number, so every sample says where it came from."""
    rng = np.random.default_rng(0)
    x = np.stack([np.arange(N, dtype=np.float32), rng.normal(size=N).astype(np.float32)], axis=1)
    marked = np.zeros(N, dtype=bool)
    marked[TEST_ROWS] = True
    return Pool(x, np.arange(N) % 3, 3, "tiny", standardize=standardize, publisher_test=marked)


def rows(x: torch.Tensor) -> list[int]:
    return [int(v) for v in x[:, 0].round().tolist()]


def client_rows(data, which: str = "all") -> list[list[int]]:
    parts = {"train": ("x_train",), "val": ("x_val",), "test": ("x_test",), "all": ("x_train", "x_val", "x_test")}
    return [sorted(r for f in parts[which] for r in rows(getattr(c, f))) for c in data.clients]


def test_the_publishers_rows_are_the_global_test_and_no_clients():
    pool = marked_pool()
    data = federate(pool, DIRICHLET, PUBLISHER, NoiseConfig(), seed=0)
    x, y = data.pooled_test()
    assert rows(x) == TEST_ROWS and y.tolist() == [r % 3 for r in TEST_ROWS]
    assert data.pooled_test([0]) is data.global_test  # whichever clients are evaluated
    held = [r for c in client_rows(data) for r in c]
    assert not set(held) & set(TEST_ROWS)
    assert sorted(held) == sorted(set(range(N)) - set(TEST_ROWS))  # every other row, once
    # the partition is the partitioner's on the 50 other rows, numbered back to the pool's rows
    rest = np.array(sorted(set(range(N)) - set(TEST_ROWS)))
    expected = compute_partition(pool.subset(rest), PARTITIONERS.parse(DIRICHLET), 0)
    assert client_rows(data) == [sorted(rest[idx].tolist()) for idx in expected.indices]
    for c in data.clients:  # each client's own test split: test_fraction of its own samples, as before
        n = c.n_train + c.n_val + c.n_test
        assert abs(c.n_test - 0.2 * n) <= 1 and c.n_test >= 1
    assert "global test: the publisher's 10 test samples" in data.summary_table()
    assert pool.subset(np.array([2, 3])).publisher_test.tolist() == [True, False]  # a subsample keeps the marks
    moved = data.to("cpu")
    assert torch.equal(moved.pooled_test()[0], x)


def test_a_test_list_after_the_train_list_is_partitioned_without_copying_the_train_rows():
    pool = replace(marked_pool(), publisher_test=np.arange(N) >= N - 10)  # ImageNet-R's layout: train, then test
    data = federate(pool, DIRICHLET, PUBLISHER, NoiseConfig(), seed=1)
    assert rows(data.pooled_test()[0]) == list(range(N - 10, N))
    expected = compute_partition(pool.subset(np.arange(N - 10)), PARTITIONERS.parse(DIRICHLET), 1)
    assert client_rows(data) == [sorted(idx.tolist()) for idx in expected.indices]
    part = without_rows(pool, np.arange(N - 10))
    assert np.shares_memory(part.x, pool.x) and part.y.tolist() == pool.y[: N - 10].tolist()
    assert not np.shares_memory(without_rows(pool, np.array([0, 2, 3])).x, pool.x)  # scattered rows: a copy


def test_the_global_test_is_standardized_with_the_clients_training_statistics():
    data = federate(marked_pool(standardize=True), DIRICHLET, PUBLISHER, NoiseConfig(), seed=0)
    raw = marked_pool().x.astype(np.float64)
    train = sorted(r for c in client_rows(federate(marked_pool(), DIRICHLET, PUBLISHER, NoiseConfig(), 0), "train")
                   for r in c)  # fmt: skip
    mean, std = raw[train].mean(axis=0), raw[train].std(axis=0)
    want = (raw[TEST_ROWS] - mean) / std
    np.testing.assert_allclose(data.pooled_test()[0].numpy(), want, rtol=1e-5, atol=1e-5)


def test_by_default_marked_rows_are_partitioned_as_every_other_row():
    marked, bare = marked_pool(), replace(marked_pool(), publisher_test=None)
    a = federate(marked, DIRICHLET, SplitConfig(), NoiseConfig(), seed=3)
    b = federate(bare, DIRICHLET, SplitConfig(), NoiseConfig(), seed=3)
    assert a.global_test is None
    for ca, cb in zip(a.clients, b.clients, strict=True):
        for f in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test"):
            assert torch.equal(getattr(ca, f), getattr(cb, f))
    assert sorted(r for c in client_rows(a) for r in c) == list(range(N))  # the marked rows too
    x, _ = a.pooled_test()
    assert rows(x) == [r for c in a.clients for r in rows(c.x_test)]


def test_a_pool_without_the_publishers_rows_is_refused_in_one_line():
    for none in (None, np.zeros(N, dtype=bool)):
        with pytest.raises(ValueError, match="marks no rows") as err:
            federate(replace(marked_pool(), publisher_test=none), DIRICHLET, PUBLISHER, NoiseConfig(), seed=0)
        assert "\n" not in str(err.value)
    every = replace(marked_pool(), publisher_test=np.ones(N, dtype=bool))
    with pytest.raises(ValueError, match="none is left"):
        federate(every, DIRICHLET, PUBLISHER, NoiseConfig(), seed=0)
    with pytest.raises(ValueError, match="boolean"):
        replace(marked_pool(), publisher_test=np.zeros(N, dtype=np.int64))


def test_the_config_check_refuses_a_dataset_without_the_publishers_test_set():
    for dataset in ("{name: digits}", "{name: imagenet_r, subset: train}"):
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"dataset={dataset}", "split.test_from=publisher"])
        assert "has no test set of its publisher's" in str(err.value) and "\n" not in str(err.value)
    cfg = load_config(None, ["dataset={name: imagenet_r, subset: all}", "split.test_from=publisher"])
    assert cfg.split.test_from == "publisher" and "test_from: publisher" in to_yaml(cfg)
    assert "test_from" not in to_yaml(load_config(None, ["dataset={name: digits}"]))  # old run folders' digests
    with pytest.raises(ValidationError, match="cannot be combined"):
        SplitConfig(test_from="publisher", test_per_client=5)


def test_a_run_scores_the_server_model_on_the_publishers_rows(tmp_path, monkeypatch):
    from helpers import quick_config, run

    from fedmerge.data import FederatedDataset
    from fedmerge.data.pool import load_pool

    cfg = quick_config("rounds=2")  # digits (which marks no rows: the data is built here, then handed to the run)
    pool = load_pool(cfg.dataset.model_dump())
    marked = np.zeros(len(pool), dtype=bool)
    marked[::9] = True  # 200 of the 1,797 digits
    data = federate(replace(pool, publisher_test=marked), cfg.partition, PUBLISHER, NoiseConfig(), cfg.seed)
    seen: list[list[int]] = []
    pooled = FederatedDataset.pooled_test

    def spy(self, cids=None):
        x, y = pooled(self, cids)
        seen.append(y.tolist())
        return x, y

    monkeypatch.setattr(FederatedDataset, "pooled_test", spy)
    summary = run(cfg, tmp_path / "run", data=data).summary
    assert summary["last"]["global"]["test_n"] == 200 == int(marked.sum())
    assert seen and all(y == pool.y[::9].tolist() for y in seen)  # the server model read the marked rows only
