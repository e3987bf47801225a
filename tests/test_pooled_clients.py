"""Clients as index views into one pooled tensor (``data.views.PooledClients``): the same samples as
per-client copies and the same run, and the global test of a sampled evaluation stays that sample's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_runs_identical, quick_config, run, strip_timing

from fedmerge.core.loop import Schedule
from fedmerge.data.federated import ClientData, FederatedDataset
from fedmerge.data.views import PooledClients
from fedmerge.run.engine_setup import pooled_test_of


def _pooled(num_clients: int = 12, per_client: int = 20) -> PooledClients:
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.normal(size=(50, 6)).astype(np.float32))  # clients overlap in this small pool
    rows = rng.integers(0, 50, num_clients * per_client)
    labels = torch.from_numpy(rng.integers(0, 3, len(rows)))
    starts = np.arange(num_clients)[:, None] * per_client
    bounds = np.hstack([starts, starts + 14, starts + 16, starts + per_client])
    return PooledClients(x, torch.from_numpy(rows), labels, bounds, groups=np.arange(num_clients) % 2)


def _copies(views: PooledClients) -> list[ClientData]:
    clients = []
    for cid, (a, b, c, d) in enumerate(views.bounds):
        x, y = views.x[views.rows[a:d]].clone(), views.labels[a:d].clone()
        i, j = b - a, c - a
        clients.append(ClientData(cid, x[:i], y[:i], x[i:j], y[i:j], x[j:], y[j:], group=cid % 2))
    return clients


def test_views_hold_the_rows_their_indices_name():
    views = _pooled()
    assert len(views) == 12 and views.group_list() == [c % 2 for c in range(12)] and views.has_test()
    for cid in (0, 5, 11, -1):
        mine, copy = views[cid], _copies(views)[cid % 12]
        assert mine.cid == cid % 12 and mine.group == copy.group
        assert (mine.n_train, mine.n_val, mine.n_test) == (14, 2, 4)
        for name in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test"):
            assert torch.equal(getattr(mine, name), getattr(copy, name)), name
    assert torch.equal(views[3].x_train[0], views.x[views.rows[60]])  # by hand: client 3 starts at entry 60
    with pytest.raises(IndexError):
        views[12]
    with pytest.raises(ValueError, match="same length"):
        PooledClients(views.x, views.rows[:-1], views.labels, views.bounds)


def test_a_run_on_views_equals_a_run_on_copies(tmp_path):
    views = _pooled()
    cfg = quick_config("partition.num_clients=12", "algorithm.name=ditto", "participation=0.5", "model.name=mlp")
    on_views = run(cfg, tmp_path / "views", data=FederatedDataset(views, 3, (6,), "pooled"))
    on_copies = run(cfg, tmp_path / "copies", data=FederatedDataset(_copies(views), 3, (6,), "pooled"))
    assert_runs_identical(on_views.run_dir, on_copies.run_dir)
    assert strip_timing(on_views.summary) == strip_timing(on_copies.summary)


def test_global_test_of_a_sampled_evaluation_is_the_sample_s_test_splits():
    data = FederatedDataset(_copies(_pooled()), 3, (6,), "pooled")
    cfg = quick_config("partition.num_clients=12", "eval_clients=sample:4", "model.name=mlp")
    sample = Schedule(cfg.rounds, 12, seed=cfg.seed, eval_clients="sample:4").evaluated(1, [])
    x, y = pooled_test_of(cfg, data)()
    assert len(sample) == 4 and len(y) == 16
    assert torch.equal(x, torch.cat([data.clients[c].x_test for c in sample]))
    assert torch.equal(y, torch.cat([data.clients[c].y_test for c in sample]))
    every = pooled_test_of(quick_config("partition.num_clients=12", "model.name=mlp"), data)()
    assert len(every[1]) == 48  # all: every client's test split, as before


def test_built_clients_are_views_of_one_pooled_tensor():
    from fedmerge.data import NoiseConfig, SplitConfig, build_federated_dataset
    from fedmerge.data.pool import load_pool

    data = build_federated_dataset(
        {"name": "digits"}, {"name": "dirichlet", "num_clients": 5}, SplitConfig(), NoiseConfig(), 0
    )
    storages = {
        getattr(c, name).untyped_storage().data_ptr() for c in data.clients for name in ("x_train", "x_val", "x_test")
    }
    assert len(storages) == 1  # one tensor, no per-client copies
    pool = load_pool({"name": "digits"})
    total = sum(c.n_train + c.n_val + c.n_test for c in data.clients)
    assert total == len(pool) and data.clients[0].x_train.untyped_storage().nbytes() == total * 64 * 4
