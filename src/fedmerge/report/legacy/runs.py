"""What the legacy report writers share: run names from labels, and runs read back once finished."""

from __future__ import annotations

import time
from pathlib import Path

from fedmerge.config.schema import load_config
from fedmerge.run.results import SUMMARY_FILE
from fedmerge.run.run_records import RunSummary, as_summary, read_summary
from fedmerge.run.runner import run_experiment


def slug(text: str) -> str:
    """``text`` as a file name: lower case, every other character a single ``-``."""
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-").replace("--", "-")


def run_once(config: str, overrides: list[str], run_dir: Path) -> RunSummary:
    """The run's summary; read back when ``run_dir`` already holds a finished run (reports resume)."""
    done = run_dir / SUMMARY_FILE
    if done.exists():
        return read_summary(done)
    t0 = time.perf_counter()
    summary = as_summary(run_experiment(load_config(config, overrides), run_dir, show_progress=False).summary)
    acc = summary.last.clients["test_acc"].mean if summary.last is not None else float("nan")
    print(f"{run_dir.name}: mean client test_acc {acc:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return summary
