"""The results folder of one run.

RUN_DIR/config.yaml        the resolved, validated config
RUN_DIR/metrics.jsonl      one JSON object per completed round
RUN_DIR/summary.json       final figures (also summary.md, a table)
RUN_DIR/checkpoints/       atomic checksummed checkpoints (see fedmerge.core.checkpoint)
RUN_DIR/federation.json    a deployed run only: what its SuperNodes reported about their data
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from fedmerge.config.schema import CONFIG_FILE, make_folder
from fedmerge.core.checkpoint import atomic_write_bytes

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
SUMMARY_MD = "summary.md"
CHECKPOINT_DIR = "checkpoints"
FEDERATION_FILE = "federation.json"  # a deployed run: what its SuperNodes reported about their data


def new_run_dir(output_dir: str | Path, name: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(output_dir) / f"{name}-{stamp}"
    path, i = base, 1
    while path.exists():
        path, i = base.with_name(f"{base.name}-{i}"), i + 1
    return make_folder(path, "output_dir", exist_ok=False)


class RunStore:
    def __init__(self, run_dir: str | Path) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)

    @property
    def checkpoint_dir(self) -> Path:
        return self.dir / CHECKPOINT_DIR

    def write_config(self, text: str) -> None:
        atomic_write_bytes(self.dir / CONFIG_FILE, text.encode())

    def read_config_path(self) -> Path:
        return self.dir / CONFIG_FILE

    def append_metrics(self, row: dict[str, Any]) -> None:
        with open(self.dir / METRICS_FILE, "a") as fh:
            fh.write(json.dumps(row, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def read_metrics(self) -> list[dict[str, Any]]:
        path = self.dir / METRICS_FILE
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut by a crash: everything after it is untrusted
        return rows

    def truncate_metrics(self, last_round: int) -> list[dict[str, Any]]:
        """Keep the rows of rounds <= last_round (the checkpointed ones); rewrite atomically."""
        rows = [r for r in self.read_metrics() if r["round"] <= last_round]
        text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
        atomic_write_bytes(self.dir / METRICS_FILE, text.encode())
        return rows

    def write_summary(self, summary: dict[str, Any], markdown: str) -> None:
        atomic_write_bytes(self.dir / SUMMARY_FILE, json.dumps(summary, indent=1, sort_keys=True).encode())
        atomic_write_bytes(self.dir / SUMMARY_MD, markdown.encode())


# --- a run folder as a comparison reads it back ----------------------------------------------

DONE, FAILED, INCOMPLETE, PENDING = "done", "failed", "incomplete", "pending"


@dataclass
class RunRecord:
    """One run as a comparison sees it."""

    key: str
    method: str
    setting: str
    seed: int
    status: str  # DONE, FAILED, INCOMPLETE (stopped before its end), PENDING (not started)
    run_dir: Path | None = None
    summary: dict[str, Any] | None = None
    error: str | None = None
