"""Differential privacy (``privacy:``): DP-SGD in local_sgd, central DP on the server, their accounting.

The mechanisms are checked against values computed by hand (per-sample gradients by a loop of
autograd calls, clipped and averaged), the accountant against Opacus's own, the noise by its measured
standard deviation; the runs for bit-identity across workers, resume and the Flower protocol.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
import yaml
from helpers import assert_runs_identical, quick_config, run
from torch import nn
from torch.nn import functional as F

from fedmerge.algorithms import ALGORITHMS
from fedmerge.algorithms.privacy import PrivateAlgorithm
from fedmerge.algorithms.privacy_settings import PUBLIC_META, PrivacySettings, adaptive_noise_multiplier
from fedmerge.config.schema import ConfigError, load_config, to_yaml
from fedmerge.core.algorithm import ClientContext
from fedmerge.core.privacy import (
    Ledger,
    NoiseSource,
    PrivateGradients,
    clip_to_norm,
    flat_norm,
    noise_for_epsilon,
)
from fedmerge.core.training import LocalTraining, local_sgd
from fedmerge.core.types import ClientState, ServerState, Update
from fedmerge.run.results import RunStore

opacus = pytest.importorskip("opacus", reason="privacy needs Opacus: pip install -e '.[privacy]'")

DP_SGD = ["privacy.dp_sgd.noise_multiplier=1.0", "privacy.dp_sgd.clip=0.5"]
CENTRAL = ["privacy.central.noise_multiplier=0.3", "privacy.central.clip=1.0"]
ADAPTIVE = [*CENTRAL, "privacy.central.adaptive=true", "privacy.central.clip_count_stddev=1.0"]
SMALL = ["rounds=3", "partition.num_clients=4", "participation=0.5"]
REPRODUCIBLE = ["privacy.reproducible_noise=true"]  # noise from the seed: bit-identical runs, not private


def _noise(seed: int = 0) -> NoiseSource:
    """Noise from a fixed secret: the statistical bounds are checked on one known draw, not a fresh one."""
    return NoiseSource("5eed" * 16, seed, 0, "test")


DP_SGD_METHODS = {"fedavg", "fedprox", "fedavg_ft", "ditto", "fedper", "lg_fedavg", "fedrep", "fedmerge", "scaffold"}
DP_SGD_METHODS |= {"local"}
CENTRAL_METHODS = {"fedavg", "fedprox", "fedavg_ft", "ditto", "fedper", "lg_fedavg", "fedrep", "apfl", "fedlora"}
CENTRAL_METHODS |= {"superfed_mm", "superfed_lm"}


# --- accounting ------------------------------------------------------------------------------
def test_ledger_epsilon_equals_opacus_rdp_accountant_stepped_the_same_way():
    from opacus.accountants import RDPAccountant

    plan = [(1.1, 0.05, 40), (1.1, 0.05, 35), (0.8, 0.1, 12), (1.1, 0.05, 3)]  # rounds of (sigma, q, steps)
    ledger, accountant = Ledger(), RDPAccountant()
    for sigma, q, steps in plan:
        ledger.add(sigma, q, steps)
        for _ in range(steps):
            accountant.step(noise_multiplier=sigma, sample_rate=q)
    assert ledger.history == [[1.1, 0.05, 75], [0.8, 0.1, 12], [1.1, 0.05, 3]]
    assert [tuple(h) for h in ledger.history] == accountant.history
    for delta in (1e-5, 1e-3):
        assert ledger.epsilon(delta) == accountant.get_epsilon(delta=delta)
    assert Ledger().epsilon(1e-5) == 0.0 and Ledger([[0.0, 0.1, 3]]).epsilon(1e-5) == float("inf")


def test_target_epsilon_noise_spends_at_most_the_target():
    sigma = noise_for_epsilon(3.0, 1e-5, 0.1, 200)
    spent = Ledger([[sigma, 0.1, 200]]).epsilon(1e-5)
    assert 2.99 - 0.02 <= spent <= 3.0
    assert Ledger([[sigma * 0.9, 0.1, 200]]).epsilon(1e-5) > 3.0  # less noise would overspend


def test_adaptive_clipping_splits_the_noise_as_andrew_et_al():
    z, sb = 1.0, 2.0
    zd = adaptive_noise_multiplier(z, sb)
    assert zd == pytest.approx((1 - 1 / 16) ** -0.5)
    assert zd**-2 + (2 * sb) ** -2 == pytest.approx(z**-2)  # the two mechanisms compose to noise multiplier z
    with pytest.raises(ValueError, match="too small"):
        adaptive_noise_multiplier(1.0, 0.4)


# --- DP-SGD's step ---------------------------------------------------------------------------
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def _per_sample_by_hand(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[list[torch.Tensor]]:
    grads = []
    for i in range(len(y)):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad()
    return grads


def test_private_gradient_is_the_mean_of_per_sample_gradients_clipped_to_the_bound():
    model, gen = _mlp(), torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 5, dtype=torch.float64, generator=gen) * 3, torch.tensor([0, 1, 2, 0, 1, 2])
    by_hand = _per_sample_by_hand(model, x, y)
    norms = [torch.sqrt(sum((g**2).sum() for g in gs)) for gs in by_hand]
    clip = float(sorted(norms)[3])  # 3 samples are clipped, 3 are not
    clipped = [[g * min(1.0, clip / (float(n) + 1e-6)) for g in gs] for gs, n in zip(by_hand, norms)]
    for gs in clipped:  # every clipped per-sample gradient is within the bound
        assert float(torch.sqrt(sum((g**2).sum() for g in gs))) <= clip
    expected = [sum(gs[j] for gs in clipped) / len(y) for j in range(len(by_hand[0]))]
    mech = PrivateGradients(clip, 0.0, _noise())
    params = list(model.named_parameters())
    _, loss = mech.gradients(model, params, x, y)
    for (_, p), e in zip(params, expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-10, atol=1e-12)
    assert float(loss) == pytest.approx(float(F.cross_entropy(model(x), y).detach()), rel=1e-12)
    assert mech.steps == 1 and mech.batch_sizes == [6]


def test_private_gradient_noise_has_the_configured_standard_deviation():
    torch.manual_seed(0)
    model = nn.Linear(200, 50)  # 10,050 noised values: the measured std is within ~1% of the true one
    x, y = torch.randn(8, 200), torch.randint(0, 50, (8,))
    params = list(model.named_parameters())
    clean = PrivateGradients(0.7, 0.0, _noise())
    clean.gradients(model, params, x, y)
    base = [p.grad.clone() for _, p in params]
    noisy = PrivateGradients(0.7, 1.3, _noise())
    noisy.gradients(model, params, x, y)
    noise = torch.cat([((p.grad - b) * 8).flatten() for (_, p), b in zip(params, base)])  # un-divide the batch
    assert float(noise.std()) == pytest.approx(1.3 * 0.7, rel=0.03)
    assert abs(float(noise.mean())) < 0.05


@pytest.mark.parametrize("prox", [0.0, 0.5])
def test_dp_sgd_without_noise_or_clipping_is_plain_sgd(prox):
    """The per-sample path reduces to the batch gradient: noise 0, a bound no sample reaches and a batch
    size of at least n (Poisson rate 1: every sample in every step, divided by n); a loss term (FedProx's
    pull to the start) keeps its own gradient."""
    cfg = LocalTraining(lr=0.1, batch_size=10, local_epochs=6)
    x, y = torch.randn(10, 5, dtype=torch.float64), torch.randint(0, 3, (10,))
    plain, private = _mlp(), _mlp()
    start = {k: v.detach().clone() for k, v in plain.named_parameters()}

    def pull(model):
        if prox == 0:
            return None
        return lambda step: 0.5 * prox * sum(((p - start[k]) ** 2).sum() for k, p in model.named_parameters())

    local_sgd(plain, x, y, cfg, torch.Generator().manual_seed(3), extra_loss=pull(plain))
    mech = PrivateGradients(1e9, 0.0, _noise())
    stats = local_sgd(private, x, y, cfg, torch.Generator().manual_seed(3), extra_loss=pull(private), private=mech)
    for a, b in zip(plain.parameters(), private.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert mech.steps == stats.steps == 6 and mech.batch_sizes == [10] * 6  # one full batch per epoch


def test_dp_sgd_refuses_a_custom_forward():
    with pytest.raises(ValueError, match="cross-entropy loss only"):
        local_sgd(
            _mlp(), torch.randn(4, 5), torch.zeros(4, dtype=torch.long), LocalTraining(),
            torch.Generator(), forward=lambda x: x, private=PrivateGradients(1.0, 1.0, _noise()),
        )  # fmt: skip


# --- central DP ------------------------------------------------------------------------------
def test_clip_to_norm_bounds_the_norm_and_keeps_small_updates():
    big = {"a": torch.full((3,), 4.0), "b": torch.full((2, 2), -3.0)}
    clipped, norm = clip_to_norm(big, 2.0)
    assert norm == pytest.approx((3 * 16 + 4 * 9) ** 0.5)
    assert flat_norm(clipped) == pytest.approx(2.0) and flat_norm(clipped) <= 2.0 + 1e-6
    small, _ = clip_to_norm({"a": torch.ones(2)}, 5.0)
    assert torch.equal(small["a"], torch.ones(2))


def _fedavg(settings: dict, num_clients: int = 4, participation: float = 1.0) -> PrivateAlgorithm:
    from fedmerge.algorithms.fedavg import FedAvgConfig

    inner = ALGORITHMS.get("fedavg").obj(FedAvgConfig(), lambda g: nn.Linear(300, 40), num_clients, 0)
    return PrivateAlgorithm(inner, PrivacySettings.model_validate(settings), rounds=5, participation=participation)


def _updates(state: ServerState, scales: list[float]) -> dict[int, Update]:
    gen = torch.Generator().manual_seed(2)
    return {
        cid: Update({k: v + s * torch.randn(v.shape, generator=gen) for k, v in state.tensors.items()},
                    {"num_examples": 10 * (cid + 1)})
        for cid, s in enumerate(scales)
    }  # fmt: skip


def test_central_aggregate_is_the_uniform_mean_of_clipped_changes():
    alg = _fedavg({"central": {"noise_multiplier": 0.0, "clip": 1.5}})
    state = alg.init_server_state()
    updates = _updates(state, [0.001, 1.0, 2.0, 0.01])  # clients 1 and 2 exceed the bound
    new = alg.aggregate(state, 1, updates)
    changes = []
    for u in updates.values():
        change = {k: u.tensors[k] - state.tensors[k] for k in state.tensors}
        n = flat_norm(change)
        changes.append({k: v * min(1.0, 1.5 / n) for k, v in change.items()})
        assert flat_norm(changes[-1]) <= 1.5 + 1e-6
    for k, v in state.tensors.items():
        torch.testing.assert_close(new.tensors[k], v + sum(c[k] for c in changes) / 4, rtol=1e-5, atol=1e-6)
    report = alg.server_report(new, 1)["privacy"]["central"]
    assert report["clip"] == 1.5 and report["noise_std"] == 0.0


def test_central_noise_has_the_configured_standard_deviation_and_follows_the_servers_secret():
    clean, noisy = _fedavg({"central": {"noise_multiplier": 0.0}}), _fedavg({"central": {"noise_multiplier": 2.0}})
    state = noisy.init_server_state()
    updates = _updates(state, [0.1, 0.1, 0.1, 0.1])
    a, b = clean.aggregate(state, 3, updates), noisy.aggregate(state, 3, updates)
    noise = torch.cat([(b.tensors[k] - a.tensors[k]).flatten() for k in state.tensors])
    assert float(noise.std()) == pytest.approx(2.0 * 1.0 / 4, rel=0.03)  # sigma * clip / clients
    again = noisy.aggregate(state, 3, updates)  # the same state (a resumed server): the same draw
    assert all(torch.equal(again.tensors[k], b.tensors[k]) for k in state.tensors)
    other = noisy.aggregate(state, 4, updates)  # another round: another draw
    assert not torch.equal(other.tensors["weight"], b.tensors["weight"])
    fresh = noisy.init_server_state()  # another run with the same seed: another secret, another draw
    assert fresh.meta["privacy_secret"] != state.meta["privacy_secret"]
    assert not torch.equal(noisy.aggregate(fresh, 3, updates).tensors["weight"], b.tensors["weight"])


def test_adaptive_clip_moves_geometrically_towards_the_target_quantile():
    # C <- C exp(-clip_lr (unclipped fraction - target_quantile)); the count's noise (std 0.06 over 4
    # clients) moves the fraction by ~1.5% a round
    settings = {"noise_multiplier": 0.1, "clip": 0.1, "adaptive": True, "clip_count_stddev": 0.06}
    alg = _fedavg({"central": settings})
    state = alg.init_server_state()
    for rnd in range(1, 6):  # every change is far above 0.1: fraction 0, the bound grows by e^0.1 a round
        state = alg.aggregate(state, rnd, _updates(state, [1.0, 1.0, 1.0, 1.0]))
    assert state.meta["privacy"]["central"]["clip"] == pytest.approx(0.1 * math.exp(0.5), rel=0.03)
    alg = _fedavg({"central": {**settings, "clip": 100.0}})
    state = alg.init_server_state()
    for rnd in range(1, 6):  # every change is far below 100: fraction 1, the bound shrinks by e^-0.1
        state = alg.aggregate(state, rnd, _updates(state, [0.01] * 4))
    assert state.meta["privacy"]["central"]["clip"] == pytest.approx(100.0 * math.exp(-0.5), rel=0.03)


def test_client_side_clipping_sends_clipped_updates():
    alg = _fedavg({"central": {"noise_multiplier": 0.0, "clip": 0.5, "clip_on_client": True}})
    state = alg.init_server_state()
    (payload,) = alg.configure(state, 1, [0]).values()
    assert payload.meta["privacy_clip"] == 0.5
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(20, 300, generator=gen) * 10, torch.randint(0, 40, (20,), generator=gen)
    data = SimpleNamespace(x_train=x, y_train=y, x_val=x[:0], y_val=y[:0])
    ctx = ClientContext(nn.Linear(300, 40), torch.device("cpu"), 0, 1, 0)
    update, _ = alg.client_update(payload, data, ClientState(), ctx)
    change = {k: update.tensors[k] - payload.tensors[k] for k in payload.tensors}
    assert flat_norm(change) <= 0.5 + 1e-6 and update.meta["privacy_clip_bit"] is False


@pytest.mark.parametrize("name", sorted(CENTRAL_METHODS - {"fedlora"}))
def test_methods_admitting_central_dp_aggregate_a_mean_of_their_updates(name):
    """What the wrapper relies on: with equal weights, the method's aggregate of updates is their mean,
    key by key, for tensors that are the server state's."""
    from fedmerge.models import build_model

    cfg = ALGORITHMS.parse({"name": name})
    factory = lambda g: build_model(load_config(None, []).model, (64,), 10, generator=g)  # noqa: E731
    alg = ALGORITHMS.get(name).obj(cfg, factory, 3, 0)
    state = alg.init_server_state()
    payload = alg.configure(state, 1, [0])[0]
    gen = torch.Generator().manual_seed(0)
    updates = {
        c: Update({k: v + torch.randn(v.shape, generator=gen) for k, v in payload.tensors.items()},
                  {"num_examples": 1})
        for c in range(3)
    }  # fmt: skip
    new = alg.aggregate(state, 1, updates)
    for k in payload.tensors:
        assert k in state.tensors
        torch.testing.assert_close(new.tensors[k], sum(u.tensors[k] for u in updates.values()) / 3)


# --- which method admits what ----------------------------------------------------------------
def test_the_support_table():
    # the built-in methods (tests and installed plugins may register their own subclasses)
    names = {n for n in ALGORITHMS.names() if ALGORITHMS.get(n).config.__module__.startswith("fedmerge.algorithms.")}
    assert {n for n in names if ALGORITHMS.get(n).obj.dp_sgd_refusal is None} == DP_SGD_METHODS
    assert {n for n in names if ALGORITHMS.get(n).obj.central_dp_refusal is None} == CENTRAL_METHODS


@pytest.mark.parametrize("name", sorted(DP_SGD_METHODS))
def test_every_step_of_a_dp_sgd_method_is_privatised_and_counted(name):
    from fedmerge.models import build_model

    model_cfg = load_config(None, []).model
    cfg = ALGORITHMS.parse({"name": name, "batch_size": 4, "local_epochs": 2})
    factory = lambda g: build_model(model_cfg, (64,), 10, generator=g)  # noqa: E731
    inner = ALGORITHMS.get(name).obj(cfg, factory, 2, 0)
    settings = PrivacySettings.model_validate({"dp_sgd": {"noise_multiplier": 1.0}})
    alg = PrivateAlgorithm(inner, settings, rounds=2, participation=1.0)
    state = alg.init_server_state()
    gen = torch.Generator().manual_seed(0)
    x, y = torch.rand(9, 64, generator=gen), torch.randint(0, 10, (9,), generator=gen)
    data = SimpleNamespace(x_train=x, y_train=y, x_val=x[:3], y_val=y[:3])
    model = factory(torch.Generator().manual_seed(0))
    client = alg.init_client_state(0)
    for rnd in (1, 2):
        ctx = ClientContext(model, torch.device("cpu"), 0, rnd, 0)
        update, client = alg.client_update(alg.configure(state, rnd, [0])[0], data, client, ctx)
        assert set(update.meta) <= {*PUBLIC_META, "privacy"}  # no loss or statistic of the raw data is sent
    history = client.meta["privacy"]["dp_sgd"]
    assert history[0][:2] == [1.0, 4 / 9]
    assert history[0][2] == update.meta["privacy"]["steps"] == 2 * update.meta.get("steps", 4)
    assert update.meta["privacy"]["epsilon"] == Ledger(history).epsilon(1e-5) > 0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algorithm.name=superfed_mm", *DP_SGD], "privacy.dp_sgd: superfed_mm trains its federated"),
        (["algorithm.name=regmean", *DP_SGD], "privacy.dp_sgd: regmean sends statistics of its raw"),
        (["algorithm.name=fedmerge", *CENTRAL], "privacy.central: fedmerge merges the clients' models"),
        (["model.name=resnet9", *DP_SGD], "BatchNorm layers"),
        (["privacy.dp_sgd.target_epsilon=1e-4"], "privacy.dp_sgd: The privacy budget is too low"),
        ([*DP_SGD, "vectorize=true"], "vectorize: not with privacy"),
        ([*ADAPTIVE, "privacy.central.clip_on_client=true"], "not with clip_on_client"),
        ([*CENTRAL, "privacy.central.adaptive=true", "privacy.central.clip_count_stddev=0.1"], "too small"),
    ],
)
def test_refusals_are_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        run(quick_config(*SMALL, *overrides, output_dir=tmp_path), None)
    assert "\n" not in str(info.value)
    assert not any(tmp_path.iterdir())  # refused before a run folder exists


def test_section_validation_is_one_line():
    with pytest.raises(ConfigError, match="set exactly one of noise_multiplier and target_epsilon"):
        load_config(None, ["privacy.dp_sgd.clip=1.0"])
    with pytest.raises(ConfigError, match="set dp_sgd, central, secure_aggregation or several"):
        load_config(None, ["privacy={}"])


# --- runs ------------------------------------------------------------------------------------
def test_privacy_off_leaves_config_and_numbers_as_without_the_section(tmp_path):
    without = quick_config(*SMALL)
    explicit = load_config(None, ["rounds=4", "partition.num_clients=6", "algorithm.local_epochs=1", *SMALL,
                                  "privacy=null"])  # fmt: skip
    assert "privacy" not in yaml.safe_load(to_yaml(without))
    assert to_yaml(without) == to_yaml(explicit)
    a, b = run(without, tmp_path / "a"), run(explicit, tmp_path / "b")
    assert_runs_identical(a.run_dir, b.run_dir)
    assert "privacy" not in a.summary


def test_dp_run_logs_each_clients_epsilon_and_the_summary_holds_them(tmp_path):
    result = run(quick_config(*SMALL, *DP_SGD), tmp_path / "r")
    rows = RunStore(result.run_dir).read_metrics()
    spent: dict[str, float] = {}
    for row in rows:
        figures = row["server"]["privacy"]
        assert sorted(figures["dp_sgd"]["epsilon"]) == [str(c) for c in row["selected"]]
        for cid, eps in figures["dp_sgd"]["epsilon"].items():
            assert eps > spent.get(cid, 0.0)  # each round a client takes part spends more
            spent[cid] = eps
        assert figures["dp_sgd"]["epsilon_max"] == max(spent.values())
    summary = result.summary["privacy"]
    assert summary["private"] is True and "not_private" not in summary
    assert "diverged" not in result.summary  # DP withholds the training loss: NaN is not divergence
    assert summary["dp_sgd"]["epsilon"] == spent and summary["dp_sgd"]["epsilon_max"] == max(spent.values())
    worst = max(spent, key=spent.__getitem__)  # its PRV epsilon is Opacus's PRV accountant on its own ledger
    from opacus.accountants import PRVAccountant

    prv = PRVAccountant()
    prv.history = [tuple(result.server_state.meta["privacy"]["dp_sgd"]["ledger"][worst])]
    assert summary["dp_sgd"]["epsilon_max_prv"] == pytest.approx(prv.get_epsilon(1e-5, eps_error=0.01), rel=1e-6)
    assert summary["dp_sgd"]["epsilon_max_prv"] <= summary["dp_sgd"]["epsilon_max"]
    assert json.loads((result.run_dir / "summary.json").read_text())["privacy"] == summary
    assert "DP-SGD: epsilon" in (result.run_dir / "summary.md").read_text()


def test_central_dp_run_samples_in_secret_and_publishes_only_how_many_took_part(tmp_path):
    result = run(quick_config(*SMALL, *DP_SGD, *ADAPTIVE), tmp_path / "r")
    rows = RunStore(result.run_dir).read_metrics()
    for row in rows:
        assert "selected" not in row and "comm_clients" not in row and isinstance(row["participants"], int)
        figures = row["server"]["privacy"]
        assert "epsilon" not in figures["dp_sgd"]  # per-client epsilons would name the round's clients
        assert figures["central"]["round"] == row["round"] and figures["central"]["epsilon"] > 0
    summary = result.summary["privacy"]
    assert summary["central"]["rounds"] == 3 and summary["central"]["client_rate"] == 0.5
    central = Ledger([[0.3, 0.5, 3]]).epsilon(1e-5)
    assert summary["central"]["epsilon"] == central == rows[-1]["server"]["privacy"]["central"]["epsilon"]
    prv = summary["central"]["epsilon_prv"]
    assert prv is None or 0 < prv <= central * 1.05  # PRV: an estimate beside the RDP bound, not above it
    with pytest.raises(ConfigError, match="not with eval_clients=participants"):
        run(quick_config(*SMALL, *CENTRAL, "eval_clients=participants"), tmp_path / "p")


def test_reproducible_noise_is_bit_identical_on_two_workers_and_after_resume_and_says_not_private(tmp_path):
    overrides = [*SMALL, *DP_SGD, *ADAPTIVE, *REPRODUCIBLE, "algorithm.name=ditto"]
    one = run(quick_config(*overrides, "workers=1"), tmp_path / "one")
    two = run(quick_config(*overrides, "workers=2"), tmp_path / "two")
    assert_runs_identical(one.run_dir, two.run_dir)
    run(quick_config(*overrides), tmp_path / "resumed", stop_after=1)
    resumed = run(quick_config(*overrides), tmp_path / "resumed", resume=True)
    assert_runs_identical(one.run_dir, resumed.run_dir)
    assert resumed.summary["privacy"] == one.summary["privacy"]
    assert one.summary["privacy"]["private"] is False
    assert "NOT private" in (one.run_dir / "summary.md").read_text()
    assert "NOT private" in RunStore(one.run_dir).read_metrics()[0]["server"]["privacy"]["not_private"]
    from fedmerge.report.html import build_report
    from fedmerge.report.plot_privacy import privacy_table, read_curves
    from fedmerge.study.report import not_private

    assert "NOT private" in build_report([one.run_dir], tmp_path / "report.html").read_text()
    assert privacy_table(read_curves([one.run_dir])).startswith("**NOT private: 1 run(s)")
    assert not_private([(0, one.summary, one.run_dir)]) and not not_private([(0, {"privacy": {"private": True}}, "")])


def _final_weights(run_dir) -> dict[str, torch.Tensor]:
    from fedmerge.core.checkpoint import load_checkpoint

    return load_checkpoint(run_dir / "checkpoints").server_state.tensors


@pytest.mark.parametrize("mechanism", [DP_SGD, CENTRAL], ids=["dp_sgd", "central"])
def test_private_noise_differs_between_two_runs_of_one_command_and_a_resume_keeps_its_secrets(tmp_path, mechanism):
    import shutil

    overrides = [*SMALL, *mechanism, "participation=1.0"]
    a, b = run(quick_config(*overrides), tmp_path / "a"), run(quick_config(*overrides), tmp_path / "b")
    wa, wb = _final_weights(a.run_dir), _final_weights(b.run_dir)
    assert not all(torch.equal(wa[k], wb[k]) for k in wa)  # the same seed, other secrets: other noise
    run(quick_config(*overrides), tmp_path / "c", stop_after=1)
    shutil.copytree(tmp_path / "c", tmp_path / "d")
    c = run(quick_config(*overrides), tmp_path / "c", resume=True)
    d = run(quick_config(*overrides), tmp_path / "d", resume=True)
    assert_runs_identical(c.run_dir, d.run_dir)  # both continue from the secrets their checkpoint holds


def test_dp_run_through_the_flower_protocol_matches_the_local_engine(tmp_path, task_identity):
    pytest.importorskip("flwr", reason="Flower absent: pip install -e '.[flower]'")
    from test_flower_engine import FakeGrid

    overrides = [*SMALL, *DP_SGD, *CENTRAL, *REPRODUCIBLE, "privacy.central.clip_on_client=true"]
    flower = run(quick_config(*overrides, "engine=flower"), tmp_path / "flower", grid=FakeGrid(4))
    local = run(quick_config(*overrides), tmp_path / "local")
    assert_runs_identical(local.run_dir, flower.run_dir)


def test_divergence_under_dp_is_judged_by_the_validation_loss():
    from fedmerge.run.summary import divergence

    nan = float("nan")
    healthy = [{"round": 1, "train_loss": nan, "summary": {"val_nll": {"mean": 1.9}}}]
    assert divergence(healthy, 10) is None
    blown = [*healthy, {"round": 2, "train_loss": nan, "summary": {"val_nll": {"mean": 80.0}}}]
    assert "mean validation loss is 80" in divergence(blown, 10)
    reported_then_nan = [{"round": 1, "train_loss": 1.0}, {"round": 2, "train_loss": nan}]
    assert "training loss is nan" in divergence(reported_then_nan, 10)  # a loss that became NaN: diverged
