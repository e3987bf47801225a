"""Grouped evaluation gives every client exactly the per-client path's metrics: one pass over the
concatenated splits of the clients that share the payload's weights, metrics of unchanged personal
weights reused, the pooled test served by the same pass, and a self-check that switches grouping
off where a row's logits would depend on its batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fedmerge.algorithms.fedavg import FedAvg, FedAvgConfig
from fedmerge.algorithms.local import Local, LocalConfig
from fedmerge.core.seeding import torch_generator
from fedmerge.core.training import predict_logits
from fedmerge.engines.evaluation import evaluate_client
from fedmerge.engines.local import LocalEngine
from fedmerge.metrics import classification_metrics
from fedmerge.metrics.classification import segment_metrics

# split sizes per client (val, test): empty, single rows, short batches, more than one batch of 7
SIZES = [(0, 5), (1, 1), (2, 3), (17, 40), (4, 0), (9, 16), (30, 8)]


def clients(shape: tuple[int, ...], seed: int = 0) -> list[SimpleNamespace]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n_val, n_test in SIZES:
        split = {}
        for name, n in (("train", 12), ("val", n_val), ("test", n_test)):
            split[f"x_{name}"] = torch.rand(n, *shape, generator=gen)
            split[f"y_{name}"] = torch.randint(0, 5, (n,), generator=gen)
        out.append(SimpleNamespace(**split))
    return out


def cnn(gen: torch.Generator) -> nn.Module:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


def mlp(gen: torch.Generator) -> nn.Module:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 5))


@pytest.mark.parametrize("batch_size", [1024, 7, 2])
@pytest.mark.parametrize("factory,shape", [(mlp, (8, 8)), (cnn, (1, 8, 8))])
def test_global_model_clients_equal_the_per_client_path_bit_for_bit(factory, shape, batch_size):
    data = clients(shape)
    algo = FedAvg(FedAvgConfig(), factory, len(data), seed=0)
    state = algo.init_server_state()
    pooled = (torch.cat([c.x_test for c in data]), torch.cat([c.y_test for c in data]))
    engine = LocalEngine(data, factory(torch_generator(0)), torch.device("cpu"), 0, lambda: pooled, batch_size)
    for cids in ([0, 1, 2, 3, 4, 5, 6], [1, 3, 5], [1, 3, 5]):  # a subset, then the same subset again
        payloads = algo.configure_evaluate(state, 1, cids)
        grouped = engine.evaluate(algo, 1, payloads)
        assert engine._evaluator.grouping
        for c in cids:
            expected = evaluate_client(algo, payloads[c], data[c], None, engine._context(1, c, "x"), batch_size)
            assert list(grouped[c].items()) == list(expected.items()), c
    # the pooled test: served by the grouped pass over every client, equal to predicting it anew
    engine.evaluate(algo, 1, algo.configure_evaluate(state, 1, list(range(len(data)))))
    served = engine.evaluate_global(algo, state)
    engine.model.load_state_dict(state.tensors)
    expected = classification_metrics(predict_logits(engine.model, pooled[0], batch_size), pooled[1])
    assert served == {f"test_{k}": v for k, v in expected.items()}


def test_unchanged_personal_weights_reuse_their_metrics_and_changed_ones_do_not():
    data = clients((8, 8))
    algo = Local(LocalConfig(), mlp, len(data), seed=0)
    engine = LocalEngine(data, mlp(torch_generator(0)), torch.device("cpu"), 0)
    payloads = algo.configure_evaluate(algo.init_server_state(), 1, [3, 6])
    first = engine.evaluate(algo, 1, payloads)
    weights = engine.client_states()[3].tensors
    again = engine.evaluate(algo, 2, payloads)
    assert again == first
    with torch.no_grad():  # an in-place change (new version counter) must not be served from the cache
        weights["3.bias"].add_(1.0)
    changed = engine.evaluate(algo, 3, payloads)
    assert changed[6] == first[6] and changed[3] != first[3]
    ctx = engine._context(3, 3, "evaluate")
    assert changed[3] == evaluate_client(algo, payloads[3], data[3], engine.client_states()[3], ctx)


class BatchDependent(nn.Module):
    """Logits that depend on the batch's size: what a BLAS without row independence would give."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.flatten(1)) + 1e-3 * x.shape[0]


def test_where_rows_depend_on_their_batch_grouping_switches_itself_off():
    data = clients((8, 8))

    def factory(gen: torch.Generator) -> nn.Module:
        torch.manual_seed(0)
        return BatchDependent()

    algo = FedAvg(FedAvgConfig(), factory, len(data), seed=0)
    state = algo.init_server_state()
    engine = LocalEngine(data, factory(torch_generator(0)), torch.device("cpu"), 0)
    cids = list(range(len(data)))
    payloads = algo.configure_evaluate(state, 1, cids)
    grouped = engine.evaluate(algo, 1, payloads)
    assert not engine._evaluator.grouping
    for c in cids:
        assert grouped[c] == evaluate_client(algo, payloads[c], data[c], None, engine._context(1, c, "x"))


def test_segment_metrics_equal_classification_metrics_per_segment():
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        sizes = torch.randint(1, 60, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
        n, classes = sum(sizes), int(torch.randint(2, 12, (1,), generator=gen))
        logits = torch.randn(n, classes, generator=gen) * (0.1 + trial)
        logits[::5, :2] = 3.0  # ties between classes
        y = torch.randint(0, classes, (n,), generator=gen)
        bounds = [0, *torch.tensor(sizes).cumsum(0).tolist()]
        got = segment_metrics(logits, y, bounds)
        for (a, b), metrics in zip(zip(bounds[:-1], bounds[1:]), got, strict=True):
            assert list(metrics.items()) == list(classification_metrics(logits[a:b], y[a:b]).items())
