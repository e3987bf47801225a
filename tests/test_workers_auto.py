"""``workers: auto`` (the default): the count it resolves to, when the clients move to the workers, what
is recorded; and evaluation with workers: global-model clients grouped in this process, personalised
ones in the workers, with the numbers of one process."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest
import torch
import yaml
from helpers import assert_runs_identical, quick_config, run

from fedmerge.config.schema import first_config_difference
from fedmerge.engines import workers
from fedmerge.engines.local import round_work
from fedmerge.engines.workers import WorkerPool, available_cores, resolve_workers
from fedmerge.run.provenance import read_provenance
from fedmerge.run.runner import run_experiment

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def no_leftover_workers():
    yield
    assert mp.active_children() == [], "worker processes outlived their run"


@pytest.fixture
def two_cores(monkeypatch):
    """auto sees two cores whatever the machine, and moves clients to the workers after one round of any work."""
    monkeypatch.setattr(workers, "available_cores", lambda: 2)
    monkeypatch.setattr(workers, "AUTO_MIN_ROUND_SECONDS", 1e-9)


@pytest.fixture
def pool_tasks(monkeypatch):
    """(kind, client) of every task the worker pools were sent."""
    sent: list[tuple[str, int]] = []
    original = WorkerPool.map

    def recording(self, tasks, on_result=None):
        sent.extend((t[0], t[2]) for t in tasks)
        return original(self, tasks, on_result)

    monkeypatch.setattr(WorkerPool, "map", recording)
    return sent


def test_auto_is_the_cores_at_most_the_clients_per_round_and_one_where_forking_cannot_help(monkeypatch):
    monkeypatch.setattr(workers, "available_cores", lambda: 4)
    assert resolve_workers("auto", 1, CPU, 10).count == 4
    assert resolve_workers("auto", 1, CPU, 3).count == 3
    one = {
        "one client per round": resolve_workers("auto", 1, CPU, 1),
        "device cuda": resolve_workers("auto", 1, torch.device("cuda"), 10),
        "threads=2": resolve_workers("auto", 2, CPU, 10),
        "threads=None": resolve_workers("auto", None, CPU, 10),
        "engine=flower": resolve_workers("auto", 1, CPU, 10, engine="flower"),
        "vectorize": resolve_workers("auto", 1, CPU, 10, vectorize=True),
    }
    for why, count in one.items():
        assert count.count == 1 and count.auto and why in count.reason, why
    monkeypatch.setattr(workers, "available_cores", lambda: 1)
    assert resolve_workers("auto", 1, CPU, 10).reason == "one core"
    # a number is kept, and runs in the workers from the first round
    explicit = resolve_workers(3, 1, CPU, 10)
    assert (explicit.count, explicit.auto, explicit.min_round_seconds) == (3, False, 0.0)
    assert resolve_workers("auto", 1, CPU, 10).min_round_seconds == 0.0  # 1 worker: nothing to wait for


def test_a_launcher_share_caps_the_cores(monkeypatch):
    affinity = available_cores()
    monkeypatch.setenv("FEDMERGE_CORES", "1")
    assert available_cores() == 1
    monkeypatch.setenv("FEDMERGE_CORES", "4096")
    assert available_cores() == affinity  # a share never adds cores
    monkeypatch.setenv("FEDMERGE_CORES", "lots")
    assert available_cores() == affinity


def test_a_rounds_work_leaves_out_its_first_client():
    # the first client of a fresh process carries one-time costs (torch's optimizer imports its compiler)
    assert round_work([6.0, 0.1, 0.1, 0.1]) == pytest.approx(0.4)
    assert round_work([0.3]) == 0.3 and round_work([]) == 0.0


def test_auto_moves_the_clients_to_the_workers_after_a_round_and_changes_no_number(tmp_path, two_cores, pool_tasks):
    case = ["algorithm.name=ditto", "rounds=3"]
    one = run(quick_config(*case, "workers=1"), tmp_path / "one")
    notices: list[str] = []
    auto = run_experiment(quick_config(*case), tmp_path / "auto", show_progress=False, notify=notices.append)
    assert_runs_identical(one.run_dir, auto.run_dir)
    # clients 0 and 1 of round 1 trained here (timed, the first left out); the rest in the workers
    assert sorted(pool_tasks[:4]) == [("fit", 2), ("fit", 3), ("fit", 4), ("fit", 5)]  # largest first
    assert [kind for kind, _ in pool_tasks[4:]] == ["evaluate"] * 5 + (["fit"] * 6 + ["evaluate"] * 5) * 2
    assert auto.summary["workers"] == {"processes": 2, "from_round": 1}
    assert one.summary["workers"] == {"processes": 1}
    assert [n for n in notices if "worker" in n] == [
        "round 1: clients run in 2 worker processes from here on (workers: auto = 2: 2 cores, 6 clients per round; "
        "a round's client work reached 1e-09 s)"
    ]
    assert [line["workers"] for line in read_provenance(auto.run_dir)] == [2]
    assert yaml.safe_load((auto.run_dir / "config.yaml").read_text())["workers"] == "auto"


def test_auto_keeps_tiny_rounds_in_this_process(tmp_path, monkeypatch, pool_tasks):
    monkeypatch.setattr(workers, "available_cores", lambda: 2)
    monkeypatch.setattr(workers, "AUTO_MIN_ROUND_SECONDS", 1e9)  # no round reaches it
    notices: list[str] = []
    result = run(quick_config("rounds=2"), tmp_path / "r", notify=notices.append)
    assert pool_tasks == [] and result.summary["workers"] == {"processes": 1}
    assert not any("worker" in n for n in notices)  # nothing to say: the run is what it always was
    assert [line["workers"] for line in read_provenance(result.run_dir)] == [2]  # what auto resolved to


def test_resume_under_auto_on_another_core_count_is_bit_identical(tmp_path, two_cores, monkeypatch, pool_tasks):
    case = ["algorithm.name=fedmerge", "participation=0.5", "rounds=4"]
    full = run(quick_config(*case, "workers=1"), tmp_path / "full")
    run(quick_config(*case), tmp_path / "cut", stop_after=3)  # auto: 2 workers from round 1's third client
    assert ("fit", 0) in pool_tasks or ("fit", 1) in pool_tasks
    monkeypatch.setenv("FEDMERGE_CORES", "1")  # resumed where it may use one core: auto = 1
    monkeypatch.setattr(workers, "available_cores", available_cores)  # the real count, which the share caps
    resumed = run_experiment(quick_config(*case), tmp_path / "cut", resume=True, show_progress=False)
    assert_runs_identical(full.run_dir, resumed.run_dir)
    assert [line["workers"] for line in read_provenance(resumed.run_dir)] == [2, 1]


def test_a_run_made_with_another_worker_count_is_the_same_run():
    old = quick_config("workers=1").model_dump(mode="json")  # config.yaml of a run made before auto
    assert first_config_difference(old, quick_config().model_dump(mode="json")) is None


@pytest.mark.parametrize(
    ("method", "in_workers"),
    [
        ("fedavg", set()),  # one global model: every client in one grouped pass here
        ("ditto", {1, 2, 3, 4, 5}),  # personal models: the first client here (it told us), the others there
        ("fedavg_ft", {1, 2, 3, 4, 5}),  # personalised by fine-tuning: likewise, no client fine-tuned twice
        ("fedmerge", {0, 1, 2, 3, 4, 5}),  # a payload per client: nothing to group
    ],
)
def test_evaluation_with_workers_groups_global_model_clients_here(tmp_path, pool_tasks, method, in_workers):
    case = [f"algorithm.name={method}", "rounds=2"]
    one = run(quick_config(*case, "workers=1"), tmp_path / "one")
    two = run(quick_config(*case, "workers=2"), tmp_path / "two")
    assert_runs_identical(one.run_dir, two.run_dir)
    # rounds 1 and 2 (the workers get them largest first: test_schedule.py)
    assert sorted(cid for kind, cid in pool_tasks if kind == "evaluate") == sorted([*in_workers] * 2)


def test_a_tune_study_made_before_auto_continues(tmp_path):
    from types import SimpleNamespace

    from fedmerge.config.schema import ConfigError
    from fedmerge.sweep.tune import _check_same_study, default_space

    made, now = quick_config("workers=1"), quick_config()  # before auto, the fingerprint held workers: 1
    space = default_space(made.algorithm)
    study = SimpleNamespace(user_attrs={})
    study.set_user_attr = study.user_attrs.__setitem__
    _check_same_study(study, made, space, "val_loss", tmp_path)
    old = json.loads(study.user_attrs["fingerprint"])
    old["config"]["workers"] = 1
    study.user_attrs["fingerprint"] = json.dumps(old, sort_keys=True)
    _check_same_study(study, now, space, "val_loss", tmp_path)  # the same study: workers changes no number
    with pytest.raises(ConfigError, match="another config"):
        _check_same_study(study, quick_config("seed=1"), space, "val_loss", tmp_path)
