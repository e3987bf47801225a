"""Every message points the right way (issue #51): each input error is one line with exit status 2 that
names what is actually wrong."""

from __future__ import annotations

import errno
import os

import pytest
from typer.testing import CliRunner

from fedmerge.cli import app


def one_line(*args: str, code: int = 2) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == code, result.output
    (line,) = result.output.strip().splitlines()
    return line


def test_resume_of_a_folder_that_does_not_exist_says_so(tmp_path):
    missing = tmp_path / "nosuchrun"
    assert one_line("run", "--resume", str(missing)) == f"error: --resume {missing}: the folder does not exist"


def test_a_config_file_after_an_override_is_named_as_such(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rounds: 2\n")
    assert one_line("run", "rounds=1", str(path)) == (
        f"error: {path}: a config file comes first, before any key=value override"
    )
    assert one_line("run", "rounds=1", "other.yml") == (
        "error: other.yml: a config file comes first, before any key=value override"
    )
    assert one_line("run", "seed=1", "rounds") == "error: override 'rounds': expected key.path=value"


def test_a_sweep_list_without_its_closing_bracket_blames_the_bracket():
    assert one_line("sweep", "algorithm.name=[fedavg,ditto") == (
        "error: override 'algorithm.name=[fedavg,ditto': the [ is never closed; end the value with ]"
    )
    assert one_line("run", "model.hidden={a: 1") == (
        "error: override 'model.hidden={a: 1': the { is never closed; end the value with }"
    )


def test_an_image_folder_that_is_a_file_says_it_is_a_file(tmp_path):
    path = tmp_path / "file.csv"
    path.write_text("a,label\n1,x\n")
    assert one_line("run", "dataset.name=image_folder", f"dataset.path={path}", f"output_dir={tmp_path}") == (
        f"error: {path} is a file, not a folder: image_folder reads a folder with one sub-folder of images per "
        "class (for a .csv or .npz file, give dataset.name=csv or npz, or leave dataset.name out)"
    )


def test_plot_budget_names_no_out_that_nobody_gave(tmp_path):
    run = tmp_path / "data"
    assert one_line("plot", "budget", str(run)) == (
        f"error: {run}/summary.json does not exist; is {run} a finished run folder?"
    )


def test_an_unknown_dataset_to_fetch_exits_2_with_a_did_you_mean():
    assert (
        one_line("data", "fetch", "mnistt") == "error: no downloadable dataset 'mnistt'; did you mean mnist or femnist?"
    )
    assert one_line("data", "fetch", "zzzz").startswith("error: no downloadable dataset 'zzzz'; known: cifar10, ")


def test_an_unreadable_input_is_not_blamed_on_the_place_to_write(tmp_path, monkeypatch):
    """(As root every file is readable, so the unreadable one is simulated.)"""
    from fedmerge.cli.app import system_problem

    data = tmp_path / "data.csv"
    data.write_text("a,label\n")
    denied = PermissionError(errno.EACCES, "Permission denied", str(data))
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(data) else real_access(p, mode))
    assert system_problem(denied) == (
        f"Permission denied: {data} (it cannot be read: change its permissions, or give another file)"
    )
    out = PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "new" / "run"))
    assert system_problem(out) == f"Permission denied: {tmp_path / 'new' / 'run'} (choose a writable place)"


@pytest.mark.parametrize("value", ["[1,2", "[fedavg"])
def test_an_unclosed_list_is_refused_by_the_config_loader_too(value):
    from fedmerge.config.schema import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"the \[ is never closed; end the value with \]"):
        load_config(None, [f"model.hidden={value}"])
