import subprocess
import sys

import pytest
from typer.testing import CliRunner

from fedmerge.cli import app
from fedmerge.config.schema import ConfigError, load_config

BAD = [
    (["rounds=-1"], "rounds:"),
    (["rounds=abc"], "rounds:"),
    (["bogus=1"], "bogus: unknown key"),
    (["partition.alpha=0"], "partition.alpha:"),
    (["partition.alpha=-2"], "partition.alpha:"),
    (["algorithm.name=nope"], "algorithm.name: unknown name 'nope'"),
    (["algorithm.muu=0.1"], "algorithm.muu: unknown key"),
    (["algorithm.lr=0"], "algorithm.lr:"),
    (["participation=1.5"], "participation:"),
    (["partition.num_clients=5000"], "partition.num_clients:"),
    (["device=gpu"], "device:"),
    (["seed=1", "rounds"], "expected key.path=value"),
]


@pytest.mark.parametrize("overrides,needle", BAD)
def test_bad_config_gives_one_line_and_exit_code_2(overrides, needle, tmp_path):
    result = CliRunner().invoke(app, ["run", *overrides, f"output_dir={tmp_path}", "--no-progress"])
    assert result.exit_code == 2, result.output
    text = result.output.strip()
    assert needle in text
    assert "Traceback" not in text
    assert len(text.splitlines()) == 1, text


def test_bad_yaml_file(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rounds: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(cfg)
    cfg.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(cfg)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_yaml_plus_overrides(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rounds: 7\nalgorithm: {name: fedavg, lr: 0.1, batch_size: 16}\n")
    c = load_config(cfg, ["algorithm.name=fedprox", "algorithm.mu=0.01", "rounds=50"])
    assert c.rounds == 50
    assert c.algorithm.name == "fedprox" and c.algorithm.mu == 0.01
    # shared local-training fields survive the switch of algorithm
    assert c.algorithm.lr == 0.1 and c.algorithm.batch_size == 16
    c = load_config(cfg, ["partition.name=iid"])
    assert c.partition.name == "iid" and c.partition.num_clients == 10


def test_real_process_exit_code(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "fedmerge.cli", "run", "rounds=0", f"output_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "rounds:" in proc.stderr and "Traceback" not in proc.stderr
