from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedmerge.algorithms import ALGORITHMS
from fedmerge.cli import app
from fedmerge.config.schema import load_config
from fedmerge.data import DATASETS, PARTITIONERS
from fedmerge.models import MODELS

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def test_list_shows_every_registered_component():
    result = CliRunner().invoke(app, ["list"])
    assert result.exit_code == 0
    for registry in (ALGORITHMS, DATASETS, PARTITIONERS, MODELS):
        for entry in registry.entries():
            assert entry.name in result.output
    assert "FedProx" in result.output


@pytest.mark.parametrize(("args", "suggestion"), [(["runz"], "'run'"), (["livar", "calibrat"], "'calibrate'")])
def test_a_mistyped_command_is_suggested_once(args, suggestion):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert result.output.count("Did you mean") == 1 and suggestion in result.output


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    assert cfg.rounds >= 1


def test_default_run_prints_results_table(tmp_path):
    result = CliRunner().invoke(app, ["run", "rounds=2", f"output_dir={tmp_path}", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "test_acc" in result.output and "best_val" in result.output
    assert "communicated per client per round" in result.output
    (run_dir,) = tmp_path.iterdir()
    assert (run_dir / "summary.md").read_text().count("test_acc") >= 2


def test_users_npz_just_works(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 5)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    np.savez(tmp_path / "my.npz", x=x, y=y, client_id=np.repeat(np.arange(3), 100))
    result = CliRunner().invoke(
        app, ["run", f"dataset.path={tmp_path / 'my.npz'}", "rounds=3", f"output_dir={tmp_path}", "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    natural = CliRunner().invoke(
        app,
        [
            "run",
            f"dataset.path={tmp_path / 'my.npz'}",
            "partition.name=natural",
            "partition.num_clients=null",
            "rounds=3",
            f"output_dir={tmp_path}",
            "--no-progress",
        ],
    )
    assert natural.exit_code == 0, natural.output
    assert "3 clients" in natural.output


def test_partition_command_prints_and_plots(tmp_path):
    png = tmp_path / "parts.png"
    result = CliRunner().invoke(
        app, ["partition", "partition.name=shards", "partition.classes_per_client=2", "--plot", str(png)]
    )
    assert result.exit_code == 0, result.output
    assert png.exists() and png.stat().st_size > 1000


def test_data_dir_option_points_the_dataset_at_a_folder(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["run", "dataset.name=fashion_mnist", "--data-dir", str(tmp_path), "--no-progress"])
    assert result.exit_code == 2
    assert str(tmp_path) in result.output and "apt-get install -y dataset-fashion-mnist" in result.output
    result = runner.invoke(app, ["run", "--data-dir", str(tmp_path), "--no-progress"])  # digits ship with sklearn
    assert result.exit_code == 2 and "reads no files" in result.output
    cfg = load_config(None, ["dataset.name=npz", "dataset.path=a.npz", "dataset.data_dir=b.npz"])
    # user-file datasets take the folder/file as their path, recorded absolute (a resume from elsewhere finds it)
    assert cfg.dataset.path == str(Path("b.npz").resolve())


@pytest.mark.parametrize("width", [80, 200])
def test_dataset_option_table_with_long_defaults_reads_at_its_width(width):
    """shakespeare_plays' default play list is 60 characters: at 80 columns the table squeezed every description to a
    dozen characters per line although the key column alone was narrow."""
    import subprocess
    import sys

    env = {**__import__("os").environ, "COLUMNS": str(width)}
    cmd = [sys.executable, "-m", "fedmerge", "list", "dataset", "shakespeare_plays"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= width
    assert any("drop roles with fewer samples" in line for line in lines)
    assert any("'hamlet', 'lear', 'macbeth'" in line for line in lines)


@pytest.mark.parametrize("width", [80, 200])
def test_option_tables_read_at_80_columns(width):
    """At 80 columns the four-column table left the description five characters wide; there each option is a
    heading and its description below it, every line within the width."""
    import subprocess
    import sys

    env = {**__import__("os").environ, "COLUMNS": str(width)}
    done = subprocess.run([sys.executable, "-m", "fedmerge", "list", "run"], capture_output=True, text=True, env=env)
    assert done.returncode == 0
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= width
    # a whole phrase of a description on one line, as in the schema (a squeezed column breaks it up)
    assert any("seeds the partition, splits, noise" in line for line in lines)
    assert any("privacy.secure_aggregation.reconstruction_threshold" in line for line in lines)


def test_fedmerge_list_answers_from_the_committed_index_without_importing_torch_and_says_the_same():
    """`fedmerge list` reads registry_index.json (no method, model or torch imported) when no plugin is
    installed; the index must equal the live registries, and the listing the one the registries give."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "100", "FEDMERGE_DISABLE_PLUGIN_AUTOLOAD": "1"}
    stale = subprocess.run(
        [sys.executable, "-m", "fedmerge.config.registry_index"], capture_output=True, text=True, env=env
    )
    assert stale.returncode == 0, stale.stdout + stale.stderr  # a component added without --write
    probe = (
        "import sys\n"
        "from fedmerge.cli import main\n"
        "sys.argv = ['fedmerge', 'list', *sys.argv[1:]]\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('TORCH', 'torch' in sys.modules)\n"
    )
    live = probe.replace(
        "from fedmerge.cli import main\n",
        "from fedmerge.cli import main\nimport fedmerge.cli.components as c\nc._built_in_index = lambda: None\n",
    )
    for args in ([], ["algorithm"], ["models"]):
        fast = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, env=env)
        slow = subprocess.run([sys.executable, "-c", live, *args], capture_output=True, text=True, env=env)
        assert fast.returncode == 0 and slow.returncode == 0, fast.stderr + slow.stderr
        assert fast.stdout.splitlines()[-1] == "TORCH False", args
        assert fast.stdout.splitlines()[:-1] == slow.stdout.splitlines()[:-1], args
        assert "fedmerge" in fast.stdout
