"""Configs are never guessed (issue #51): an empty file, a repeated key, ``split.unseen_clients: 1.0`` and
more IFCA clusters than clients are refused in one line with exit status 2; relative dataset paths are
recorded absolute, so a resume from another folder finds the data."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from fedmerge.cli import app


def refused(*args: str) -> str:
    result = CliRunner().invoke(app, ["run", *args, "--no-progress"])
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    return line


@pytest.mark.parametrize("text", ["", "# only a comment\n", "\n\n"])
def test_an_empty_config_file_is_refused_naming_it(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    assert refused(str(path)) == f"error: config file {path} is empty; give it at least one key, or leave it out"


def test_a_key_given_twice_is_refused_naming_it_and_its_line(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("rounds: 3\nseed: 1\nrounds: 4\n")
    assert refused(str(path)) == f"error: {path} line 3: key 'rounds' is given twice; keep one"
    path.write_text("algorithm:\n  name: fedavg\n  lr: 0.1\n  lr: 0.2\n")
    assert refused(str(path)) == f"error: {path} line 4: key 'lr' is given twice; keep one"
    path.write_text("base: &b {rounds: 3}\nother:\n  <<: *b\n  rounds: 4\n")  # a merge key may repeat one
    assert "given twice" not in refused(str(path))


def test_unseen_clients_one_point_zero_is_refused_with_both_spellings(tmp_path):
    assert refused("split.unseen_clients=1.0", f"output_dir={tmp_path}") == (
        "error: split.unseen_clients: ambiguous: write a count of clients as a whole number (1), a fraction "
        "strictly between 0 and 1 (e.g. 0.1) (got 1.0)"
    )


def test_unseen_clients_takes_a_count_or_a_fraction_and_config_yaml_writes_a_count_as_one():
    from fedmerge.config.schema import load_config, to_yaml

    assert load_config(None, ["split.unseen_clients=1"]).split.unseen_clients == 1
    assert load_config(None, ["split.unseen_clients=0.2"]).split.unseen_clients == 0.2
    written = yaml.safe_load(to_yaml(load_config(None, ["split.unseen_clients=2"])))
    assert written["split"]["unseen_clients"] == 2 and isinstance(written["split"]["unseen_clients"], int)
    written = yaml.safe_load(to_yaml(load_config(None, ["split.unseen_clients=0.2"])))
    assert written["split"]["unseen_clients"] == 0.2


def test_more_ifca_clusters_than_training_clients_is_refused(tmp_path):
    out = f"output_dir={tmp_path}"
    assert refused("algorithm.name=ifca", "algorithm.num_clusters=50", out) == (
        "error: algorithm.num_clusters=50 asks for more cluster models than the 10 clients that train "
        "(partition.num_clients); lower algorithm.num_clusters to at most 10"
    )
    assert refused("algorithm.name=ifca", "algorithm.num_clusters=9", "split.unseen_clients=2", out) == (
        "error: algorithm.num_clusters=9 asks for more cluster models than the 8 clients that train "
        "(partition.num_clients less split.unseen_clients); lower algorithm.num_clusters to at most 8"
    )


def test_fedmerge_and_fedem_may_have_more_models_than_clients():
    """Every client trains every global model (FedMerge) or component (FedEM): the paper's tables run
    d=5 and M=5 on 4 clients."""
    from fedmerge.config.schema import load_config

    assert load_config(None, ["algorithm.name=fedmerge", "algorithm.num_models=5", "partition.num_clients=4"])
    assert load_config(None, ["algorithm.name=fedem", "algorithm.num_components=5", "partition.num_clients=4"])


def test_a_relative_dataset_path_is_recorded_absolute_and_a_resume_elsewhere_finds_it(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    (start / "data").mkdir(parents=True)
    elsewhere.mkdir()
    np.savez(start / "data" / "mine.npz", x=rng.normal(size=(240, 4)).astype("float32"), y=rng.integers(0, 3, 240))
    monkeypatch.chdir(start)
    args = ["dataset.path=data/mine.npz", "partition.num_clients=3", "algorithm.local_epochs=1", "--no-progress"]
    first = CliRunner().invoke(app, ["run", *args, "rounds=1", "--out", "run"])
    assert first.exit_code == 0, first.output
    saved = yaml.safe_load((start / "run" / "config.yaml").read_text())
    assert saved["dataset"]["path"] == str(start / "data" / "mine.npz")

    monkeypatch.chdir(elsewhere)
    resumed = CliRunner().invoke(app, ["run", "--resume", str(start / "run"), "rounds=2", "--no-progress"])
    assert resumed.exit_code == 0, resumed.output
