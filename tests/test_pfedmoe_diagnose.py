"""benchmarks/pfedmoe_diagnose.py (explains a weak pFedMoE row, docs/guide/studies.md): its network with the
averaged global expert is the one the engine evaluates, checked against a real run's per-client accuracies."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedmerge.config.schema import load_config
from fedmerge.run.runner import run_experiment

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import pfedmoe_diagnose  # noqa: E402

CONFIG = """name: tiny
rounds: 2
dataset: {name: digits, max_samples: 600}
partition: {name: dirichlet, num_clients: 4}
model: {name: mlp}
algorithm: {name: fedavg, local_epochs: 1}
"""


def figures(line: str) -> dict[str, float]:
    return {k: float(v) for k, v in re.findall(r"\b(avg|own|loc|glob|fixed) (\d+\.\d)", line)}


def test_the_averaged_network_gives_the_engines_accuracy_on_val_and_test(tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(CONFIG)
    pfedmoe_diagnose.main([str(config)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("pfedmoe lr=") and lines[0].endswith(" seed=0")  # algorithm.name=pfedmoe forced
    assert [line.split()[0] for line in lines[1:]] == ["r", "r"] and "r  2 train CE" in lines[2]
    # The engine's figures of the same config: per client, val and test accuracy pooled by their sizes
    run_experiment(load_config(config, ["algorithm.name=pfedmoe"]), tmp_path / "run", show_progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    clients = [r for r in rows if r.get("eval")][-1]["eval"]["clients"].values()
    pooled = [(c["val_acc"] * c["val_n"] + c["test_acc"] * c["test_n"]) / (c["val_n"] + c["test_n"]) for c in clients]
    assert figures(lines[2])["avg"] == pytest.approx(100 * sum(pooled) / len(pooled), abs=0.051)


def test_without_sharing_each_client_keeps_its_own_global_expert(tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(CONFIG)
    pfedmoe_diagnose.main([str(config), "rounds=1", "--no-share"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(" no-share")
    got = figures(lines[1])
    assert got["avg"] == got["own"]  # the evaluated network is the client's own, not an average


def test_the_documented_path_still_runs_the_diagnosis():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "pfedmoe_diagnose.py"), "no_such_file.yaml"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "no_such_file.yaml" in proc.stderr  # reached the diagnosis's config loading
