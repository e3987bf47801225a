"""benchmarks/device_check.py (the per-method accelerator check) must keep working: run on CPU here, and at the
path the docs named first (scripts/device_check.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import device_check  # noqa: E402


def test_device_check_runs_each_method_on_both_devices_and_skips_what_the_default_refuses(tmp_path, capsys):
    out = tmp_path / "checks.json"
    argv = ["--device", "cpu", "--rounds", "1", "--algorithms", "fedavg,fedlora", "--out", str(out)]
    assert device_check.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("fedavg") and lines[0].count("cpu 0.") == 2 and "vectorized 0." in lines[0]
    assert lines[1].startswith("fedlora") and "skipped: algorithm 'fedlora': fedlora needs a LoRA model" in lines[1]
    rows = json.loads(out.read_text())
    fedavg = rows[0]
    assert fedavg["cpu"]["status"] == "ok" and abs(fedavg["cpu"]["acc"] - fedavg["vectorized"]["acc"]) <= 0.01


def test_a_failed_run_is_reported_and_sets_the_exit_status(monkeypatch, capsys):
    def broken(cfg, folder, show_progress):
        raise RuntimeError("device lost")

    monkeypatch.setattr(device_check, "run_experiment", broken)
    assert device_check.main(["--device", "cpu", "--algorithms", "fedavg"]) == 1
    assert "cpu FAILED: RuntimeError: device lost" in capsys.readouterr().out


def test_the_documented_path_still_runs_the_check():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "device_check.py"), "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Every registered method on an accelerator" in proc.stdout
