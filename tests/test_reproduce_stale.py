"""``fedmerge study`` finds runs by name: a run made with other settings must be refused, not reused."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from fedmerge.cli import app
from fedmerge.config.schema import ConfigError
from fedmerge.study import protocol as rp
from fedmerge.study.report import reference_settings_text, shown_command
from fedmerge.study.spec import Regime, Row, Study, load_study, run_overrides


def study_of(**fields) -> Study:
    return Study.model_validate({"title": "t", **fields})


@pytest.fixture(scope="module")
def made_run(tmp_path_factory):
    """A finished run of a one-row study's grid point 0 (lr 0.05), made by the CLI as a study makes it."""
    tmp = tmp_path_factory.mktemp("study")
    base = tmp / "base.yaml"
    base.write_text(
        yaml.safe_dump(
            {
                "rounds": 1,
                "dataset": {"name": "digits"},
                "partition": {"name": "iid", "num_clients": 3},
                "model": {"name": "mlp"},
                "algorithm": {"name": "fedavg", "lr": 0.1},
            }
        )
    )
    study = study_of(base=str(base), seeds=[0], methods=[{"label": "FedAvg", "grid": {"algorithm.lr": [0.05]}}])
    overrides = ["algorithm.lr=0.05", "seed=0"]
    runs = tmp / "runs"
    result = CliRunner().invoke(
        app,
        [
            "run",
            str(base),
            *overrides,
            "name=fedavg-g0-s0",
            "--output-dir",
            str(runs / "fedavg-g0-s0"),
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    return study, runs, overrides, base


def test_a_run_made_with_the_studys_settings_is_reused(made_run):
    study, runs, overrides, _ = made_run
    folder = rp.run_folder(runs, "fedavg-g0-s0")
    assert rp.finished(folder)
    assert rp.stale(folder, study, "fedavg-g0-s0", overrides) is None


def test_a_changed_grid_point_or_base_config_is_named(made_run, tmp_path):
    study, runs, _, base = made_run
    folder = rp.run_folder(runs, "fedavg-g0-s0")
    assert rp.stale(folder, study, "fedavg-g0-s0", ["algorithm.lr=0.2", "seed=0"]) == (
        "algorithm.lr: study 0.2, run 0.05"
    )
    changed = tmp_path / "base.yaml"
    changed.write_text(base.read_text().replace("rounds: 1", "rounds: 2"))
    moved = study.model_copy(update={"base": str(changed)})
    assert rp.stale(folder, moved, "fedavg-g0-s0", ["algorithm.lr=0.05", "seed=0"]) == ("rounds: study 2, run 1")


def test_run_all_refuses_a_stale_folder_in_one_line(made_run):
    study, runs, _, _ = made_run
    with pytest.raises(ConfigError) as exc:
        rp.run_all([("fedavg-g0-s0", ["algorithm.lr=0.2", "seed=0"])], study, runs, workers=1)
    message = str(exc.value)
    assert message.startswith(str(runs)) and "\n" not in message
    assert "algorithm.lr: study 0.2, run 0.05" in message and "delete it" in message


def test_share_runs_copies_only_runs_the_new_study_asks_for_unchanged(made_run, tmp_path):
    study, runs, _, _ = made_run
    (runs / "regime-seed0.json").write_text("{}")
    wider = study.model_copy(update={"methods": [Row(label="FedAvg", grid={"algorithm.lr": [0.05, 0.4]})]})
    new_runs = tmp_path / "wide"
    assert rp.share_runs(wider, new_runs, study, runs) == 1
    assert rp.finished(rp.run_folder(new_runs, "fedavg-g0-s0")) and not (new_runs / "fedavg-g1-s0").exists()
    assert (new_runs / "regime-seed0.json").exists()  # same regime settings and reference grid
    assert rp.share_runs(wider, new_runs, study, runs) == 0  # already there: nothing to do

    moved = study_of(
        base=study.base,
        seeds=[0],
        regime={"lrs": [0.4]},
        methods=[{"label": "FedAvg", "grid": {"algorithm.lr": [0.4, 0.05]}}],
    )
    other = tmp_path / "moved"
    assert rp.share_runs(moved, other, study, runs) == 0  # g0 is now lr 0.4: a different run
    assert not (other / "regime-seed0.json").exists()  # the reference is tuned over other lrs


def test_reuse_copies_another_studys_runs_only_where_config_and_reference_settings_agree(made_run, tmp_path):
    study, runs, _, base = made_run
    # Another study file whose base is a copy of this one's under another name: the runs agree by content.
    twin = tmp_path / "twin.yaml"
    twin.write_text(base.read_text())
    other = study.model_copy(update={"base": str(twin), "seeds": [0, 1]})
    (runs / "regime-seed0.json").write_text(json.dumps({"settings": rp.reference_digest(other, 0)}))
    (runs / "regime-seed1.json").write_text(json.dumps({"settings": "0" * 16}))  # trained another way
    new_runs = tmp_path / "twin_runs"
    assert rp.reuse_runs(other, new_runs, runs) == (1, 1)
    assert rp.finished(rp.run_folder(new_runs, "fedavg-g0-s0")) and not (new_runs / "fedavg-g0-s1").exists()
    assert (new_runs / "regime-seed0.json").exists() and not (new_runs / "regime-seed1.json").exists()
    assert rp.reuse_runs(other, new_runs, runs) == (0, 0)  # already there

    # A base that differs in one setting: neither its run nor its reference is this study's.
    twin.write_text(base.read_text().replace("rounds: 1", "rounds: 2"))
    assert rp.reuse_runs(other, tmp_path / "changed", runs) == (0, 0)
    # A reference's digest follows what it is trained from: its learning rates.
    assert rp.reference_digest(other.model_copy(update={"regime": Regime(lrs=[0.4])}), 0) != rp.reference_digest(
        other, 0
    )


def test_a_grid_point_the_config_refuses_is_named_before_anything_runs(made_run, tmp_path):
    study, _, _, base = made_run
    bad = {
        "title": "t",
        "base": study.base,
        "seeds": [0],
        "methods": [
            {"label": "FedAvg", "grid": {"algorithm.lr": [0.05, 0.1]}},
            {"label": "Ditto", "overrides": ["algorithm.name=ditto"], "grid": {"algorithm.lam": [1.0, 100.0]}},
        ],
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError) as exc:
        load_study(path)
    message = str(exc.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    assert "row 'Ditto'" in message and "100.0" in message and "lam must be below 2" in message
    good = {**bad, "methods": [bad["methods"][0], {**bad["methods"][1], "grid": {"algorithm.lam": [1.0, 10.0]}}]}
    path.write_text(yaml.safe_dump(good))
    assert [m.label for m in load_study(path).methods] == ["FedAvg", "Ditto"]


def test_extra_points_follow_the_grid_count_in_the_budget_and_share_its_runs(made_run, tmp_path):
    study, runs, _, _ = made_run
    row = Row(
        label="FedAvg",
        grid={"algorithm.lr": [0.05]},
        extra_points=[{"algorithm.lr": 0.05, "algorithm.local_epochs": 2}, {"algorithm.lr": 0.2}],
    )
    assert row.points() == [
        {"algorithm.lr": 0.05},
        {"algorithm.lr": 0.05, "algorithm.local_epochs": 2},
        {"algorithm.lr": 0.2},
    ]
    knobs = study.model_copy(update={"methods": [row]})
    new_runs = tmp_path / "knobs"
    assert rp.share_runs(knobs, new_runs, study, runs) == 1  # g0 is the grid's point, unchanged
    assert run_overrides(row, row.points()[1], 0) == [
        "algorithm.lr=0.05",
        "algorithm.local_epochs=2",
        "seed=0",
    ]
    unequal = {
        "title": "t",
        "base": study.base,
        "seeds": [0],
        "methods": [
            row.model_dump(),
            {"label": "Local", "overrides": ["algorithm.name=local"], "grid": {"algorithm.lr": [0.05, 0.1]}},
        ],
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(unequal))
    with pytest.raises(ConfigError, match="unequal tuning budgets"):
        load_study(path)


def test_commands_show_paths_inside_the_repository_relative_to_it(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    shown = shown_command(
        f"fedmerge run configs/a.yaml seed=1 --output-dir {tmp_path}/runs/repro/old/fedavg-g0-s1 --no-progress "
        "dataset.path=/usr/share/data name='a b'"
    )
    assert shown == (
        "fedmerge run configs/a.yaml seed=1 --output-dir runs/repro/old/fedavg-g0-s1 --no-progress "
        "dataset.path=/usr/share/data 'name=a b'"
    )
    # A run copied from an earlier revision's folder outside the repository: its folder is still shown
    # relative, so no report names the machine's own directories.
    (tmp_path / "repo").mkdir()
    monkeypatch.chdir(tmp_path / "repo")
    assert shown_command(f"fedmerge run a.yaml --output-dir {tmp_path}/confirm/old/fedavg-g0-s1") == (
        "fedmerge run a.yaml --output-dir ../confirm/old/fedavg-g0-s1"
    )


def test_the_report_states_the_reference_settings_the_study_used():
    local = {"label": "Local", "grid": {"algorithm.lr": [0.05, 0.2, 0.4]}}
    widened = study_of(base="b.yaml", seeds=[0], regime={"max_epochs": 8, "lrs": [0.05, 0.2]}, methods=[local])
    assert reference_settings_text(widened) == (
        "The reference trains for at most 8 epochs; its learning rate is chosen per group from {0.05, 0.2} by "
        "validation loss."
    )
    short = study_of(base="b.yaml", seeds=[0], regime={"max_epochs": 3}, methods=[local])
    assert reference_settings_text(short).endswith(
        "at most 3 epochs; its learning rate is chosen per group from the Local row's grid by validation loss."
    )
    fedavg = study_of(base="b.yaml", seeds=[0], methods=[{"label": "FedAvg"}])
    assert reference_settings_text(fedavg) == (
        "The reference trains for at most 40 epochs; its learning rate is the base config's."
    )
