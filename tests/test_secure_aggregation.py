"""Secure aggregation (``privacy.secure_aggregation``): which methods admit it, that each admitted method's
aggregate is recovered from the round's secure sum alone, and the quantization bound.

The protocol itself (Flower's SecAgg+, its client mod and server workflow) runs in
``test_flower_secure.py``: in process through a fake Grid, and with real SuperLink and SuperNode processes.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedmerge.algorithms import ALGORITHMS
from fedmerge.config.schema import ConfigError, load_config
from fedmerge.core.algorithm import ClientContext
from fedmerge.core.secure_sum import (
    INT_SCALE,
    SecureSumError,
    SummedUpdates,
    SumSettings,
    combine,
    layout_of,
    quantization_range,
    summands,
)
from fedmerge.core.types import Update

SECURE_METHODS = {"fedavg", "fedprox", "fedavg_ft", "ditto", "scaffold", "fedper", "fedrep", "lg_fedavg", "fedlora"}
SECURE_METHODS |= {"superfed_mm", "superfed_lm", "apfl", "pfedme", "pfedmoe"}
EXACT = SumSettings(max_weight=100.0, clipping_range=1e6, quantization_range=2**30)  # no value is clipped


def test_the_support_table():
    names = {n for n in ALGORITHMS.names() if ALGORITHMS.get(n).config.__module__.startswith("fedmerge.algorithms.")}
    assert {n for n in names if ALGORITHMS.get(n).obj.secure_aggregation_refusal is None} == SECURE_METHODS


def _setup(name: str, **options):
    """The method on a small model, with token inputs for FedLoRA's LoRA model."""
    from fedmerge.models import build_model

    if name == "fedlora":
        model_cfg, shape, make_x = (
            {"name": "minilm_lora"},
            (16,),
            lambda n, g: torch.randint(0, 50, (n, 16), generator=g),
        )
    else:
        model_cfg, shape, make_x = load_config(None, []).model, (64,), lambda n, g: torch.rand(n, 64, generator=g)
    cfg = ALGORITHMS.parse({"name": name, "batch_size": 4, "local_epochs": 2, **options})
    factory = lambda g: build_model(model_cfg, shape, 4, generator=g)  # noqa: E731
    return ALGORITHMS.get(name).obj(cfg, factory, 5, 0), factory, make_x


def _round(alg, factory, make_x, sizes: list[int]):
    """Round 1's payloads and the updates of clients 0..len(sizes)-1, each trained on its own random data."""
    state = alg.init_server_state()
    cids = list(range(len(sizes)))
    payloads = alg.configure(state, 1, cids)
    model = factory(torch.Generator().manual_seed(0))
    updates = {}
    for cid, n in zip(cids, sizes):
        gen = torch.Generator().manual_seed(cid)
        x, y = make_x(n, gen), torch.randint(0, 4, (n,), generator=gen)
        data = SimpleNamespace(x_train=x, y_train=y, x_val=x[:2], y_val=y[:2])
        ctx = ClientContext(model, torch.device("cpu"), 0, 1, cid)
        updates[cid], _ = alg.client_update(payloads[cid], data, alg.init_client_state(cid), ctx)
    return state, payloads, updates


def secure_aggregate(alg, state, payloads, updates, settings=EXACT, noise=None):
    """The server's aggregate from the sum of the clients' vectors (exact, or with ``noise(total)`` added)."""
    vectors = {c: summands(u, payloads[c].tensors, alg.secure_weight(u.meta), alg.secure_summed, settings)
               for c, u in updates.items()}  # fmt: skip
    total = [sum(parts) for parts in zip(*vectors.values())]
    if noise is not None:
        total = noise(total)
    weights = {c: alg.secure_weight(u.meta) for c, u in updates.items()}
    layout = layout_of(next(iter(updates.values())))
    tensors, bound = combine(total, layout, {c: p.tensors for c, p in payloads.items()}, weights,
                             alg.secure_summed, settings)  # fmt: skip
    n = sum(u.num_examples for u in updates.values())
    summed = SummedUpdates(Update(tensors, {"num_examples": n}), {c: u.meta for c, u in updates.items()}, bound)
    return alg.aggregate_summed(state, 1, summed), bound


@pytest.mark.parametrize(
    "name, options",
    [(n, {}) for n in sorted(SECURE_METHODS)]
    + [("ditto", {"weighting": "uniform"}), ("scaffold", {"weighting": "uniform"}), ("pfedme", {"beta": 1.5})],
)
def test_the_aggregate_from_the_secure_sum_equals_the_aggregate_of_the_updates(name, options):
    """Clients of different sizes (so the weights matter), real client updates (SCAFFOLD's control-variate
    changes, partial models, adapters): the server's state from the sum alone equals the plain aggregate."""
    alg, factory, make_x = _setup(name, **options)
    state, payloads, updates = _round(alg, factory, make_x, [5, 9, 14])
    plain = alg.aggregate(state, 1, updates)
    secure, _ = secure_aggregate(alg, state, payloads, updates)
    assert plain.tensors.keys() == secure.tensors.keys()
    changed = 0
    for k, v in plain.tensors.items():
        torch.testing.assert_close(secure.tensors[k], v, rtol=0, atol=2e-6)
        changed += int(not torch.equal(v, state.tensors[k]))
    assert changed > 0  # the round moved the server state: the comparison is not trivially equal


def test_the_quantization_error_stays_within_the_bound():
    """Every value of the sum off by just under m quantization steps (the worst stochastic rounding)."""
    alg, factory, make_x = _setup("scaffold")
    state, payloads, updates = _round(alg, factory, make_x, [5, 9, 14])
    settings = SumSettings(max_weight=20.0, clipping_range=8.0, quantization_range=quantization_range(3))
    worst = 0.999 * 3 * settings.step
    plain = alg.aggregate(state, 1, updates)
    secure, bound = secure_aggregate(alg, state, payloads, updates, settings, lambda t: [x + worst for x in t])
    mean_bound = 3 * settings.step * 20.0 / 28  # a mean: m * step * W / sum of weights
    assert bound == pytest.approx(max(mean_bound, 3 * settings.step))  # a sum: m * step
    for k, v in plain.tensors.items():
        err = float((secure.tensors[k].double() - v.double()).abs().max())
        # SCAFFOLD's server adds the summed control changes / N: their error is m * step / N
        allowed = mean_bound if not k.startswith("control/") else 3 * settings.step / alg.num_clients
        assert err <= allowed + 1e-6 * float(v.abs().max()) + 1e-7, k
        assert err >= 0.5 * allowed, k  # the shift is felt: the bound is not loose by orders of magnitude


def test_quantization_range_keeps_the_sum_below_the_modulus():
    for m in (2, 3, 4, 7, 8, 100, 1000):
        q = quantization_range(m)
        assert m * q < 2**32  # the sum of m values in [0, q] is recovered exactly
        assert q == 2**30 or 2 * m * q >= 2**32  # the finest such power of two (int32 caps it at 2**30)


def test_integer_tensors_enter_scaled_and_come_back_rounded():
    sent = {"w": torch.zeros(2), "count": torch.tensor(100, dtype=torch.int64)}
    count = lambda n: torch.tensor(n, dtype=torch.int64)  # noqa: E731
    updates = {0: Update({"w": torch.tensor([1.0, -1.0]), "count": count(140)}, {}),
               1: Update({"w": torch.tensor([3.0, 0.5]), "count": count(103)}, {})}  # fmt: skip
    weights = {0: 1.0, 1: 3.0}
    vectors = [summands(u, sent, weights[c], lambda k: False, EXACT) for c, u in updates.items()]
    assert float(vectors[0][0]) == pytest.approx(40 / 100 / INT_SCALE)  # (w / W) * change / scale
    total = [a + b for a, b in zip(*vectors)]
    out, _ = combine(total, layout_of(updates[0]), {0: sent, 1: sent}, weights, lambda k: False, EXACT)
    torch.testing.assert_close(out["w"], torch.tensor([2.5, 0.125]))
    assert out["count"].dtype == torch.int64 and int(out["count"]) == round((140 + 3 * 103) / 4)


def test_a_client_refuses_what_the_protocol_would_clip_in_one_line():
    tight = SumSettings(max_weight=10.0, clipping_range=0.5, quantization_range=2**20)
    update = Update({"w": torch.tensor([4.0])}, {"num_examples": 10})
    with pytest.raises(SecureSumError, match=r"'w' enters the sum as 4, outside the clipping range ±0.5") as info:
        summands(update, {}, 10.0, lambda k: False, tight)
    assert "\n" not in str(info.value)
    with pytest.raises(SecureSumError, match="weight 11 .* exceeds privacy.secure_aggregation.max_weight=10"):
        summands(update, {}, 11.0, lambda k: False, tight)
    with pytest.raises(SecureSumError, match="outside the clipping range"):
        summands(Update({"w": torch.tensor([float("nan")])}, {}), {}, 1.0, lambda k: False, tight)
    assert np.allclose(summands(update, {"w": torch.tensor([3.9])}, 10.0, lambda k: False, tight), [0.1])


SECURE = ["privacy.secure_aggregation.max_weight=1000", "rounds=1", "partition.num_clients=3"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algorithm.name=fedmerge", "engine=flower"], "privacy.secure_aggregation: fedmerge learns each client's"),
        (["algorithm.name=ifca", "engine=flower"], "privacy.secure_aggregation: ifca averages per cluster"),
        (["algorithm.name=regmean", "engine=flower"], "privacy.secure_aggregation: regmean merges with each client"),
        (["engine=flower", "privacy.central.noise_multiplier=1.0"], "not with privacy.central, whose server clips"),
        ([], "privacy.secure_aggregation: needs engine=flower"),
    ],
)
def test_refusals_are_one_line(tmp_path, overrides, message):
    from helpers import run

    cfg = load_config(None, [*SECURE, *overrides, f"output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=message) as info:
        run(cfg, None)
    assert "\n" not in str(info.value)
    assert not any(tmp_path.iterdir())


def test_secure_aggregation_is_left_out_of_a_dp_runs_config():
    from fedmerge.config.schema import to_yaml

    text = to_yaml(load_config(None, ["privacy.dp_sgd.noise_multiplier=1.0"]))
    assert "secure_aggregation" not in text and "dp_sgd" in text
    assert "max_weight: 1000.0" in to_yaml(load_config(None, SECURE))
