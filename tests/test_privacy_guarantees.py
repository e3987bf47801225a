"""What the privacy guarantees rest on, each checked against a hand-computed value or Opacus, never against
the function under test: the noise's standard deviation, epsilon at the configured delta, fresh noise at
every step, target-epsilon planning, the clip bounds, the clip count's noise, Poisson sampling and the
expected-size divisor, nothing raw in an update, SecAgg+'s range and error bound, and an attacker who holds
everything the server and a reader hold and still cannot regenerate the noise.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import quick_config, run
from torch import nn

from fedmerge.algorithms import ALGORITHMS
from fedmerge.algorithms.privacy import PrivateAlgorithm
from fedmerge.algorithms.privacy_settings import BIT_KEY, PUBLIC_META, PrivacySettings
from fedmerge.config.schema import load_config
from fedmerge.core.algorithm import ClientContext
from fedmerge.core.privacy import NoiseSource, PrivateGradients, flat_norm, new_secret, reproducible_secret
from fedmerge.core.secure_sum import SecureSumError, SumSettings, combine, quantization_range, summands
from fedmerge.core.seeding import NO_CLIENT, torch_generator
from fedmerge.core.types import ClientState, ServerState, Update

opacus = pytest.importorskip("opacus", reason="privacy needs Opacus: pip install -e '.[privacy]'")


def _private(settings: dict, inner_name: str = "fedavg", num_clients: int = 4, participation: float = 1.0,
             model=lambda g: nn.Linear(300, 40), rounds: int = 5, **cfg) -> PrivateAlgorithm:  # fmt: skip
    inner = ALGORITHMS.get(inner_name).obj(ALGORITHMS.parse({"name": inner_name, **cfg}), model, num_clients, 0)
    return PrivateAlgorithm(inner, PrivacySettings.model_validate(settings), rounds, participation)


def _updates(state: ServerState, cids: list[int], scale: float = 1.0, seed: int = 2) -> dict[int, Update]:
    gen = torch.Generator().manual_seed(seed)
    return {
        c: Update({k: v + scale * torch.randn(v.shape, generator=gen) for k, v in state.tensors.items()},
                  {"num_examples": 10})
        for c in cids
    }  # fmt: skip


# A fixed secret for the statistical checks in this file: each bound is then checked on one known draw; a fresh
# secret per run made a 2-sigma bound fail about one CI run in forty.
STATS_SECRET = "5eed" * 16


def _noise_of(a: ServerState, b: ServerState) -> torch.Tensor:
    return torch.cat([(b.tensors[k] - a.tensors[k]).flatten() for k in sorted(a.tensors)])


# --- central DP: the noise's scale and the divisor ----------------------------------------------
@pytest.mark.parametrize("adaptive", [False, True])
def test_central_noise_std_is_the_formulas(adaptive):
    """z C / (q N) without adaptive clipping; z_delta C / (q N) with it, z_delta = (z^-2 - (2 sigma_b)^-2)^-1/2
    (Andrew et al. 2021, Theorem 1), here z = 2, sigma_b = 2: z_delta = (1/4 - 1/16)^-1/2 = 4 / sqrt(3)."""
    extra = {"adaptive": True, "clip_count_stddev": 2.0} if adaptive else {}
    noisy = _private({"central": {"noise_multiplier": 2.0, "clip": 1.0, **extra}})
    clean = _private({"central": {"noise_multiplier": 0.0, "clip": 1.0}})
    state = noisy.init_server_state()
    state.meta["privacy_secret"] = STATS_SECRET
    updates = _updates(state, [0, 1, 2, 3], 0.01)  # all within the bound: the clean mean is the plain mean
    a, b = clean.aggregate(state, 1, updates), noisy.aggregate(state, 1, updates)
    by_hand = (4 / math.sqrt(3) if adaptive else 2.0) * 1.0 / 4
    assert b.meta["privacy"]["central"]["last"]["noise_std"] == pytest.approx(by_hand, rel=1e-12)
    assert float(_noise_of(a, b).std()) == pytest.approx(by_hand, rel=0.03)  # 12,040 values


def test_central_mean_divides_by_the_expected_number_of_clients_not_those_received():
    """N = 8 clients at participation 0.5: the sum of the clipped changes over q N = 4, whether 3 or 6 arrive,
    and noise z C / 4: adding or removing one client moves the release by at most C / 4."""
    alg = _private({"central": {"noise_multiplier": 0.0, "clip": 1.0}}, num_clients=8, participation=0.5)
    noisy = _private({"central": {"noise_multiplier": 1.5, "clip": 1.0}}, num_clients=8, participation=0.5)
    state = alg.init_server_state()
    for cids in ([0, 3, 5], [0, 1, 2, 4, 6, 7]):
        updates = _updates(state, cids, 0.001)
        new = alg.aggregate(state, 1, updates)
        for k, v in state.tensors.items():
            expected = v + sum(u.tensors[k] - v for u in updates.values()) / 4
            torch.testing.assert_close(new.tensors[k], expected, rtol=1e-5, atol=1e-7)
        assert noisy.aggregate(state, 1, updates).meta["privacy"]["central"]["last"]["noise_std"] == 1.5 / 4


def test_central_poisson_sampling_draws_each_client_with_probability_q_from_the_servers_secret():
    alg = _private({"central": {"noise_multiplier": 1.0}}, num_clients=50, participation=0.2)
    state = alg.init_server_state()
    state.meta["privacy_secret"] = STATS_SECRET  # the bounds below checked on one known draw
    counts = [len(alg.select_clients(state, rnd, list(range(10)))) for rnd in range(1, 401)]
    assert np.mean(counts) == pytest.approx(10, rel=0.05)  # q N
    assert np.std(counts) == pytest.approx(math.sqrt(50 * 0.2 * 0.8), rel=0.15)  # Binomial(N, q), not fixed
    other = alg.init_server_state()  # another run, the same seed: another sample
    assert [alg.select_clients(other, r, []) for r in range(1, 6)] != [alg.select_clients(state, r, []) for r in
                                                                       range(1, 6)]  # fmt: skip
    empty = alg.aggregate(state, 1, {})  # a round that sampled no client still releases (noise alone)
    assert not torch.equal(empty.tensors["weight"], state.tensors["weight"])


def test_clip_count_noise_has_the_configured_std_over_many_rounds():
    """Every update far above the bound: the unclipped count is 0, so fraction * q N is the count's noise."""
    alg = _private({"central": {"noise_multiplier": 1.0, "clip": 1e-3, "adaptive": True, "clip_count_stddev": 0.8,
                                "clip_lr": 1e-9}}, model=lambda g: nn.Linear(3, 2))  # fmt: skip
    state = alg.init_server_state()
    state.meta["privacy_secret"] = STATS_SECRET  # a 2.8-sigma bound on 400 draws: one known draw, not fresh
    noise = []
    for rnd in range(1, 401):
        state = alg.aggregate(state, rnd, _updates(state, [0, 1, 2, 3], 10.0, seed=rnd))
        noise.append(state.meta["privacy"]["central"]["last"]["unclipped_fraction"] * 4)
    assert float(np.std(noise)) == pytest.approx(0.8, rel=0.1)
    assert abs(float(np.mean(noise))) < 0.15


def test_client_side_clipping_makes_a_large_change_exactly_the_bound():
    alg = _private({"central": {"noise_multiplier": 0.0, "clip": 0.5, "clip_on_client": True}})
    state = alg.init_server_state()
    (payload,) = alg.configure(state, 1, [0]).values()
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(20, 300, generator=gen) * 10, torch.randint(0, 40, (20,), generator=gen)
    data = SimpleNamespace(x_train=x, y_train=y, x_val=x[:0], y_val=y[:0])
    update, _ = alg.client_update(payload, data, ClientState(), ClientContext(nn.Linear(300, 40), "cpu", 0, 1, 0))
    change = {k: update.tensors[k] - payload.tensors[k] for k in payload.tensors}
    assert flat_norm(change) == pytest.approx(0.5, rel=1e-5)


# --- accounting at the configured delta; planning ---------------------------------------------
def _client_data(n: int = 40, seed: int = 0) -> SimpleNamespace:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 5, generator=gen), torch.randint(0, 3, (n,), generator=gen)
    return SimpleNamespace(x_train=x, y_train=y, x_val=x[:0], y_val=y[:0])


def _dp_sgd(settings: dict, rounds: int = 3, **cfg) -> PrivateAlgorithm:
    return _private({"dp_sgd": settings}, model=lambda g: nn.Linear(5, 3), rounds=rounds, **cfg)


def _client_rounds(alg: PrivateAlgorithm, data, rounds: int) -> tuple[Update, ClientState]:
    state, client = alg.init_server_state(), ClientState()
    for rnd in range(1, rounds + 1):
        ctx = ClientContext(nn.Linear(5, 3), torch.device("cpu"), 0, rnd, 0)
        update, client = alg.client_update(alg.configure(state, rnd, [0])[0], data, client, ctx)
    return update, client


def test_dp_sgd_epsilon_is_opacus_at_the_configured_delta():
    from opacus.accountants import RDPAccountant

    alg = _dp_sgd({"noise_multiplier": 1.1, "delta": 1e-3}, batch_size=8, local_epochs=2)
    update, _ = _client_rounds(alg, _client_data(40), 2)
    accountant = RDPAccountant()
    for _ in range(2 * 2 * 5):  # rounds x epochs x 40 / 8 batches
        accountant.step(noise_multiplier=1.1, sample_rate=8 / 40)
    assert update.meta["privacy"]["epsilon"] == pytest.approx(accountant.get_epsilon(delta=1e-3), rel=1e-9)
    assert update.meta["privacy"]["epsilon"] < accountant.get_epsilon(delta=1e-5)  # the delta does matter


def test_central_epsilon_is_opacus_at_the_configured_delta():
    from opacus.accountants import RDPAccountant

    alg = _private({"central": {"noise_multiplier": 0.9, "delta": 1e-3}}, num_clients=8, participation=0.5)
    state = alg.init_server_state()
    accountant = RDPAccountant()
    for rnd in (1, 2, 3):
        state = alg.aggregate(state, rnd, _updates(state, [1, 2, 5], 0.01, seed=rnd))
        accountant.step(noise_multiplier=0.9, sample_rate=0.5)
    assert state.meta["privacy"]["central"]["last"]["epsilon"] == pytest.approx(accountant.get_epsilon(1e-3), rel=1e-9)


def test_target_epsilon_planning_spends_within_0_05_below_the_target_after_the_configured_rounds():
    from opacus.accountants import RDPAccountant

    rounds, target = 4, 6.0
    alg = _dp_sgd({"target_epsilon": target, "delta": 1e-5}, rounds=rounds, batch_size=8, local_epochs=1)
    update, _ = _client_rounds(alg, _client_data(40), rounds)
    assert target - 0.05 <= update.meta["privacy"]["epsilon"] <= target
    accountant = RDPAccountant()  # an independent ledger of what was spent
    for _ in range(rounds * 5):
        accountant.step(noise_multiplier=update.meta["privacy"]["noise_multiplier"], sample_rate=8 / 40)
    assert target - 0.05 <= accountant.get_epsilon(1e-5) <= target
    central = _private({"central": {"target_epsilon": 3.0}}, num_clients=10, participation=0.3, rounds=rounds)
    state = central.init_server_state()
    for rnd in range(1, rounds + 1):
        state = central.aggregate(state, rnd, _updates(state, [0, 4, 7], 0.01, seed=rnd))
    assert 3.0 - 0.05 <= state.meta["privacy"]["central"]["last"]["epsilon"] <= 3.0


# --- DP-SGD's step: fresh noise, Poisson batches, the expected-size divisor ---------------------
def test_dp_sgd_noise_is_fresh_at_every_step():
    torch.manual_seed(0)
    model = nn.Linear(100, 20)
    x, y = torch.randn(8, 100), torch.randint(0, 20, (8,))
    params = list(model.named_parameters())
    PrivateGradients(0.5, 0.0, NoiseSource(STATS_SECRET, 1, 0, "t")).gradients(model, params, x, y)
    clean = torch.cat([p.grad.flatten() for _, p in params])
    mech = PrivateGradients(0.5, 2.0, NoiseSource(STATS_SECRET, 1, 0, "t"))
    noises = []
    for _ in range(2):
        mech.gradients(model, params, x, y)
        noises.append(torch.cat([p.grad.flatten() for _, p in params]) - clean)
    assert not torch.equal(noises[0], noises[1])
    assert abs(float(torch.corrcoef(torch.stack(noises))[0, 1])) < 0.05  # 2,020 values: independent draws
    for n in noises:
        assert float((n * 8).std()) == pytest.approx(2.0 * 0.5, rel=0.06)


def test_dp_sgd_batches_are_poisson_samples_and_the_sum_is_divided_by_the_expected_size():
    mech = PrivateGradients(1e9, 0.0, NoiseSource(STATS_SECRET, 1, 0, "t"))
    sizes = [len(idx) for idx in mech.batches(200, 20, 2000)]  # q = 0.1
    assert np.mean(sizes) == pytest.approx(20, rel=0.02)
    assert np.std(sizes) == pytest.approx(math.sqrt(200 * 0.1 * 0.9), rel=0.1)  # Binomial, not a fixed 20
    torch.manual_seed(0)
    model = nn.Linear(4, 2).double()
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.tensor([0, 1, 1])
    params = list(model.named_parameters())
    mech.gradients(model, params, x, y, expected_batch=5.0)
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()  # no clipping at 1e9
    by_hand = [p.grad.clone() / 5 for _, p in params]
    mech.gradients(model, params, x, y, expected_batch=5.0)
    for (_, p), want in zip(params, by_hand):
        torch.testing.assert_close(p.grad, want, rtol=1e-12, atol=1e-14)


def test_an_empty_poisson_batch_is_a_step_of_noise_alone():
    model = nn.Linear(400, 10)
    params = list(model.named_parameters())
    mech = PrivateGradients(1.0, 3.0, NoiseSource(STATS_SECRET, 1, 0, "t"))
    mech.gradients(model, params, torch.zeros(0, 400), torch.zeros(0, dtype=torch.long), expected_batch=4.0)
    noise = torch.cat([p.grad.flatten() for _, p in params])
    assert float(noise.std()) == pytest.approx(3.0 / 4, rel=0.05) and mech.steps == 1


# --- nothing raw leaves under DP ----------------------------------------------------------------
CENTRAL = sorted(
    n for n in ALGORITHMS.names()
    if ALGORITHMS.get(n).config.__module__.startswith("fedmerge.algorithms.")
    and ALGORITHMS.get(n).obj.central_dp_refusal is None and n != "fedlora"
)  # fmt: skip


@pytest.mark.parametrize("name", CENTRAL)
def test_central_dp_updates_carry_no_metadata_computed_on_raw_data(name):
    from fedmerge.models import build_model

    model_cfg = load_config(None, []).model
    extra = {"local_epochs": 2} if name == "fedrep" else {}
    factory = lambda g: build_model(model_cfg, (64,), 10, generator=g)  # noqa: E731
    alg = _private({"central": {"noise_multiplier": 1.0, "clip_on_client": True}}, name, 2, model=factory,
                   batch_size=4, **extra)  # fmt: skip
    state = alg.init_server_state()
    gen = torch.Generator().manual_seed(0)
    x, y = torch.rand(9, 64, generator=gen), torch.randint(0, 10, (9,), generator=gen)
    data = SimpleNamespace(x_train=x, y_train=y, x_val=x[:3], y_val=y[:3])
    ctx = ClientContext(factory(torch.Generator().manual_seed(0)), torch.device("cpu"), 0, 1, 0)
    update, _ = alg.client_update(alg.configure(state, 1, [0])[0], data, alg.init_client_state(0), ctx)
    assert set(update.meta) <= {*PUBLIC_META, BIT_KEY}  # no loss, no alpha, nothing read off the data


# --- SecAgg+: the range refusal at its boundary, the error bound --------------------------------
def test_secure_sum_refuses_a_value_just_outside_the_clipping_range_and_accepts_its_edge():
    s = SumSettings(max_weight=100.0, clipping_range=0.5, quantization_range=2**20)
    sent = {"w": torch.zeros(3)}
    ok = summands(Update({"w": torch.tensor([0.5, -0.5, 0.25])}, {}), sent, 100.0, lambda k: False, s)
    assert np.array_equal(ok[0], [0.5, -0.5, 0.25])
    with pytest.raises(SecureSumError, match="outside the clipping range"):
        summands(Update({"w": torch.tensor([0.51, 0.0, 0.0])}, {}), sent, 100.0, lambda k: False, s)


def test_secure_sum_error_bound_is_m_steps_times_the_weight_ratio():
    s = SumSettings(max_weight=1000.0, clipping_range=8.0, quantization_range=quantization_range(3))
    assert s.quantization_range == 2**30  # 3 clients: the sum of 3 values below 2^30 stays below 2^32
    weights = {0: 10.0, 1: 20.0, 2: 30.0}
    sent = {c: {"w": torch.zeros(2)} for c in weights}
    total = [np.zeros(2)]
    _, bound = combine(total, [("w", "float32", [2])], sent, weights, lambda k: False, s)
    assert bound == pytest.approx(3 * (2 * 8.0 / 2**30) * 1000.0 / 60.0, rel=1e-12)
    _, summed_bound = combine(total, [("w", "float32", [2])], sent, weights, lambda k: True, s)
    assert summed_bound == pytest.approx(3 * (2 * 8.0 / 2**30), rel=1e-12)


# --- the attack: regenerate the noise from everything the server and a reader hold ----------------
def _guesses(seed: int, rnd: int, cid: int, purpose: str, owner: str, found: list[str]):
    """Every way an attacker could try to regenerate a noise stream: the old seed-keyed generator, the
    reproducible secret, and any hex string found in what it holds, used as a secret."""
    yield lambda shape, std: torch.normal(0.0, std, shape, generator=torch_generator(seed, rnd, cid, purpose))
    for secret in [reproducible_secret(seed, owner), *found]:
        source = NoiseSource(secret, rnd, cid, purpose)
        yield lambda shape, std, src=source: src.normal(shape, std, torch.float32)


def _hex_strings(*texts: str) -> list[str]:
    import re

    return sorted({m for t in texts for m in re.findall(r"[0-9a-f]{32,}", t)})


@pytest.mark.parametrize("reproducible", [False, True], ids=["secret", "reproducible-control"])
def test_a_server_holding_every_message_and_the_clients_data_cannot_regenerate_dp_sgd_noise(reproducible):
    """One full-batch step (q = 1, so no sampling hides anything): the server knows the payload, the update,
    the seed it sent, and (worst case) the client's data, so it computes the clipped sum itself and reads the
    noise off the update. Its best guess of the noise leaves a residual at the noise's own scale; with
    ``reproducible_noise`` (the control) the same attack recovers it exactly."""
    sigma, clip, lr, n, seed = 1.0, 0.5, 0.1, 16, 7
    settings = {"dp_sgd": {"noise_multiplier": sigma, "clip": clip}, "reproducible_noise": reproducible}
    alg = _private(settings, model=lambda g: nn.Linear(5, 3), lr=lr, batch_size=n, local_steps=1)
    alg.seed = seed
    alg.inner.seed = seed
    state = alg.init_server_state()
    data = _client_data(n)
    payload = alg.configure(state, 1, [0])[0]
    ctx = ClientContext(nn.Linear(5, 3), torch.device("cpu"), seed, 1, 0)
    update, _ = alg.client_update(payload, data, ClientState(), ctx)
    # the server's reconstruction: the clipped sum of per-sample gradients at the payload, no noise
    model = nn.Linear(5, 3)
    model.load_state_dict(payload.tensors)
    params = list(model.named_parameters())
    PrivateGradients(clip, 0.0, NoiseSource(new_secret(), 0, 0, "x")).gradients(model, params, data.x_train,
                                                                                  data.y_train, 1.0)  # fmt: skip
    seen = {k: (payload.tensors[k] - update.tensors[k]) * n / lr - p.grad for k, p in params}  # = the noise
    found = _hex_strings(repr(update.meta), repr(payload.meta), repr(state.meta.get("privacy")))
    residuals = []
    for guess in _guesses(seed, 1, 0, "dp-sgd", "client-0", found):
        residual = torch.cat([(seen[k] - guess(tuple(p.shape), sigma * clip)).flatten() for k, p in params])
        residuals.append(float(residual.std()))
    if reproducible:
        assert min(residuals) < 1e-4 * sigma * clip  # the attack works when the noise is predictable
    else:
        assert min(residuals) > 0.5 * sigma * clip  # at the noise's scale: nothing recovered


@pytest.mark.parametrize("reproducible", [False, True], ids=["secret", "reproducible-control"])
def test_a_reader_who_knows_the_seed_and_every_update_cannot_strip_central_noise(reproducible):
    """The reader holds the seed (config.yaml) and, worst case, every update of the round, so it computes the
    noise-free release and reads the noise off the published one; its guesses leave the noise's own scale."""
    seed, clip, z = 11, 0.05, 1.0
    settings = {"central": {"noise_multiplier": z, "clip": clip}, "reproducible_noise": reproducible}
    noisy = _private(settings)
    clean = _private({"central": {"noise_multiplier": 0.0, "clip": clip}})
    for alg in (noisy, clean):
        alg.seed = alg.inner.seed = seed
    state = noisy.init_server_state()
    updates = _updates(state, [0, 1, 2, 3], 0.001)
    release, reference = noisy.aggregate(state, 1, updates), clean.aggregate(state, 1, updates)
    keys = sorted(release.tensors)
    seen = {k: release.tensors[k] - reference.tensors[k] for k in keys}
    std = z * clip / 4
    report = repr(noisy.server_report(release, 1)) + repr(noisy.privacy_summary(release))
    residuals = []
    for guess in _guesses(seed, 1, NO_CLIENT, "central-dp", "server", _hex_strings(report)):
        residual = torch.cat([(seen[k] - guess(tuple(seen[k].shape), std)).flatten() for k in keys])
        residuals.append(float(residual.std()))
    if reproducible:
        assert min(residuals) < 1e-3 * std
    else:
        assert min(residuals) > 0.5 * std


def test_no_file_a_run_publishes_holds_a_noise_secret_and_its_checkpoint_keeps_them(tmp_path):
    from fedmerge.core.checkpoint import load_checkpoint

    overrides = ["rounds=2", "partition.num_clients=4", "privacy.central.noise_multiplier=1.0",
                 "privacy.dp_sgd.noise_multiplier=1.0"]  # fmt: skip
    result = run(quick_config(*overrides), tmp_path / "r")
    published = [p for p in result.run_dir.rglob("*") if p.is_file() and "checkpoints" not in p.parts]
    assert {p.name for p in published} >= {"config.yaml", "summary.json", "summary.md", "metrics.jsonl"}
    texts = [p.read_text(errors="replace") for p in published]
    ckpt = load_checkpoint(result.run_dir / "checkpoints")
    secrets = [str(ckpt.server_state.meta["privacy_secret"])]
    secrets += [str(s.meta["privacy_secret"]) for s in ckpt.client_states.values()]
    assert len(secrets) == 5 and len(set(secrets)) == 5  # the server's and each client's own
    for secret in secrets:
        assert not any(secret in t for t in texts), "a published file holds a noise secret"


def test_a_deployed_dp_sgd_client_keeps_its_secret_in_its_owner_only_state_store_and_never_sends_it(
    tmp_path, task_identity
):
    pytest.importorskip("flwr", reason="Flower absent: pip install -e '.[flower]'")
    import os
    import stat

    from test_flower_nodes import NodeGrid, deploy, export, run_store

    from fedmerge.core.state_store import StateStore

    overrides = ["partition.num_clients=3", "rounds=2", "dataset.name=digits", "algorithm.local_epochs=1",
                 "privacy.dp_sgd.noise_multiplier=1.0"]  # fmt: skip
    files = export(quick_config(*overrides), tmp_path / "clients")
    grid = NodeGrid(files, tmp_path / "state")
    deploy(tmp_path, quick_config(*overrides, "engine=flower"), grid)
    secrets = []
    for i in range(3):
        folder = run_store(tmp_path / "state" / f"node{i}")
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700  # owner only: personal models and the secret
        assert all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in folder.iterdir())
        with StateStore(folder) as store:
            (cid,) = store.ids()
            secrets.append(str(store.get(cid).meta["privacy_secret"]))
    assert len(set(secrets)) == 3
    for msg, reply in grid.received:  # nothing the server sent or received holds a secret
        for content in (msg.content, reply.content):
            text = repr([dict(r) for r in content.config_records.values()])
            text += repr([dict(r) for r in content.metric_records.values()])
            assert not any(s in text for s in secrets)
