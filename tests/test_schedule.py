"""The workers' share of a round: clients handed out largest first (by the rows their work reads), and a
pass whose batches are free cut evenly among the workers, in batches long enough to keep every logit."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import quick_config, run

from fedmerge.data.views import PooledClients
from fedmerge.engines import workers
from fedmerge.engines.grouped_eval import SMALL_BATCH, even_batches, forward_batches
from fedmerge.engines.local import LocalEngine
from fedmerge.engines.schedule import largest_first, split_rows
from fedmerge.models.cnn import TwoCNN
from fedmerge.run.prepare import load_data


def test_largest_first_by_the_rows_each_kind_reads():
    rows = [(10, 1, 1), (30, 0, 0), (10, 5, 9), (30, 2, 2)]  # (train, val, test)
    assert largest_first("fit", [0, 1, 2, 3], rows) == [1, 3, 0, 2]  # ties (30, 10) by client id
    assert largest_first("evaluate", [0, 1, 2, 3], rows) == [2, 3, 0, 1]  # val + test: 14, 4, 2, 0
    assert largest_first("onboard", [0, 1, 2, 3], rows) == [3, 1, 2, 0]  # all rows: 12, 30, 24, 34
    assert largest_first("fit", [2, 0], rows) == [0, 2]  # only the clients asked for


def test_split_rows_of_pooled_views_without_gathering_and_of_plain_clients():
    bounds = np.array([[0, 3, 5, 9], [9, 9, 10, 10], [10, 16, 17, 20]])
    pooled = PooledClients(torch.zeros(20, 2), torch.arange(20), torch.zeros(20, dtype=torch.long), bounds)
    assert split_rows(pooled) == [(3, 2, 4), (0, 1, 0), (6, 1, 3)]
    assert split_rows(list(pooled)) == [(3, 2, 4), (0, 1, 0), (6, 1, 3)]  # the gathered clients' own lengths
    no_test = SimpleNamespace(y_train=torch.zeros(4), y_val=torch.zeros(2))  # ClientDataLike needs no test split
    assert split_rows([no_test]) == [(4, 2, 0)]


def test_even_batches_by_hand():
    assert even_batches(999, 2, 1024) == [[499], [500]]  # one batch of the run's process, shared
    assert even_batches(7000, 2, 1024) == [[875, 1750, 2625, 3500]] * 2  # 7 batches would split 3 + 4
    assert even_batches(10, 3, 1024) is None  # fewer rows than SMALL_BATCH per worker: not shared
    assert even_batches(40, 2, SMALL_BATCH) is None  # 20 rows a worker in batches of 16: one batch of 4
    for rows, parts, bs in [(17_500, 2, 1024), (333, 4, 64), (64, 4, 16)]:
        runs = even_batches(rows, parts, bs)
        assert runs is not None and len(runs) == parts
        assert sum(r[-1] for r in runs) == rows and max(r[-1] for r in runs) - min(r[-1] for r in runs) <= 1
        sizes = [b - a for r in runs for a, b in zip([0, *r[:-1]], r)]
        assert SMALL_BATCH <= min(sizes) and max(sizes) <= bs


@pytest.mark.parametrize("method", ["fedavg", "fedmerge"])
def test_the_workers_get_the_clients_largest_first(tmp_path, monkeypatch, method):
    handed: list[tuple[str, list[int]]] = []
    real = workers.WorkerPool.map

    def spy(pool, tasks, on_result=None):
        handed.append((tasks[0][0], [t[2] for t in tasks]))
        return real(pool, tasks, on_result)

    monkeypatch.setattr(workers.WorkerPool, "map", spy)
    cfg = quick_config(f"algorithm.name={method}", "rounds=1", "workers=2")
    run(cfg, tmp_path / "r")
    train = [len(c.y_train) for c in load_data(cfg).clients]
    evaluated = [len(c.y_val) + len(c.y_test) for c in load_data(cfg).clients]
    fits = [cids for kind, cids in handed if kind == "fit"]
    want = sorted(range(len(train)), key=lambda c: (-train[c], c))
    assert fits == [want] and want != sorted(want), (fits, train)
    if method == "fedmerge":  # a payload per client: each client evaluated in the workers, largest first
        evals = [cids for kind, cids in handed if kind == "evaluate"]
        assert evals == [sorted(range(len(evaluated)), key=lambda c: (-evaluated[c], c))], (evals, evaluated)


def test_a_pass_with_free_batches_is_shared_evenly_by_the_workers_row_for_row():
    torch.set_num_threads(1)
    model = TwoCNN(1, (28, 28), 10)
    x = torch.randn(300, 28, 28, 1, generator=torch.Generator().manual_seed(0)).permute(0, 3, 1, 2)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine = LocalEngine([], model, torch.device("cpu"), 0, eval_batch_size=64, workers=2)
    engine._pool = workers.WorkerPool(2, partial(engine._run_task, None))  # as a round's fit leaves it
    try:
        spread = engine._forward_in_workers(weights, x, None)
        # 150 rows a worker, each in 3 batches of 50 (at most 64 rows): the same batches predicted here
        assert spread is not None and torch.equal(spread, forward_batches(model, x, [50, 100, 150, 200, 250, 300]))
        assert engine._forward_in_workers(weights, x[:20], None) is None  # 10 rows a worker: too short a batch
    finally:
        engine.close()
