"""Shared test utilities (imported by test modules)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fedmerge.config.schema import load_config
from fedmerge.core.checkpoint import load_checkpoint
from fedmerge.run.results import RunStore
from fedmerge.run.runner import run_experiment
from fedmerge.run.summary import TIMING_KEYS

QUICK = ["rounds=4", "partition.num_clients=6", "algorithm.local_epochs=1"]


def quick_config(*overrides: str, output_dir: Path | None = None):
    extra = [f"output_dir={output_dir}"] if output_dir is not None else []
    return load_config(None, [*QUICK, *extra, *overrides])


def run(cfg, run_dir: Path, **kw):
    return run_experiment(cfg, run_dir, show_progress=False, **kw)


def strip_timing(obj):
    if isinstance(obj, dict):
        return {k: strip_timing(v) for k, v in obj.items() if k not in TIMING_KEYS}
    if isinstance(obj, list):
        return [strip_timing(v) for v in obj]
    return obj


def assert_runs_identical(dir_a: Path, dir_b: Path) -> None:
    """Same metrics (every round, every client), same final server and client tensors, bit for bit."""
    rows_a, rows_b = RunStore(dir_a).read_metrics(), RunStore(dir_b).read_metrics()
    assert [r["round"] for r in rows_a] == [r["round"] for r in rows_b]
    assert strip_timing(rows_a) == strip_timing(rows_b)
    ca, cb = load_checkpoint(Path(dir_a) / "checkpoints"), load_checkpoint(Path(dir_b) / "checkpoints")
    assert ca.round == cb.round
    assert ca.server_state.tensors.keys() == cb.server_state.tensors.keys()
    for k, v in ca.server_state.tensors.items():
        assert torch.equal(v, cb.server_state.tensors[k]), k
    assert ca.client_states.keys() == cb.client_states.keys()
    for cid, cs in ca.client_states.items():
        assert cs.meta == cb.client_states[cid].meta
        for k, v in cs.tensors.items():
            assert torch.equal(v, cb.client_states[cid].tensors[k]), (cid, k)


def kill_9_run_after(overrides: list[str], output_dir: Path, rounds_logged: int) -> Path:
    """Start ``fedmerge run`` (with ``name=killed`` in ``overrides``) as a process, SIGKILL it a moment
    after ``rounds_logged`` rounds are in its metrics.jsonl, and return its run folder."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedmerge.cli", "run", *overrides, "--no-progress"],
        env=_cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            metrics = list(output_dir.glob("killed-*/metrics.jsonl"))
            if metrics and len(metrics[0].read_text().splitlines()) >= rounds_logged:
                break
            if proc.poll() is not None:
                pytest.fail(f"run ended before it could be killed: {proc.stderr.read().decode()}")
            time.sleep(0.01)
        else:
            pytest.fail(f"run did not reach round {rounds_logged} in time")
        time.sleep(0.05)  # land inside a later round
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    return metrics[0].parent


def resume_in_process(run_dir: Path) -> None:
    """``fedmerge run --resume RUN_DIR`` as a new process; it must succeed."""
    resumed = subprocess.run(
        [sys.executable, "-m", "fedmerge.cli", "run", "--resume", str(run_dir), "--no-progress"],
        env=_cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr


def _cli_env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(sys.path))
