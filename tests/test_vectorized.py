"""``vectorize: true`` (all clients' local SGD in one vmapped computation) agrees with the sequential
engine within float tolerance on CPU, for every vectorizable method; what it cannot run is refused."""

from __future__ import annotations

import pytest
import torch
from helpers import quick_config, run
from test_grouped_eval import clients as eval_clients
from test_grouped_eval import cnn, mlp
from torch import nn

from fedmerge.algorithms.ditto import Ditto, DittoConfig
from fedmerge.algorithms.fedavg import FedAvg, FedAvgConfig
from fedmerge.algorithms.fedmerge import FedMerge, FedMergeConfig
from fedmerge.algorithms.fedprox import FedProx, FedProxConfig
from fedmerge.algorithms.local import Local, LocalConfig
from fedmerge.config.schema import ConfigError
from fedmerge.core.seeding import torch_generator
from fedmerge.engines.local import LocalEngine
from fedmerge.engines.vectorized import vectorize_problem
from fedmerge.run.results import RunStore

# Batched kernels sum in other orders: after 2 rounds of 6 momentum steps the parameters agree to
# about 1e-7 here; the bound leaves room for other BLAS builds.
ATOL, RTOL = 1e-5, 1e-4

METHODS = [
    (FedAvg, FedAvgConfig, {}),
    (FedProx, FedProxConfig, {"mu": 0.5}),
    (Local, LocalConfig, {}),
    (FedMerge, FedMergeConfig, {"num_models": 3, "gap_samples": 5}),
]


def clients(shape: tuple[int, ...]) -> list:
    """Training sets of different sizes (none, a single batch, trailing batches of 1 and 2, several
    batches): clients take different numbers of steps, so padding and early finishers are exercised."""
    out = eval_clients(shape)
    gen = torch.Generator().manual_seed(1)
    for c, n in zip(out, (0, 3, 11, 12, 22, 7, 30)):
        c.x_train, c.y_train = torch.rand(n, *shape, generator=gen), torch.randint(0, 5, (n,), generator=gen)
    return out


def two_rounds(cls, cfg, factory, data, vectorize: bool):
    algo = cls(cfg, factory, len(data), seed=0)
    engine = LocalEngine(data, factory(torch_generator(0)), torch.device("cpu"), 0, vectorize=vectorize)
    state = algo.init_server_state()
    for rnd in (1, 2):
        updates = engine.fit(algo, rnd, algo.configure(state, rnd, list(range(len(data)))))
        state = algo.aggregate(state, rnd, updates)
    return state, updates, engine.client_states()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("factory,shape", [(mlp, (8, 8)), (cnn, (1, 8, 8))])
@pytest.mark.parametrize("cls,config,extra", METHODS)
def test_vectorized_clients_agree_with_the_sequential_engine(cls, config, extra, factory, shape):
    data = clients(shape)
    cfg = config(lr=0.1, momentum=0.9, weight_decay=0.01, batch_size=5, local_epochs=2, **extra)
    (s0, u0, c0), (s1, u1, c1) = (two_rounds(cls, cfg, factory, data, v) for v in (False, True))
    assert s0.tensors.keys() == s1.tensors.keys()
    assert all(close(s0.tensors[k], s1.tensors[k]) for k in s0.tensors)
    assert u0.keys() == u1.keys() and c0.keys() == c1.keys()
    for cid in u0:
        assert u0[cid].meta.keys() == u1[cid].meta.keys()
        assert u0[cid].meta["steps"] == u1[cid].meta["steps"] and u0[cid].num_examples == u1[cid].num_examples
        for key in ("train_loss", "loss_received", "loss_trained"):
            if key in u0[cid].meta:
                assert u1[cid].meta[key] == pytest.approx(u0[cid].meta[key], rel=RTOL, nan_ok=True)
        assert all(close(v, u1[cid].tensors[k]) for k, v in u0[cid].tensors.items())
        assert all(close(v, c1[cid].tensors[k]) for k, v in c0[cid].tensors.items())
    # The agreement means something only if training moved the weights far beyond the tolerance.
    assert largest_change(cls(cfg, factory, len(data), seed=0), s0, c0) > 100 * ATOL


def largest_change(algo, state, client_states) -> float:
    """The largest change of any float entry of the server state or a client state since initialisation;
    FedMerge's merge logits are left out (their step has a fixed size, trained or not)."""
    pairs = [(state.tensors, algo.init_server_state().tensors)]
    pairs += [(c.tensors, algo.init_client_state(cid).tensors) for cid, c in client_states.items()]
    return max(
        float((now[k].double() - then[k].double()).abs().max())
        for now, then in pairs
        for k in now
        if now[k].is_floating_point() and now[k].numel() and k != "logits"
    )


def test_what_cannot_be_vectorized_is_refused_in_one_line(tmp_path):
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    drop = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    fedavg = FedAvg(FedAvgConfig(), mlp, 2, seed=0)
    assert vectorize_problem(fedavg, mlp(torch_generator(0))) is None
    assert "buffers" in vectorize_problem(fedavg, bn)
    assert "dropout" in vectorize_problem(fedavg, drop)
    assert "plain local SGD" in vectorize_problem(Ditto(DittoConfig(), mlp, 2, seed=0), mlp(torch_generator(0)))

    class Subclass(FedAvg):  # trains otherwise: not vectorizable because its parent is
        def client_update(self, payload, data, state, ctx):
            return super().client_update(payload, data, state, ctx)

    assert vectorize_problem(Subclass(FedAvgConfig(), mlp, 2, seed=0), mlp(torch_generator(0))) is not None
    with pytest.raises(ConfigError, match="^vectorize: ditto does not"):
        run(quick_config("vectorize=true", "algorithm.name=ditto"), tmp_path / "ditto")
    with pytest.raises(ConfigError, match="workers=1"):
        run(quick_config("vectorize=true", "workers=2"), tmp_path / "workers")


def test_a_vectorized_run_writes_its_choice_and_a_default_run_does_not(tmp_path):
    default = run(quick_config("rounds=1"), tmp_path / "default")
    vec = run(quick_config("rounds=1", "vectorize=true"), tmp_path / "vec")
    assert "vectorize" not in (default.run_dir / "config.yaml").read_text()
    assert "vectorize: true" in (vec.run_dir / "config.yaml").read_text()
    a, b = (RunStore(r.run_dir).read_metrics()[0] for r in (default, vec))
    assert b["train_loss"] == pytest.approx(a["train_loss"], rel=RTOL)
    assert b["eval"]["clients"]["0"]["test_nll"] == pytest.approx(a["eval"]["clients"]["0"]["test_nll"], rel=1e-3)
