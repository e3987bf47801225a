"""Exact resume: an interrupted run, resumed, ends bit-identical to an uninterrupted one."""

import pytest
from helpers import assert_runs_identical, kill_9_run_after, quick_config, resume_in_process, run
from typer.testing import CliRunner

from fedmerge.cli import app
from fedmerge.run.runner import run_experiment

CASES = {
    "fedavg": [],
    "fedprox-partial": ["algorithm.name=fedprox", "algorithm.mu=0.1", "participation=0.5"],
    "local": ["algorithm.name=local", "participation=0.5"],
    "fedavg_ft": ["algorithm.name=fedavg_ft", "eval_every=2"],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_stop_and_resume_is_bit_identical(tmp_path, case):
    cfg = quick_config("rounds=5", *CASES[case])
    full = run(cfg, tmp_path / "full")
    run(cfg, tmp_path / "cut", stop_after=2)
    resumed = run_experiment(cfg, tmp_path / "cut", resume=True, show_progress=False)
    assert_runs_identical(full.run_dir, resumed.run_dir)


def test_resume_after_checkpoint_every_replays_uncheckpointed_rounds(tmp_path):
    cfg = quick_config("rounds=5", "checkpoint_every=2")
    full = run(cfg, tmp_path / "full")
    run(cfg, tmp_path / "cut", stop_after=3)  # round 3 logged but only round 2 checkpointed
    resumed = run_experiment(cfg, tmp_path / "cut", resume=True, show_progress=False)
    assert_runs_identical(full.run_dir, resumed.run_dir)


def test_resume_refuses_corrupt_checkpoint(tmp_path):
    cfg = quick_config("rounds=3")
    run(cfg, tmp_path / "r", stop_after=1)
    ckpt = next((tmp_path / "r" / "checkpoints").glob("round-*.safetensors"))
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    result = CliRunner().invoke(app, ["run", "--resume", str(tmp_path / "r"), "--no-progress"])
    assert result.exit_code == 2  # a damaged run folder is an input error, as docs/guide/runs.md promises
    assert "corrupt or truncated" in result.output and "Traceback" not in result.output


def test_resume_rejects_changed_settings(tmp_path):
    cfg = quick_config("rounds=3")
    run(cfg, tmp_path / "r", stop_after=1)
    result = CliRunner().invoke(app, ["run", "--resume", str(tmp_path / "r"), "algorithm.lr=0.5", "--no-progress"])
    assert result.exit_code == 2 and "cannot change algorithm.lr" in result.output


@pytest.mark.slow
def test_kill_9_mid_round_then_resume_is_bit_identical(tmp_path):
    overrides = [
        "rounds=6",
        "partition.num_clients=6",
        "algorithm.local_epochs=3",
        "model.name=twocnn",
        f"output_dir={tmp_path}",
        "name=killed",
    ]
    run_dir = kill_9_run_after(overrides, tmp_path, rounds_logged=2)
    resume_in_process(run_dir)
    from fedmerge.config.schema import load_config

    full = run(load_config(None, overrides), tmp_path / "full")
    assert_runs_identical(full.run_dir, run_dir)
