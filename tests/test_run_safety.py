"""Run folder safety: one writer per folder, resumes that keep every round, and a user's files never
overwritten (issue 51)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import _cli_env, assert_runs_identical, quick_config, run, strip_timing
from typer.testing import CliRunner

from fedmerge.cli import app
from fedmerge.run.folder_lock import HOLDER_FILE, active_writer, writing_run_folder
from fedmerge.run.results import RunStore

HOLD = (
    "import sys, time\n"
    "from fedmerge.run.folder_lock import writing_run_folder\n"
    "with writing_run_folder(sys.argv[1]):\n"
    "    print('held', flush=True)\n"
    "    time.sleep(120)\n"
)


@pytest.fixture
def holder():
    """Start a process that holds a run folder's lock (as a run does) and return it once it does."""
    procs = []

    def start(run_dir: Path) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(run_dir)], env=_cli_env(), stdout=subprocess.PIPE, text=True
        )
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def cli(*args: str):
    return CliRunner().invoke(app, [*map(str, args), "--no-progress"] if args[0] == "run" else list(map(str, args)))


def one_line_error(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in result.output, result.output
    return lines[0]


# --- one writer per run folder ---------------------------------------------------------------------


def test_a_second_writer_is_refused_in_one_line_naming_the_holder(tmp_path, holder):
    run_dir = tmp_path / "r"
    run(quick_config("rounds=2"), run_dir, stop_after=1)
    proc = holder(run_dir)
    before = (run_dir / "metrics.jsonl").read_bytes()
    result = cli("run", "--resume", run_dir)
    assert result.exit_code == 2
    line = one_line_error(result)
    assert f"pid {proc.pid} on host {socket.gethostname()}" in line and "being written by another" in line
    assert (run_dir / "metrics.jsonl").read_bytes() == before  # the refused process wrote nothing


@pytest.mark.slow  # starts a fedmerge process
def test_a_resume_while_the_run_itself_is_still_going_is_refused(tmp_path):
    """The issue's case: ``fedmerge run rounds=600 --out conc &`` then ``fedmerge run --resume conc``."""
    run_dir = tmp_path / "conc"
    command = [sys.executable, "-m", "fedmerge.cli", "run", "rounds=600", "--out", str(run_dir), "--no-progress"]
    proc = subprocess.Popen(command, env=_cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while RunStore(run_dir).recorded_rounds() < 1 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before the test could resume it"
        result = cli("run", "--resume", run_dir)
        assert result.exit_code == 2 and f"pid {proc.pid} on host" in one_line_error(result)
        assert active_writer(run_dir).pid == proc.pid
    finally:
        proc.kill()
        proc.wait(timeout=10)
    rounds = [r["round"] for r in RunStore(run_dir).read_metrics()]
    assert rounds == list(range(1, len(rounds) + 1))  # one writer: no round twice, none out of order


def test_the_lock_of_a_writer_that_died_is_taken_over(tmp_path, holder):
    run_dir = tmp_path / "r"
    cfg = quick_config("rounds=2")
    run(cfg, run_dir, stop_after=1)
    proc = holder(run_dir)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert json.loads((run_dir / HOLDER_FILE).read_text())["pid"] == proc.pid  # left behind by kill -9
    assert active_writer(run_dir) is None  # a report does not take it for a live run
    with writing_run_folder(run_dir):
        assert json.loads((run_dir / HOLDER_FILE).read_text())["pid"] == os.getpid()
    assert not (run_dir / HOLDER_FILE).exists()
    result = cli("run", "--resume", run_dir)
    assert result.exit_code == 0, result.output
    assert RunStore(run_dir).recorded_rounds() == 2


def test_report_on_a_folder_being_written_says_so(tmp_path, holder):
    run_dir = tmp_path / "r"
    run(quick_config("rounds=2"), run_dir, stop_after=1)
    proc = holder(run_dir)
    result = cli("report", run_dir, "-o", tmp_path / "report.html")
    assert result.exit_code == 0, result.output
    assert f"run in progress (pid {proc.pid} on host {socket.gethostname()}" in " ".join(result.output.split())
    assert "run in progress" in (tmp_path / "report.html").read_text()


# --- resume never loses a record -------------------------------------------------------------------


def cut_last_line(path: Path) -> None:
    text = path.read_bytes()
    path.write_bytes(text[: text.rstrip(b"\n").rfind(b"\n") + 1 + 40])  # 40 bytes of the last line remain


def test_a_cut_last_record_is_rolled_back_and_its_round_made_again_bit_identical(tmp_path):
    cfg = quick_config("rounds=3")
    full = run(cfg, tmp_path / "full")
    run(cfg, tmp_path / "cut")
    cut_last_line(tmp_path / "cut" / "metrics.jsonl")
    cut_last_line(tmp_path / "cut" / "provenance.jsonl")
    result = cli("run", "--resume", tmp_path / "cut")
    assert result.exit_code == 0, result.output
    rows = RunStore(tmp_path / "cut").read_metrics()
    assert [r["round"] for r in rows] == [1, 2, 3]
    notice = "the record of round 3 is cut or missing; rolled back to the checkpoint of round 2, round 3 is made again"
    assert notice in " ".join(result.output.split())
    assert_runs_identical(full.run_dir, tmp_path / "cut")
    summaries = [json.loads((d / "summary.json").read_text()) for d in (full.run_dir, tmp_path / "cut")]
    assert strip_timing(summaries[0]) == strip_timing(summaries[1])
    lines = (tmp_path / "cut" / "provenance.jsonl").read_text().splitlines()
    assert [json.loads(line)["resumed"] for line in lines] == [True]  # the cut line is dropped, not glued to


def test_a_cut_record_older_than_every_checkpoint_makes_the_run_again_from_the_start(tmp_path):
    cfg = quick_config("rounds=3")  # keep_checkpoints=2: rounds 2 and 3 kept
    full = run(cfg, tmp_path / "full")
    run(cfg, tmp_path / "cut")
    path = tmp_path / "cut" / "metrics.jsonl"
    path.write_bytes(path.read_bytes().split(b"\n")[0] + b"\n" + b'{"round": 2, "tra')
    notices: list[str] = []
    from fedmerge.run.runner import run_experiment

    run_experiment(cfg, tmp_path / "cut", resume=True, show_progress=False, notify=notices.append)
    assert any("rolled back to the start" in n for n in notices), notices
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").glob("round-*")) == [
        "round-000002.safetensors",
        "round-000003.safetensors",
    ]
    assert_runs_identical(full.run_dir, tmp_path / "cut")


def test_resume_can_never_shorten_a_run(tmp_path):
    run_dir = tmp_path / "r"
    run(quick_config("rounds=2"), run_dir)
    before = (run_dir / "summary.json").read_bytes()
    result = cli("run", "--resume", run_dir, "rounds=1")
    assert result.exit_code == 2
    assert "rounds=1: the run has 2 rounds; a resume can add rounds, never take them away" in one_line_error(result)
    assert (run_dir / "summary.json").read_bytes() == before


def test_resuming_a_finished_run_changes_nothing(tmp_path):
    run_dir = tmp_path / "r"
    run(quick_config("rounds=2"), run_dir)
    files = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".writer.lock"}
    result = cli("run", "--resume", run_dir)
    assert result.exit_code == 0, result.output
    assert "already finished its 2 rounds; nothing changed" in " ".join(result.output.split())
    assert {p: p.read_bytes() for p in files} == files  # summary.json, metrics, provenance, checkpoints


def test_wall_seconds_only_grows_across_resumes(tmp_path):
    run_dir = tmp_path / "r"
    run(quick_config("rounds=2"), run_dir)
    first = json.loads((run_dir / "summary.json").read_text())["wall_seconds"]
    result = cli("run", "--resume", run_dir, "rounds=3")  # extended: one more round
    assert result.exit_code == 0, result.output
    second = json.loads((run_dir / "summary.json").read_text())["wall_seconds"]
    assert second > first
    assert "rounds: 3" in (run_dir / "config.yaml").read_text()  # the config says how long the run is now
    again = cli("run", "--resume", run_dir)  # so a plain resume is neither refused nor re-made
    assert again.exit_code == 0 and "already finished its 3 rounds" in " ".join(again.output.split())


# --- a user's files are never overwritten ----------------------------------------------------------


@pytest.mark.parametrize("name", ["summary.md", "summary.json", "metrics.jsonl", "provenance.jsonl", "checkpoints"])
def test_out_into_a_folder_with_a_file_the_run_would_write_is_refused(tmp_path, name):
    folder = tmp_path / "mine"
    folder.mkdir()
    mine = folder / name
    if name == "checkpoints":
        mine.mkdir()
        mine = mine / "notes.txt"
    mine.write_text("my own notes\n")
    result = cli("run", "rounds=1", "--out", folder)
    assert result.exit_code == 2
    assert f"already holds {name}, which a run would overwrite" in one_line_error(result)
    assert mine.read_text() == "my own notes\n"
    assert sorted(p.name for p in folder.iterdir()) == [name]


def test_every_file_of_a_run_is_one_of_the_names_refused(tmp_path):
    from fedmerge.run.results import RUN_FILES

    result = run(quick_config("rounds=1"), tmp_path / "r")
    written = {p.name for p in result.run_dir.iterdir()} - {".writer.lock"}
    assert written <= set(RUN_FILES), written - set(RUN_FILES)
