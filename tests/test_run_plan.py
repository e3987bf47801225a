"""run/plan.py: ``plan_run`` resolves a run (device, data, model, method, engine, workers, newcomers) and refuses
a bad one in one line, each refusal from its own ``*_problem`` check; it writes nothing, refused or not."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from helpers import quick_config

import fedmerge.engines.flower as flower
from fedmerge.config.schema import ConfigError
from fedmerge.engines.flower import INSTALL_HINT as FLOWER_HINT
from fedmerge.run.plan import RunPlan, RunSource, deployed_clients_problem, plan_run
from fedmerge.run.setup import secure_resume_problem
from fedmerge.run.tensorboard_log import INSTALL_HINT as TENSORBOARD_HINT

GRID = object()  # a ServerApp's Grid: the config problems are found before anything is sent to it
SECURE = ["privacy.secure_aggregation.max_weight=1000"]
CENTRAL = ["privacy.central.noise_multiplier=0.3", "privacy.central.clip=1.0"]
STATE = "state (client states on disk) applies to engine=local; remove it for engine=flower"
SECURE_LOCAL = (
    "privacy.secure_aggregation: needs engine=flower (Flower's SecAgg+ protocol between the nodes); the local engine "
    "runs every client in this process"
)

# (overrides, source, the whole one-line refusal)
REFUSALS = [
    ([], RunSource(pooled_test="p.npz"), "pooled-test applies to a deployment; a simulation tests on its own data"),
    (
        ["split.unseen_clients=1"],
        RunSource(grid=GRID, deployment=True),
        "split.unseen_clients applies to engine=local and Flower simulations: deployed nodes hold their own data; "
        "set it to 0",
    ),
    (
        ["unseen.adapt_epochs=1"],
        RunSource(),
        "unseen: onboards the clients that never train; set split.unseen_clients too, or remove it",
    ),
    (["state.cache_size=4", "engine=flower"], RunSource(), STATE),
    (["state.cache_size=4"], RunSource(grid=GRID), STATE),  # a ServerApp's engine is Flower's
    (
        ["workers=2", "threads=2"],
        RunSource(),
        "workers: each of the 2 worker processes runs one thread (forked OpenMP thread pools hang), so threads must "
        "be 1 (got 2)",
    ),
    (SECURE, RunSource(), SECURE_LOCAL),
    (
        [*SECURE, "engine=flower", "participation=0.2"],  # 0.2 of 6 clients: 1 per round
        RunSource(),
        "privacy.secure_aggregation: needs at least 2 clients per round (the sum of one is its update)",
    ),
    (
        [*CENTRAL, "vectorize=true"],
        RunSource(),
        "vectorize: not with privacy (DP-SGD's per-sample step and the private aggregate run per client)",
    ),
    (
        [*CENTRAL, "participation=0.5", "eval_clients=participants"],
        RunSource(),
        "privacy.central: not with eval_clients=participants, whose evaluation would publish which clients the "
        "secret Poisson sampling chose (use all or sample:K)",
    ),
    (
        ["vectorize=true", "workers=2"],
        RunSource(),
        "vectorize: batched clients are an option of engine=local with workers=1",
    ),
]


def listing(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("overrides, source, message", REFUSALS)
def test_each_problem_refuses_in_its_one_line_and_nothing_is_written(tmp_path, overrides, source, message):
    (tmp_path / "kept.txt").write_text("mine")
    cfg = quick_config(*overrides, output_dir=tmp_path / "runs")
    with pytest.raises(ConfigError) as refused:
        plan_run(cfg, source, run_dir=tmp_path / "run")
    assert str(refused.value) == message
    assert listing(tmp_path) == ["kept.txt"]  # no run folder, no output_dir, nothing touched


def test_a_new_run_is_refused_a_folder_that_holds_a_run_before_the_data_is_built(tmp_path, monkeypatch):
    import fedmerge.run.data_plan as data_plan

    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.yaml").write_text("rounds: 1\n")
    monkeypatch.setattr(data_plan, "load_data", lambda cfg: pytest.fail("data was built"))
    with pytest.raises(ConfigError) as refused:
        plan_run(quick_config(), run_dir=folder)
    assert str(refused.value) == (
        f"run folder {folder} already holds a run; to continue it: fedmerge run --resume {folder}"
    )
    assert listing(tmp_path) == ["run", "run/config.yaml"]
    monkeypatch.undo()
    plan_run(quick_config(), run_dir=folder, resume=True)  # a resume continues there (run/setup.py reads it)


def test_missing_libraries_are_problems_too(tmp_path, monkeypatch):
    monkeypatch.setattr(flower, "flower_available", lambda simulation=False: False)
    with pytest.raises(ConfigError) as refused:
        plan_run(quick_config("engine=flower", output_dir=tmp_path))
    assert str(refused.value) == FLOWER_HINT
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # importing it now raises ImportError
    with pytest.raises(ConfigError) as refused:
        plan_run(quick_config("log.tensorboard=true", output_dir=tmp_path))
    assert str(refused.value) == TENSORBOARD_HINT
    assert listing(tmp_path) == []


def test_a_resume_refuses_another_federation_and_a_secure_simulation():
    ran, answered = quick_config("partition.num_clients=6"), quick_config("partition.num_clients=4")
    assert deployed_clients_problem(ran, answered, True, "runs/r") == (
        "runs/r: the run had 6 clients but 4 SuperNodes answered; resume it with the federation that ran it"
    )
    assert deployed_clients_problem(ran, answered, False, None) is None  # a new run takes the federation's
    assert deployed_clients_problem(ran, ran, True, "runs/r") is None
    secure = quick_config(*SECURE, "engine=flower")
    assert secure_resume_problem(secure, RunSource(), "runs/r").startswith(
        "runs/r: a Flower simulation under privacy.secure_aggregation cannot resume"
    )
    assert secure_resume_problem(secure, RunSource(grid=GRID, deployment=True), "runs/r") is None  # nodes keep them
    assert secure_resume_problem(quick_config("engine=flower"), RunSource(), "runs/r") is None


def test_a_plan_is_resolved_frozen_and_writes_nothing(tmp_path):
    cfg = quick_config("split.unseen_clients=2", "unseen.adapt_epochs=1", "workers=1", output_dir=tmp_path / "runs")
    plan = plan_run(cfg, run_dir=tmp_path / "run")
    assert listing(tmp_path) == []
    assert isinstance(plan, RunPlan) and plan.cfg is cfg and plan.device == torch.device("cpu")
    # 6 clients, the last 2 never train: the method and the schedule see 4, the newcomers are ids 4 and 5
    assert plan.num_clients == 4 and plan.newcomers.cids == (4, 5) and plan.newcomers.adapt_epochs == 1
    assert plan.local and plan.workers.count == 1 and plan.federation is None and plan.dataset is None
    assert plan.num_classes == 10 and plan.data.num_classes == 10  # UCI digits
    assert sum(p.numel() for p in plan.model.parameters()) > 0 and plan.algorithm is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.cfg = quick_config()  # type: ignore[misc]


def test_withheld_test_splits_are_empty_in_the_plan(tmp_path):
    plan = plan_run(quick_config(output_dir=tmp_path), RunSource(withhold_test=True))
    assert all(c.n_test == 0 for c in plan.data.clients) and plan.pooled_test is None


def test_a_deployment_needs_the_grid_of_a_server_app():
    with pytest.raises(ValueError, match="deployment=True needs the Grid of a ServerApp"):
        RunSource(deployment=True)
