"""Clients that never train (``split.unseen_clients``, issue #36): they never reach training, aggregation or the
choice of the best round; each method onboards them by its own rule; the same numbers on every engine and after a
resume."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import yaml
from by_hand import ce_gradient
from helpers import assert_runs_identical, quick_config, run, strip_timing

from fedmerge.algorithms.ditto import Ditto, DittoConfig
from fedmerge.algorithms.fedavg import FedAvg, FedAvgConfig
from fedmerge.algorithms.fedem import FedEM, FedEMConfig
from fedmerge.algorithms.fedmerge import FedMerge, FedMergeConfig
from fedmerge.algorithms.fedper import FedPer, FedPerConfig
from fedmerge.algorithms.ifca import IFCA, IFCAConfig
from fedmerge.config.schema import ConfigError, load_config, to_yaml
from fedmerge.core.algorithm import ADAPT_EPOCHS, ClientContext
from fedmerge.core.checkpoint import load_checkpoint
from fedmerge.core.seeding import torch_generator
from fedmerge.core.training import LocalTraining, local_sgd
from fedmerge.core.types import Payload
from fedmerge.data import ClientData, SplitConfig
from fedmerge.data.unseen import seen_first, unseen_count, unseen_ids
from fedmerge.engines.local import LocalEngine
from fedmerge.models import build_model
from fedmerge.models.mlp import MLPConfig
from fedmerge.run.prepare import load_data
from fedmerge.run.results import RunStore
from fedmerge.run.runner import run_experiment
from fedmerge.run.summary import build_summary

UNSEEN = ["split.unseen_clients=2", "unseen.adapt_epochs=1"]


# --- which clients ---------------------------------------------------------------------------------------------
def test_unseen_clients_are_a_seeded_draw_of_a_fraction_or_a_count():
    assert unseen_count(10, 0) == 0 and unseen_count(10, 0.25) == 2 and unseen_count(10, 3) == 3
    assert unseen_ids(10, 3, seed=0) == unseen_ids(10, 3, seed=0)  # the seed alone: the same for every method
    assert len(set(unseen_ids(10, 3, seed=0))) == 3
    assert any(unseen_ids(10, 3, seed=s) != unseen_ids(10, 3, seed=0) for s in range(1, 5))
    with pytest.raises(ValueError, match="at least one must train"):
        unseen_count(4, 4)
    assert seen_first(["a", "b", "c", "d"], [1, 3]) == ["a", "c", "b", "d"]
    with pytest.raises(ValueError, match="whole count"):
        SplitConfig(unseen_clients=2.5)
    # left out of config.yaml at 0, so that older run folders keep their config digest
    assert "unseen_clients" not in yaml.safe_load(to_yaml(load_config(None, [])))["split"]
    assert yaml.safe_load(to_yaml(load_config(None, ["split.unseen_clients=2"])))["split"]["unseen_clients"] == 2


def test_dataset_puts_the_unseen_clients_last_with_their_own_data():
    cfg = quick_config("partition.num_clients=6")
    plain = load_data(cfg)
    data = load_data(quick_config("partition.num_clients=6", "split.unseen_clients=2"))
    origin = unseen_ids(6, 2, cfg.seed)
    assert data.unseen_origin == origin and data.num_participants == 4
    order = [c for c in range(6) if c not in origin] + origin
    for pos, original in enumerate(order):
        assert data.clients[pos].cid == pos
        assert torch.equal(data.clients[pos].x_train, plain.clients[original].x_train)
        assert torch.equal(data.clients[pos].y_test, plain.clients[original].y_test)


def test_unseen_section_needs_unseen_clients(tmp_path):
    with pytest.raises(ConfigError, match="split.unseen_clients"):
        run(quick_config("unseen.adapt_epochs=1", output_dir=tmp_path), tmp_path / "r")


# --- they never reach training ----------------------------------------------------------------------------------
@pytest.mark.parametrize("algo", ["fedavg", "fedmerge", "ditto", "ifca"])
def test_unseen_clients_change_nothing_the_federation_trains(tmp_path, monkeypatch, algo):
    """A run with newcomers equals, bit for bit (server state, client states, participants' metrics), the run
    whose data are the participants' alone; newcomers appear in no fit call and own no client state; poisoning
    their data changes their own metrics only."""
    fit_cids: list[int] = []
    fit = LocalEngine.fit

    def spy(self, algorithm, rnd, payloads):
        fit_cids.extend(payloads)
        return fit(self, algorithm, rnd, payloads)

    monkeypatch.setattr(LocalEngine, "fit", spy)
    cfg = quick_config(f"algorithm.name={algo}", *UNSEEN, "participation=0.5")
    data = load_data(cfg)
    with_new = run(cfg, tmp_path / "with", data=data)
    assert fit_cids and set(fit_cids) <= set(range(4))  # 6 clients, 2 never train
    alone = replace(data, clients=list(data.clients)[:4], unseen_origin=[])
    without = run(quick_config(f"algorithm.name={algo}", "participation=0.5"), tmp_path / "without", data=alone)
    # poisoned newcomers: shuffled training labels, features scaled (the standardisation must not see them)
    poisoned = list(data.clients)
    for c in (4, 5):
        y = poisoned[c].y_train
        poisoned[c] = replace(poisoned[c], x_train=poisoned[c].x_train * 100, y_train=(y + 1) % 10)
    run(cfg, tmp_path / "poisoned", data=replace(data, clients=poisoned))

    def participants(rows):
        return [{k: v for k, v in r.items() if not k.endswith("_unseen")} for r in strip_timing(rows)]

    rows = {name: RunStore(tmp_path / name).read_metrics() for name in ("with", "without", "poisoned")}
    assert participants(rows["with"]) == participants(rows["without"]) == participants(rows["poisoned"])
    assert all(sorted(r["eval_unseen"]["clients"]) == ["4", "5"] for r in rows["with"])
    assert rows["with"][-1]["eval_unseen"] != rows["poisoned"][-1]["eval_unseen"]  # the poison did reach them
    ckpts = [load_checkpoint(tmp_path / name / "checkpoints") for name in ("with", "without", "poisoned")]
    for k, v in ckpts[0].server_state.tensors.items():
        assert torch.equal(v, ckpts[1].server_state.tensors[k]) and torch.equal(v, ckpts[2].server_state.tensors[k])
    assert set(ckpts[0].client_states) == set(ckpts[1].client_states) <= set(range(4))
    assert with_new.summary["unseen_clients"] == {"count": 2, "adapt_epochs": 1}
    assert without.summary["best_val"]["round"] == with_new.summary["best_val"]["round"]


def test_standardisation_uses_the_participants_training_rows_only():
    from fedmerge.data.federated import federate
    from fedmerge.data.noise import NoiseConfig
    from fedmerge.data.partitioners import PARTITIONERS
    from fedmerge.data.pool import Pool

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(120, 3, generator=gen).numpy(), (torch.arange(120) % 3).numpy()
    part = PARTITIONERS.parse({"name": "iid", "num_clients": 4})
    split = SplitConfig(unseen_clients=1)
    pool = Pool(x=x, y=y, num_classes=3, name="t", standardize=True)
    data = federate(pool, part, split, NoiseConfig(), seed=0)
    (newcomer,) = data.unseen_origin
    from fedmerge.data.federated import compute_partition

    rows = compute_partition(pool, part, 0).indices[newcomer]
    x2 = x.copy()
    x2[rows] *= 1000.0  # the newcomer's features, wildly different
    data2 = federate(replace(pool, x=x2), part, split, NoiseConfig(), seed=0)
    for a, b in zip(data.clients[:3], data2.clients[:3]):
        assert torch.equal(a.x_train, b.x_train) and torch.equal(a.x_test, b.x_test)
    assert not torch.equal(data.clients[3].x_train, data2.clients[3].x_train)


def test_best_round_is_chosen_on_participants_and_gap_read_there():
    def row(rnd, val_nll, acc, unseen_val_nll, unseen_acc):
        metric = {"mean": 0.0, "weighted_mean": 0.0, "std": 0.0, "worst10": 0.0}
        return {
            "round": rnd,
            "comm_down": 1.0,
            "comm_up": 1.0,
            "eval": {"clients": {}},
            "summary": {"val_nll": {**metric, "mean": val_nll}, "test_acc": {**metric, "mean": acc}},
            "summary_unseen": {
                "val_nll": {**metric, "mean": unseen_val_nll},
                "test_acc": {**metric, "mean": unseen_acc},
            },
        }

    # the newcomers' validation loss is lowest in round 1, the participants' in round 2
    summary = build_summary([row(1, 0.9, 0.5, 0.1, 0.45), row(2, 0.5, 0.7, 2.0, 0.4)], {})
    assert summary["best_val"]["round"] == 2
    assert summary["best_val"]["unseen"]["test_acc"]["mean"] == 0.4
    assert summary["best_val"]["participation_gap"]["test_acc"] == pytest.approx(0.7 - 0.4)


# --- each method's rule -------------------------------------------------------------------------------------------
def linear_factory(generator: torch.Generator) -> torch.nn.Module:
    return build_model(MLPConfig(hidden=()), (4,), 2, generator=generator)


def two_task_problem(flip: bool, n: int = 64) -> ClientData:
    """Labels by the sign of x_0 (or its opposite): model ``+w`` solves one task, ``-w`` the other."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=gen)
    y = ((x[:, 0] > 0) != flip).long()
    return ClientData(cid=9, x_train=x, y_train=y, x_val=x[:0], y_val=y[:0], x_test=x, y_test=y)


def solver(sign: float) -> dict[str, torch.Tensor]:
    return {
        "classifier.weight": sign * torch.tensor([[-2.0, 0, 0, 0], [2.0, 0, 0, 0]]),
        "classifier.bias": torch.zeros(2),
    }


def context(cid: int = 9) -> ClientContext:
    return ClientContext(linear_factory(torch.Generator().manual_seed(0)), torch.device("cpu"), 0, 3, cid)


def onboard_payload(tensors: dict[str, torch.Tensor], epochs: int) -> Payload:
    return Payload(tensors, {"round": 3, ADAPT_EPOCHS: epochs})


def test_linear_factory_matches_solver_keys():
    assert set(linear_factory(torch.Generator()).state_dict()) == set(solver(1.0))


@pytest.mark.parametrize("flip", [False, True])
def test_ifca_newcomer_joins_the_cluster_that_fits_its_data(flip):
    ifca = IFCA(IFCAConfig(num_clusters=2), linear_factory, 4, 0)
    from fedmerge.algorithms._multimodel import pack

    payload = onboard_payload(pack([solver(1.0), solver(-1.0)]), 0)
    got = ifca.onboard(payload, two_task_problem(flip), context())
    assert torch.equal(got["classifier.weight"], solver(-1.0 if flip else 1.0)["classifier.weight"])


def test_one_cluster_one_component_one_model_onboard_as_fedavg():
    """IFCA k=1 and FedMerge d=1 (any budget) and FedEM M=1 (no budget) give a newcomer FedAvg's model."""
    from fedmerge.algorithms._multimodel import pack

    data = two_task_problem(False)
    start = {k: v + 0.1 for k, v in solver(1.0).items()}
    fedavg = FedAvg(FedAvgConfig(lr=0.1), linear_factory, 4, 0)
    for epochs in (0, 2):
        expected = fedavg.onboard(onboard_payload(start, epochs), data, context())
        ifca = IFCA(IFCAConfig(num_clusters=1, lr=0.1), linear_factory, 4, 0)
        assert_same(ifca.onboard(onboard_payload(pack([start]), epochs), data, context()), expected)
        fm = FedMerge(FedMergeConfig(num_models=1, lr=0.1), linear_factory, 4, 0)
        theta = torch.empty(1, fm.layout.num_floats)
        fm.layout.flatten_into(start, theta[0])
        payload = onboard_payload({"theta": theta, "counters": torch.zeros(1, 0, dtype=torch.int64)}, epochs)
        assert_same(fm.onboard(payload, data, context()), expected)
    fedem = FedEM(FedEMConfig(num_components=1), linear_factory, 4, 0)
    assert_same(fedem.onboard(onboard_payload(pack([start]), 0), data, context()), start)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("flip", [False, True])
def test_fedmerge_newcomer_logits_favour_the_model_of_its_own_task(flip):
    fm = FedMerge(FedMergeConfig(num_models=2, lr=0.1, onboard_lr=1.0), linear_factory, 4, 0)
    theta = torch.empty(2, fm.layout.num_floats)
    fm.layout.flatten_into({k: 0.3 * v for k, v in solver(1.0).items()}, theta[0])
    fm.layout.flatten_into({k: 0.3 * v for k, v in solver(-1.0).items()}, theta[1])
    payload = onboard_payload({"theta": theta, "counters": torch.zeros(2, 0, dtype=torch.int64)}, 2)
    data = two_task_problem(flip)
    weights = torch.softmax(fm.newcomer_logits(payload, data, context()), 0)
    own = 1 if flip else 0
    assert weights[own] > 0.8, weights
    # no budget: a participant's start, uniform weights
    assert torch.equal(
        fm.newcomer_logits(onboard_payload(payload.tensors, 0), data, context()), torch.zeros(2).double()
    )
    variants = fm.onboard_variants(payload, data, context())
    assert set(variants) == {"", "merge_only"}
    merged = theta[0] * weights[0].float() + theta[1] * weights[1].float()
    flat = torch.empty(fm.layout.num_floats)
    fm.layout.flatten_into(variants["merge_only"], flat)
    torch.testing.assert_close(flat, merged)


def fedmerge_payload(fm: FedMerge, models: list[dict[str, torch.Tensor]], epochs: int) -> Payload:
    theta = torch.empty(len(models), fm.layout.num_floats)
    for j, m in enumerate(models):
        fm.layout.flatten_into(m, theta[j])
    return onboard_payload({"theta": theta, "counters": torch.zeros(len(models), 0, dtype=torch.int64)}, epochs)


THREE = [{k: 0.3 * v for k, v in solver(1.0).items()}, {k: 0.3 * v for k, v in solver(-1.0).items()},
         {"classifier.weight": torch.tensor([[0.1, -0.2, 0.3, 0.0], [0.0, 0.2, -0.1, 0.4]]),
          "classifier.bias": torch.tensor([0.05, -0.05])}]  # fmt: skip


def test_fedmerge_fixed_newcomer_keeps_its_seeded_models_and_learns_no_logits():
    """merge_weights: fixed freezes every client's merge, a newcomer's too: whatever the budget, its logits are
    0 on the fixed_k models a participant with its id is given and -inf elsewhere, and its merge is the plain
    mean of those models. With fixed_k=2 of 3 the two finite logits would move under SGD (with one they
    could not: a single finite logit has no gradient)."""
    cfg = FedMergeConfig(num_models=3, merge_weights="fixed", fixed_k=2, lr=0.1, onboard_lr=1.0, batch_size=64)
    fm = FedMerge(cfg, linear_factory, 10, 0)
    participant = fm.init_server_state().tensors["logits"][9]  # client 9's seeded models, as a participant
    chosen = torch.isfinite(participant).nonzero().flatten().tolist()
    assert len(chosen) == 2 and participant[chosen].eq(0).all()
    data = two_task_problem(True)
    for epochs in (0, 1, 3):
        logits = fm.newcomer_logits(fedmerge_payload(fm, THREE, epochs), data, context())
        assert torch.equal(logits, participant), (epochs, logits)
    merged = fm.onboard_variants(fedmerge_payload(fm, THREE, 2), data, context())["merge_only"]
    for k in merged:
        torch.testing.assert_close(merged[k], (THREE[chosen[0]][k] + THREE[chosen[1]][k]) / 2)


def test_fedmerge_dynamic_newcomer_takes_the_hand_computed_logit_step():
    """merge_weights: dynamic: one full-batch epoch is one SGD step on the logits a (from 0) of the task loss of
    softmax(a) @ Theta. By hand: with g_j = <dL/dtheta, Theta_j> at the merged model theta, dL/da_j =
    w_j (g_j - sum_k w_k g_k)."""
    cfg = FedMergeConfig(num_models=3, lr=0.1, onboard_lr=1.0, batch_size=64)
    fm = FedMerge(cfg, linear_factory, 10, 0)
    data = two_task_problem(True)
    got = fm.newcomer_logits(fedmerge_payload(fm, THREE, 1), data, context())
    w = torch.full((3,), 1 / 3, dtype=torch.float64)
    weight = sum(w[j] * THREE[j]["classifier.weight"].double() for j in range(3))
    bias = sum(w[j] * THREE[j]["classifier.bias"].double() for j in range(3))
    d_weight, d_bias = ce_gradient(weight, bias, data.x_train, data.y_train)
    g = torch.stack([(d_weight * m["classifier.weight"].double()).sum() + (d_bias * m["classifier.bias"].double()).sum()
                     for m in THREE])  # fmt: skip
    expected = -cfg.onboard_lr * w * (g - (w * g).sum())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    assert expected.abs().min() > 1e-3  # a step every logit takes


@pytest.mark.parametrize("flip", [False, True])
def test_fedem_newcomer_mixture_weights_by_em_favour_its_component(flip):
    from fedmerge.algorithms._multimodel import pack

    fedem = FedEM(FedEMConfig(num_components=2), linear_factory, 4, 0)
    payload = onboard_payload(pack([solver(1.0), solver(-1.0)]), 3)
    pi = fedem.newcomer_pi(payload, two_task_problem(flip), context())
    assert pi[1 if flip else 0] > 0.95, pi
    uniform = fedem.newcomer_pi(onboard_payload(payload.tensors, 0), two_task_problem(flip), context())
    assert torch.equal(uniform, torch.full((2,), 0.5, dtype=torch.float64))


def test_ditto_newcomer_is_a_hand_run_of_its_objective_from_the_global_model():
    cfg = DittoConfig(lr=0.05, lam=0.5, batch_size=16)
    ditto = Ditto(cfg, linear_factory, 4, 0)
    start = {k: v + 0.2 for k, v in solver(1.0).items()}
    data = two_task_problem(True)
    got = ditto.onboard(onboard_payload(start, 2), data, context())
    # by hand: v from the global model, SGD on CE(v) + lam/2 ||v - w_global||^2, the client's "train" stream
    model = linear_factory(torch.Generator())
    model.load_state_dict(start)

    def prox(_step):
        return 0.5 * cfg.lam * sum(((p - start[n]) ** 2).sum() for n, p in model.named_parameters())

    epochs = LocalTraining(lr=cfg.lr, local_epochs=2, batch_size=cfg.batch_size)
    local_sgd(model, data.x_train, data.y_train, epochs, torch_generator(0, 3, 9, "train"), extra_loss=prox)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-7)
    assert_same(ditto.onboard(onboard_payload(start, 0), data, context()), start)  # no budget: the global model


def test_fedper_newcomer_trains_its_head_on_the_frozen_body():
    """The shared body as received; the head (its common initialisation) takes SGD steps on the cross-entropy
    of the frozen features: by hand, one full batch per epoch."""
    factory = lambda g: build_model(MLPConfig(hidden=(8,)), (4,), 2, generator=g)  # noqa: E731
    fedper = FedPer(FedPerConfig(lr=0.1, batch_size=64), factory, 4, 0)
    body = {k: v + 0.1 for k, v in fedper.init_server_state().tensors.items()}  # not the initial body
    ctx = ClientContext(factory(torch.Generator().manual_seed(0)), torch.device("cpu"), 0, 3, 9)
    data = two_task_problem(False)
    got = fedper.onboard(onboard_payload(body, 2), data, ctx)
    head = fedper.init_client_state(9).tensors
    assert set(head) == {"classifier.weight", "classifier.bias"} and set(body) == {"body.1.weight", "body.1.bias"}
    assert all(torch.equal(got[k], v) for k, v in body.items())  # the shared body as received
    features = torch.relu(data.x_train.double() @ body["body.1.weight"].double().T + body["body.1.bias"].double())
    weight, bias = head["classifier.weight"].double(), head["classifier.bias"].double()
    for _epoch in range(2):
        d_weight, d_bias = ce_gradient(weight, bias, features, data.y_train)
        weight, bias = weight - 0.1 * d_weight, bias - 0.1 * d_bias
    torch.testing.assert_close(got["classifier.weight"].double(), weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["classifier.bias"].double(), bias, rtol=1e-5, atol=1e-6)
    assert_same(fedper.onboard(onboard_payload(body, 0), data, ctx), {**body, **head})


@pytest.mark.parametrize("algo", ["fedavg_ft", "fedmerge"])
def test_further_budgets_are_the_runs_of_those_budgets_from_one_training(tmp_path, algo):
    """unseen.also_adapt_epochs: the newcomers at budget 1 in a run that onboards them at 0 and 1 are, bit for
    bit, the newcomers of a run at budget 1; everything else equals the run at budget 0 alone."""
    base = [f"algorithm.name={algo}", "split.unseen_clients=2"]
    both = run(quick_config(*base, "unseen.adapt_epochs=0", "unseen.also_adapt_epochs=[1]"), tmp_path / "both")
    zero = run(quick_config(*base, "unseen.adapt_epochs=0"), tmp_path / "zero")
    one = run(quick_config(*base, "unseen.adapt_epochs=1"), tmp_path / "one")
    rows = {k: RunStore(r.run_dir).read_metrics() for k, r in (("both", both), ("zero", zero), ("one", one))}
    evaluated = [i for i, r in enumerate(rows["both"]) if "eval_unseen" in r]
    assert evaluated and all("eval_unseen_adapt1" in rows["both"][i] for i in evaluated)
    for i in evaluated:
        assert strip_timing(rows["both"][i]["eval_unseen_adapt1"]) == strip_timing(rows["one"][i]["eval_unseen"])
        assert rows["both"][i]["summary_unseen_adapt1"] == rows["one"][i]["summary_unseen"]
        assert rows["one"][i]["eval_unseen"] != rows["zero"][i]["eval_unseen"]  # the budget changes the newcomers
    extra = ("eval_unseen_adapt1", "summary_unseen_adapt1")
    assert strip_timing([{k: v for k, v in r.items() if k not in extra} for r in rows["both"]]) == strip_timing(
        rows["zero"]
    )
    best, one_best, zero_best = (
        json.loads((r.run_dir / "summary.json").read_text())["best_val"] for r in (both, one, zero)
    )
    assert best["round"] == one_best["round"] and best["unseen_adapt1"] == one_best["unseen"]
    assert best["participation_gap_adapt1"] == one_best["participation_gap"]
    assert best["unseen"] == zero_best["unseen"] and best["participation_gap"] == zero_best["participation_gap"]


def test_adapt_lr_changes_the_newcomers_only(tmp_path):
    base = ["algorithm.name=fedavg", "algorithm.lr=0.1", "split.unseen_clients=2", "unseen.adapt_epochs=1"]
    plain = run(quick_config(*base), tmp_path / "plain")
    same = run(quick_config(*base, "unseen.adapt_lr=0.1"), tmp_path / "same")  # the method's own lr again
    assert_runs_identical(plain.run_dir, same.run_dir)
    slow = run(quick_config(*base, "unseen.adapt_lr=0.01"), tmp_path / "slow")
    rows = {k: RunStore(r.run_dir).read_metrics() for k, r in (("plain", plain), ("slow", slow))}
    drop = ("eval_unseen", "summary_unseen")
    assert strip_timing([{k: v for k, v in r.items() if k not in drop} for r in rows["slow"]]) == strip_timing(
        [{k: v for k, v in r.items() if k not in drop} for r in rows["plain"]]
    )
    assert rows["slow"][-1]["eval_unseen"] != rows["plain"][-1]["eval_unseen"]


def test_further_budgets_are_checked_and_left_out_of_config_yaml_when_none():
    with pytest.raises(ConfigError, match="each budget once"):
        load_config(None, ["split.unseen_clients=2", "unseen.adapt_epochs=2", "unseen.also_adapt_epochs=[1,2]"])
    with pytest.raises(ConfigError, match="each budget once"):
        load_config(None, ["split.unseen_clients=2", "unseen.also_adapt_epochs=[1,1]"])
    plain = yaml.safe_load(to_yaml(load_config(None, ["split.unseen_clients=2", "unseen.adapt_epochs=1"])))
    assert plain["unseen"] == {"adapt_epochs": 1}  # run folders made before the option keep their digest
    cfg = load_config(None, ["split.unseen_clients=2", "unseen.also_adapt_epochs=[2,5]"])
    assert yaml.safe_load(to_yaml(cfg))["unseen"]["also_adapt_epochs"] == [2, 5]


# --- same numbers everywhere ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("algo", ["fedmerge", "superfed_mm", "fedem", "apfl"])
def test_workers_and_resume_give_the_same_newcomer_numbers(tmp_path, algo):
    extra = ["algorithm.start_round=1"] if algo.startswith("superfed") else []
    extra += ["unseen.also_adapt_epochs=[0]"]  # a further budget, onboarded in the workers too
    cfg = quick_config(f"algorithm.name={algo}", *UNSEEN, *extra)
    one = run(quick_config(f"algorithm.name={algo}", *UNSEEN, *extra, "workers=1"), tmp_path / "one")
    assert {"eval_unseen", "eval_unseen_adapt0"} <= set(RunStore(one.run_dir).read_metrics()[-1])
    two = run(quick_config(f"algorithm.name={algo}", *UNSEEN, *extra, "workers=2"), tmp_path / "two")
    assert_runs_identical(one.run_dir, two.run_dir)
    run(cfg, tmp_path / "cut", stop_after=2)
    resumed = run_experiment(cfg, tmp_path / "cut", resume=True, show_progress=False)
    assert_runs_identical(one.run_dir, resumed.run_dir)


@pytest.mark.parametrize("name", ["ditto", "fedmerge", "ifca", "fedem", "pfedmoe", "lg_fedavg"])
def test_flower_protocol_onboards_newcomers_as_the_local_engine(tmp_path, task_identity, name):
    pytest.importorskip("flwr")
    from test_flower_engine import SMALL, FakeGrid

    algo = [f"algorithm.name={name}", "split.unseen_clients=1", "unseen.adapt_epochs=1", "unseen.also_adapt_epochs=[0]"]
    algo += ["unseen.adapt_lr=0.03"]  # carried to the newcomer's node in its payload
    grid = FakeGrid(4)  # 3 participants and 1 newcomer, one node each
    flower = run(quick_config(*SMALL, *algo, "engine=flower"), tmp_path / "flower", grid=grid)
    local = run(quick_config(*SMALL, *algo), tmp_path / "local")
    assert_runs_identical(local.run_dir, flower.run_dir)
    onboard = [m for m in grid.sent if m.content.config_records["fedmerge.job"].get("onboard")]
    assert onboard and {int(m.content.config_records["fedmerge.job"]["cid"]) for m in onboard} == {3}
    assert "eval_unseen_adapt0" in RunStore(flower.run_dir).read_metrics()[-1]
    trains = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert all(int(m.content.config_records["fedmerge.job"]["cid"]) < 3 for m in trains)


def test_config_yaml_of_a_run_without_newcomers_is_unchanged(tmp_path):
    cfg = load_config(None, ["rounds=1"])
    from fedmerge.config.schema import to_yaml

    text = to_yaml(cfg)
    assert "unseen" not in text


def test_comparison_tables_show_unseen_accuracy_and_gap_only_where_present():
    from fedmerge.report.compare import COLUMNS, UNSEEN_COLUMNS, columns, compare, to_markdown
    from fedmerge.run.results import DONE, RunRecord

    def record(method, setting, seed, acc, unseen_acc=None):
        stat = {"mean": acc, "weighted_mean": acc, "std": 0.0, "worst10": acc}
        best = {"round": 1, "clients": {"test_acc": stat}}
        if unseen_acc is not None:
            best["unseen"] = {"test_acc": {**stat, "mean": unseen_acc}}
            best["participation_gap"] = {"test_acc": acc - unseen_acc}
        return RunRecord(f"{method}-{setting}-{seed}", method, setting, seed, DONE, summary={"best_val": best})

    tables = compare(
        [record("fedavg", "new", s, 0.8, 0.7 - 0.1 * s) for s in (0, 1)]
        + [record("fedavg", "plain", 0, 0.8), record("ifca", "plain", 0, 0.6)]
    )
    by_setting = {t.setting: t for t in tables}
    assert columns(by_setting["plain"]) == COLUMNS
    assert columns(by_setting["new"]) == COLUMNS + UNSEEN_COLUMNS
    (row,) = by_setting["new"].rows
    assert row.unseen.mean == pytest.approx(0.65) and row.gap.mean == pytest.approx(0.15)
    text = to_markdown(tables)
    assert "| fedavg | 2 | 80.00 ± 0.00 |" in text and "| 65.00 ± 7.07 | 15.00 ± 7.07 |" in text


def test_a_study_can_score_the_newcomers_and_the_unseen_studies_expand():
    from pathlib import Path

    from pydantic import ValidationError

    from fedmerge.study.protocol import score_on_test, val_score
    from fedmerge.study.spec import Metric, Study, load_study_file

    def stat(mean):
        return {"mean": mean, "weighted_mean": mean, "std": 0.0, "worst10": mean}

    best = {"clients": {"test_acc": stat(0.8), "val_acc": stat(0.7)}, "unseen": {"test_acc": stat(0.6)}}
    study = Study(title="t", base="b.yaml", seeds=[0], metric={"scope": "unseen"}, methods=[{"label": "A"}])
    assert score_on_test(study, {"best_val": best}) == 0.6
    assert val_score({"best_val": best}, study) == 0.7  # tuning reads the participants
    with pytest.raises(ConfigError, match="split.unseen_clients"):
        score_on_test(study, {"best_val": {"clients": best["clients"]}})
    later = study.model_copy(update={"metric": Metric(scope="unseen", adapt_epochs=2)})
    assert score_on_test(later, {"best_val": {**best, "unseen_adapt2": {"test_acc": stat(0.65)}}}) == 0.65
    with pytest.raises(ConfigError, match="metric.adapt_epochs 2: these runs onboarded no newcomer at that budget"):
        score_on_test(later, {"best_val": best})
    with pytest.raises(ValidationError, match="needs scope unseen"):
        Metric(scope="clients", adapt_epochs=2)
    root = Path(__file__).resolve().parents[1]
    files = sorted((root / "studies" / "unseen").glob("*.yaml"))
    assert len(files) == 2
    for path in files:
        spec = load_study_file(path)  # validates every point of every revision
        first, adapted = spec.at("first"), spec.at("adapt2")
        assert first.metric.scope == "unseen" and {200, 201, 202} == set(first.seeds)
        assert {m.label for m in first.methods} >= {"Ditto", "APFL", "pFedMe", "FedPer", "SuPerFed-MM", "FedEM M=5"}
        base = load_config(str(root / first.base), [])
        if adapted.metric.adapt_epochs is None:  # budget 2 trained again, the rows' only change
            assert all("unseen.adapt_epochs=2" in m.overrides for m in adapted.methods)
        else:  # budget 2 read from the same runs, which onboard newcomers at both budgets
            assert adapted.metric.adapt_epochs == 2 and base.unseen.also_adapt_epochs == (2,)
            assert [m.model_dump() for m in adapted.methods] == [m.model_dump() for m in first.methods]
        assert base.split.unseen_clients * 5 == base.partition.num_clients and base.unseen.adapt_epochs == 0
