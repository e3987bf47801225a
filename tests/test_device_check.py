"""scripts/device_check.py (the per-method accelerator check) must keep working: run on CPU here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_device_check_runs_each_method_on_both_devices_and_skips_what_the_default_refuses(tmp_path):
    out = tmp_path / "checks.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "device_check.py"), "--device", "cpu", "--rounds", "1"]
    proc = subprocess.run(
        [*cmd, "--algorithms", "fedavg,fedlora", "--out", str(out)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("fedavg") and lines[0].count("cpu 0.") == 2 and "vectorized 0." in lines[0]
    assert lines[1].startswith("fedlora") and "skipped: algorithm 'fedlora': fedlora needs a LoRA model" in lines[1]
    rows = json.loads(out.read_text())
    fedavg = rows[0]
    assert fedavg["cpu"]["status"] == "ok" and abs(fedavg["cpu"]["acc"] - fedavg["vectorized"]["acc"]) <= 0.01
