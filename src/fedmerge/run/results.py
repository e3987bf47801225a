"""The results folder of one run.

RUN_DIR/config.yaml        the resolved, validated config
RUN_DIR/metrics.jsonl      one JSON object per completed round
RUN_DIR/summary.json       final figures (also summary.md, a table)
RUN_DIR/checkpoints/       atomic checksummed checkpoints (see fedmerge.core.checkpoint)
RUN_DIR/federation.json    a deployed run only: what its SuperNodes reported about their data
RUN_DIR/provenance.jsonl   one line per segment: the command, versions and commit (fedmerge.run.provenance)
RUN_DIR/tensorboard/       with log.tensorboard: the per-round scalars
RUN_DIR/.writer.lock       held by the one process writing the folder (fedmerge.run.folder_lock)

Every file is written to a temporary name in the folder and renamed; the two logs are appended one
whole, fsynced line at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from fedmerge.config.schema import CONFIG_FILE, ConfigError, make_folder
from fedmerge.core.checkpoint import atomic_write_bytes
from fedmerge.run.records import all_readable_rows, append_line, read_lines, rewrite_lines
from fedmerge.run.run_records import RoundRecord, RunSummary, round_records, summary_or_none, write_summary

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
SUMMARY_MD = "summary.md"
CHECKPOINT_DIR = "checkpoints"
FEDERATION_FILE = "federation.json"  # a deployed run: what its SuperNodes reported about their data
PROVENANCE_FILE = "provenance.jsonl"
TENSORBOARD_DIR = "tensorboard"
# every name a run writes in its folder: a new run is never started where one of them is
RUN_FILES = (
    CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, SUMMARY_MD, CHECKPOINT_DIR, FEDERATION_FILE, PROVENANCE_FILE,
    TENSORBOARD_DIR,
)  # fmt: skip


def new_run_dir(output_dir: str | Path, name: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(output_dir) / f"{name}-{stamp}"
    path, i = base, 1
    while path.exists():
        path, i = base.with_name(f"{base.name}-{i}"), i + 1
    return make_folder(path, "output_dir", exist_ok=False)


def new_run_folder_problem(run_dir: str | Path, option: str = "run folder") -> str | None:
    """Why a new run cannot start in ``run_dir`` (one line), or None: the folder holds a file the run would
    write, a run's own (continue it with ``--resume``) or a user's (never overwritten)."""
    folder = Path(run_dir)
    if (folder / CONFIG_FILE).exists():
        return f"{option} {folder} already holds a run; to continue it: fedmerge run --resume {folder}"
    taken = [name for name in RUN_FILES if (folder / name).exists()]
    if taken:
        return f"{option} {folder} already holds {taken[0]}, which a run would overwrite; choose a new or empty folder"
    return None


def check_new_run_folder(run_dir: str | Path, option: str = "run folder") -> None:
    """[`new_run_folder_problem()`][fedmerge.run.results.new_run_folder_problem] as a `ConfigError`."""
    if (problem := new_run_folder_problem(run_dir, option)) is not None:
        raise ConfigError(problem)


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

    def append_metrics(self, row: RoundRecord | Mapping[str, Any]) -> None:
        typed = row if isinstance(row, RoundRecord) else RoundRecord.from_dict(row)
        append_line(self.dir / METRICS_FILE, typed.to_dict(), sort_keys=True)

    def read_metrics(self) -> list[dict[str, Any]]:
        """The rows written whole; a line cut by a crash, and everything after it, is untrusted."""
        return read_lines(self.dir / METRICS_FILE)[0]

    def read_rounds(self) -> list[RoundRecord]:
        """[`read_metrics()`][fedmerge.run.results.RunStore.read_metrics], typed."""
        return round_records(self.read_metrics())

    def recorded_rounds(self) -> int:
        """The last round R such that rounds 1..R each have their row, whole and in order."""
        done = 0
        for row in self.read_metrics():
            if row.get("round") != done + 1:
                break
            done += 1
        return done

    def time_spent(self) -> float:
        """Seconds the run's earlier segments ran: the most any row or the summary recorded (rows past a
        damaged line count too: that time was spent)."""
        rows = round_records(all_readable_rows(self.dir / METRICS_FILE))
        spent = [float(r.elapsed_seconds) for r in rows if isinstance(r.elapsed_seconds, int | float)]
        summary = self.read_summary()
        if summary is not None and isinstance(summary.wall_seconds, int | float):
            spent.append(float(summary.wall_seconds))
        return max(spent, default=0.0)

    def truncate_metrics(self, last_round: int) -> list[dict[str, Any]]:
        """Keep the rows of rounds 1..last_round (the checkpointed ones, whole and in order); rewrite atomically."""
        rows = self.read_metrics()[: min(last_round, self.recorded_rounds())]
        rewrite_lines(self.dir / METRICS_FILE, rows, sort_keys=True)
        return rows

    def read_summary(self) -> RunSummary | None:
        """The run's summary; None before it finished (a newer layout is refused in one line)."""
        return summary_or_none(self.dir / SUMMARY_FILE)

    def write_summary(self, summary: Mapping[str, Any] | RunSummary, markdown: str) -> None:
        typed = summary if isinstance(summary, RunSummary) else RunSummary.from_dict(summary)
        write_summary(self.dir / SUMMARY_FILE, typed)
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
    summary: RunSummary | None = None  # a summary's dict is read into one
    error: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.summary, Mapping):
            self.summary = RunSummary.from_dict(self.summary)
