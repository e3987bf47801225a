"""CCVR (classifier calibration from pooled feature statistics) and FedProto (shared class prototypes)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import assert_runs_identical, quick_config, run
from torch import nn

from fedmerge.algorithms._ccvr import (
    CCVRSettings,
    calibrate_head,
    client_class_stats,
    pool_class_stats,
    virtual_features,
)
from fedmerge.algorithms.ccvr import CALIBRATED, CCVR, CCVRConfig
from fedmerge.algorithms.fedproto import MASK, PROTOTYPES, FedProto, FedProtoConfig, prototype_loss
from fedmerge.core.algorithm import ClientContext
from fedmerge.core.checkpoint import load_checkpoint
from fedmerge.core.params import weighted_average
from fedmerge.core.seeding import NO_CLIENT, torch_generator
from fedmerge.core.training import LocalTraining, local_sgd, predict_logits
from fedmerge.core.types import Payload, ServerState, Update
from fedmerge.models import MODELS, build_model


class LinearOnFeatures(nn.Module):
    """A model whose penultimate features are its inputs: ``features = identity``, then ``classifier``."""

    def __init__(self, d: int, c: int) -> None:
        super().__init__()
        self.classifier = nn.Linear(d, c)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(x)


def gaussian_classes(means: torch.Tensor, counts: list[int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    xs = [means[c] + torch.randn(n, means.shape[1], generator=gen) for c, n in enumerate(counts)]
    return torch.cat(xs), torch.cat([torch.full((n,), c) for c, n in enumerate(counts)])


def mlp_factory(d_in: int = 8, hidden: int = 16, c: int = 4):
    cfg = MODELS.parse({"name": "mlp", "hidden": [hidden]})
    return lambda gen: build_model(cfg, (d_in,), c, generator=gen)


# --- CCVR math ------------------------------------------------------------------------------
def test_pooled_mean_and_covariance_equal_those_of_the_concatenated_features():
    gen = torch.Generator().manual_seed(0)
    c, d = 5, 4
    means = 3.0 * torch.randn(c, d, generator=gen)  # offsets make the mu mu^T terms matter
    # class 3 has a single sample on client 1 and two on client 2; class 4 is absent; client 2 lacks class 0
    clients = [gaussian_classes(means, n, gen) for n in ([30, 7, 12, 0, 0], [5, 40, 1, 1, 0], [0, 9, 20, 2, 0])]
    model = LinearOnFeatures(d, c)
    stats = [client_class_stats(model, x, y, c) for x, y in clients]
    assert set(stats[0]) == {"count", "mean", "cov"} and stats[0]["cov"].shape == (c, d, d)
    counts, mu, cov = pool_class_stats(stats)
    x = torch.cat([x for x, _ in clients]).double()
    y = torch.cat([y for _, y in clients])
    torch.testing.assert_close(counts, torch.bincount(y, minlength=c).double())
    for k in range(4):
        torch.testing.assert_close(mu[k].double(), x[y == k].mean(0), atol=1e-5, rtol=0)
        torch.testing.assert_close(cov[k].double(), torch.cov(x[y == k].T), atol=1e-5, rtol=0)  # unbiased
    assert mu[4].abs().sum() == 0 and cov[4].abs().sum() == 0  # absent class


def test_virtual_features_follow_the_pooled_gaussian_and_survive_singular_covariances():
    d = 3
    counts = torch.tensor([1000.0, 1.0, 50.0, 0.0], dtype=torch.float64)
    means = torch.tensor([[1.0, -2.0, 0.5], [9.0, 9.0, 9.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    a = torch.tensor([[2.0, 0.3, 0.0], [0.3, 1.0, 0.2], [0.0, 0.2, 0.5]])
    rank1 = torch.tensor([1.0, 1.0, 0.0])[:, None] * torch.tensor([1.0, 1.0, 0.0])[None, :]
    covs = torch.stack([a, torch.zeros(d, d), rank1, torch.zeros(d, d)])
    feats, labels = virtual_features(counts, means, covs, 20000, torch.Generator().manual_seed(0), jitter=1e-5)
    assert labels.tolist() == [0] * 20000 + [2] * 20000  # classes with fewer than two samples are skipped
    f0, f2 = feats[labels == 0].double(), feats[labels == 2].double()
    torch.testing.assert_close(f0.mean(0), means[0].double(), atol=0.05, rtol=0)
    torch.testing.assert_close(torch.cov(f0.T), a.double(), atol=0.06, rtol=0)
    torch.testing.assert_close(torch.cov(f2.T), rank1.double(), atol=0.05, rtol=0)  # rank-deficient: no failure
    again, _ = virtual_features(counts, means, covs, 20000, torch.Generator().manual_seed(0))
    assert torch.equal(feats, again)  # seeded


def test_calibration_removes_the_majority_class_bias_of_the_head():
    # Four Gaussian classes (means 1.5 e_c, unit variance) in 6 dims; the head is trained on 2000
    # samples of class 0 and 20 of each other class, so it predicts class 0 almost everywhere. The
    # clients' statistics come from small, differently skewed local sets. On a balanced test set the
    # balanced accuracy goes from 0.32 (recalls 1.00 / 0.05 / 0.11 / 0.12) to 0.58 (0.94 / 0.46 /
    # 0.46 / 0.46) after one calibration epoch at the default 200 virtual samples per class.
    gen = torch.Generator().manual_seed(0)
    c, d = 4, 6
    means = 1.5 * torch.eye(c, d)
    x, y = gaussian_classes(means, [2000, 20, 20, 20], gen)
    model = LinearOnFeatures(d, c)
    cfg = LocalTraining(lr=0.1, local_epochs=5)
    local_sgd(model, x, y, cfg, torch.Generator().manual_seed(1))
    x_test, y_test = gaussian_classes(means, [1000] * c, gen)

    def recalls() -> torch.Tensor:
        pred = predict_logits(model, x_test).argmax(1)
        return torch.stack([(pred[y_test == k] == k).float().mean() for k in range(c)])

    before = recalls()
    clients = [gaussian_classes(means, n, gen) for n in ([50, 10, 0, 1], [0, 40, 30, 0], [5, 0, 25, 60])]
    stats = [client_class_stats(model, cx, cy, c) for cx, cy in clients]
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    out = calibrate_head(model, weights, stats, CCVRSettings(), cfg, torch.Generator().manual_seed(2))
    assert out.keys() == weights.keys() and not torch.equal(out["classifier.bias"], weights["classifier.bias"])
    model.load_state_dict(out)
    after = recalls()
    assert before.mean() < 0.4 and after.mean() > before.mean() + 0.2
    assert after[1:].min() > 2 * before[1:].max()  # every minority class gains


def test_calibrate_head_retrains_only_the_classifier_of_a_deeper_model():
    factory = mlp_factory()
    model = factory(torch.Generator().manual_seed(0))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(60, 8, generator=gen), torch.arange(60) % 4
    stats = [client_class_stats(model, x[:30], y[:30], 4), client_class_stats(model, x[30:], y[30:], 4)]
    out = calibrate_head(model, weights, stats, CCVRSettings(samples_per_class=10), LocalTraining(), gen)
    changed = {k for k in weights if not torch.equal(out[k], weights[k])}
    assert changed == {"classifier.weight", "classifier.bias"}


# --- CCVR as an algorithm -------------------------------------------------------------------
@pytest.mark.parametrize("broadcast", [True, False])
def test_ccvr_server_averages_then_calibrates_and_routes_the_head(broadcast):
    factory = mlp_factory()
    cfg = CCVRConfig(broadcast_calibrated=broadcast, samples_per_class=16)
    alg = CCVR(cfg, factory, 2, seed=3)
    model = factory(torch.Generator().manual_seed(0))
    updates = {}
    for cid in (0, 1):
        gen = torch.Generator().manual_seed(10 + cid)
        w = {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in alg.initial_weights().items()}
        model.load_state_dict(w)
        x, y = torch.randn(20 + 10 * cid, 8, generator=gen), torch.arange(20 + 10 * cid) % 4
        stats = client_class_stats(model, x, y, 4)
        updates[cid] = Update({**w, **{f"ccvr/{k}": v for k, v in stats.items()}}, {"num_examples": len(y)})
    state = alg.aggregate(ServerState(alg.initial_weights()), 1, updates)
    avg = weighted_average([{k: v for k, v in u.tensors.items() if "/" not in k} for u in updates.values()], [20, 30])
    stats = [{k[5:]: v for k, v in u.tensors.items() if k.startswith("ccvr/")} for u in updates.values()]
    gen = torch_generator(3, 1, NO_CLIENT, "ccvr/calibrate")
    expected = calibrate_head(model, avg, stats, cfg.ccvr_settings(), cfg, gen)
    sent = alg.configure(state, 2, [0])[0].tensors
    evaluated = alg.configure_evaluate(state, 2, [0])[0].tensors
    assert evaluated.keys() == sent.keys() == avg.keys()
    for k in avg:
        assert torch.equal(alg.global_model(state)[k], expected[k]) and torch.equal(evaluated[k], expected[k])
        assert torch.equal(sent[k], expected[k] if broadcast else avg[k]), k
    assert any(k.startswith(CALIBRATED) for k in state.tensors) != broadcast


# --- FedProto -------------------------------------------------------------------------------
def test_global_prototypes_are_the_unweighted_mean_over_the_clients_holding_each_class():
    alg = FedProto(FedProtoConfig(), mlp_factory(c=3, hidden=2), 3, seed=0)
    protos = [torch.tensor([[1.0, 2.0], [5.0, 5.0], [0.0, 0.0]]), torch.tensor([[3.0, 0.0], [0.0, 0.0], [0.0, 0.0]])]
    protos.append(torch.tensor([[8.0, 8.0], [7.0, 1.0], [0.0, 0.0]]))
    masks = [torch.tensor([True, True, False]), torch.tensor([True, False, False]), torch.tensor([False, True, False])]
    updates = {
        cid: Update({PROTOTYPES: p, MASK: m}, {"num_examples": n})  # sample counts must not weigh the mean
        for cid, (p, m, n) in enumerate(zip(protos, masks, [10, 1000, 3]))
    }
    state = alg.aggregate(alg.init_server_state(), 1, updates)
    assert state.tensors[MASK].tolist() == [True, True, False]
    expected = torch.tensor([[2.0, 1.0], [6.0, 3.0], [0.0, 0.0]])  # client 2's class-0 row is not held: ignored
    torch.testing.assert_close(state.tensors[PROTOTYPES], expected)
    assert alg.global_model(state) is None and set(state.tensors) == {PROTOTYPES, MASK}


def test_prototype_loss_is_the_reference_mse_over_all_entries():
    f = torch.tensor([[1.0, 1.0], [2.0, 0.0], [4.0, 4.0]])
    protos, mask = torch.tensor([[0.0, 1.0], [9.0, 9.0]]), torch.tensor([True, False])
    y = torch.tensor([0, 0, 1])
    # rows 0 and 1 are compared with P_0; row 2's class has no prototype: zero, but it counts in the mean
    assert float(prototype_loss(f, y, protos, mask)) == pytest.approx((1 + 0 + 4 + 1) / 6)


def test_prototype_term_pulls_features_towards_the_global_prototypes():
    factory = mlp_factory(d_in=8, hidden=16, c=4)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(120, 8, generator=gen), torch.arange(120) % 4
    data = SimpleNamespace(x_train=x, y_train=y, x_val=x[:0], y_val=y[:0])
    protos = torch.randn(4, 16, generator=gen).abs()  # reachable by ReLU features
    mask = torch.tensor([True, True, True, False])
    payload = Payload({PROTOTYPES: protos, MASK: mask}, {"round": 1})
    dist = {}
    for lam in (0.0, 5.0, 20.0):
        alg = FedProto(FedProtoConfig(lam=lam, lr=0.1, local_epochs=20), factory, 1, seed=0)
        model = factory(torch.Generator().manual_seed(0))
        ctx = ClientContext(model, torch.device("cpu"), 0, 1, 0)
        update, state = alg.client_update(payload, data, alg.init_client_state(0), ctx)
        model.load_state_dict(state.tensors)
        with torch.no_grad():
            dist[lam] = float(prototype_loss(model.features(x), y, protos, mask))
        # the uploaded prototypes are the class means of the trained model's features
        with torch.no_grad():
            feats = model.features(x)
        torch.testing.assert_close(update.tensors[PROTOTYPES][1], feats[y == 1].mean(0))
        assert update.tensors[MASK].all() and set(update.tensors) == {PROTOTYPES, MASK}
    # mean squared distance to the prototypes: 0.53 (lam 0), 0.28 (lam 5), 0.17 (lam 20)
    assert dist[0.0] > dist[5.0] > dist[20.0] and dist[20.0] < 0.5 * dist[0.0]


def client_metrics(run_dir):
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["eval"]["clients"]


def test_fedproto_with_lambda_zero_is_local_training(tmp_path):
    local = run(quick_config("algorithm.name=local", "rounds=2"), tmp_path / "local")
    proto = run(quick_config("algorithm.name=fedproto", "algorithm.lam=0", "rounds=2"), tmp_path / "proto")
    assert client_metrics(proto.run_dir) == client_metrics(local.run_dir)
    a, b = (load_checkpoint(r.run_dir / "checkpoints").client_states for r in (local, proto))
    for cid in a:
        assert all(torch.equal(v, b[cid].tensors[k]) for k, v in a[cid].tensors.items())
    # C x D prototypes and the C-entry mask of the classes the client holds: every value that travels
    assert proto.summary["communication_per_client_per_round"]["up"] == 10 * 200 + 10


@pytest.fixture(scope="module")
def fedavg_run(tmp_path_factory):
    return run(quick_config(), tmp_path_factory.mktemp("fedavg") / "r")


def test_fedproto_sharing_parameters_with_lambda_zero_trains_fedavgs_model(tmp_path, fedavg_run):
    res = run(quick_config("algorithm.name=fedproto", "algorithm.lam=0", "algorithm.share_parameters=true"), tmp_path)
    for k, v in fedavg_run.server_state.tensors.items():
        assert torch.equal(res.server_state.tensors[k], v), k
    assert res.summary["last"]["global"]["test_acc"] == fedavg_run.summary["last"]["global"]["test_acc"]


def test_post_hoc_ccvr_leaves_fedavg_training_unchanged_and_improves_its_global_model(tmp_path, fedavg_run):
    # FedAvg's global test accuracy after 4 quick rounds is 0.68; the calibrated head gives 0.87
    cfg = quick_config("algorithm.name=ccvr", "algorithm.broadcast_calibrated=false")
    full = run(cfg, tmp_path / "full")
    server = full.server_state.tensors
    for k, v in fedavg_run.server_state.tensors.items():
        assert torch.equal(server[k], v), k  # clients trained the uncalibrated FedAvg model
    assert {k for k in server if k.startswith(CALIBRATED)} == {
        CALIBRATED + "classifier.weight",
        CALIBRATED + "classifier.bias",
    }
    assert full.summary["last"]["global"]["test_acc"] > fedavg_run.summary["last"]["global"]["test_acc"] + 0.1
    run(cfg, tmp_path / "cut", stop_after=2)
    assert_runs_identical(full.run_dir, run(cfg, tmp_path / "cut", resume=True).run_dir)


@pytest.mark.parametrize(
    "name,overrides,min_acc",
    [("ccvr", ["algorithm.name=ccvr"], 0.7), ("fedproto", ["algorithm.name=fedproto"], 0.5)],
)
def test_stop_and_resume_is_bit_identical(tmp_path, name, overrides, min_acc):
    # mean personal test accuracy after 4 rounds at half participation: ccvr 0.87, fedproto 0.58
    # (Local 0.58, FedAvg 0.53: each client has trained in about two rounds)
    cfg = quick_config(*overrides, "participation=0.5")
    full = run(cfg, tmp_path / "full")
    assert full.summary["last"]["clients"]["test_acc"]["mean"] > min_acc
    run(cfg, tmp_path / "cut", stop_after=2)
    resumed = run(cfg, tmp_path / "cut", resume=True)
    assert_runs_identical(full.run_dir, resumed.run_dir)
