"""The launcher that sweeps and studies share: which run a job continues, and the command it starts."""

from __future__ import annotations

import sys
from pathlib import Path

from fedmerge.sweep.launch import Launcher, RunJob, finished_run, started_run


def make_run(folder: Path, finished: bool) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("rounds: 1\n")
    if finished:
        (folder / "summary.json").write_text("{}")
    return folder


def test_a_run_is_found_at_its_out_folder_or_as_the_newest_inside_its_output_dir(tmp_path):
    assert started_run(tmp_path / "missing") is None
    sweep_run = make_run(tmp_path / "sweep" / "k", finished=False)  # --out: the run folder itself
    assert started_run(sweep_run) == sweep_run and finished_run(sweep_run) is None
    study = tmp_path / "study" / "k"  # --output-dir: NAME-TIMESTAMP folders inside
    make_run(study / "k-20260101-000000", finished=True)
    newest = make_run(study / "k-20260102-000000", finished=False)
    (study / "notes").mkdir()  # not a run
    assert started_run(study) == newest and finished_run(study) is None
    (newest / "summary.json").write_text("{}")
    assert finished_run(study) == newest


def test_a_started_run_is_resumed_and_a_new_one_started_with_its_arguments(tmp_path):
    job = RunJob("k", ("base.yaml", "seed=1", "--output-dir", str(tmp_path / "k")), tmp_path / "k", tmp_path / "k.log")
    fedmerge_run = [sys.executable, "-m", "fedmerge", "run"]
    assert job.command() == [*fedmerge_run, "base.yaml", "seed=1", "--output-dir", str(tmp_path / "k"), "--no-progress"]
    run = make_run(tmp_path / "k" / "k-20260101-000000", finished=False)
    assert job.command() == [*fedmerge_run, "--resume", str(run), "--no-progress"]


def test_each_job_gets_its_share_of_the_cores_for_its_workers(tmp_path, monkeypatch):
    import fedmerge.sweep.launch as launch

    monkeypatch.setattr(launch, "cores", lambda: 8)
    assert Launcher(jobs=3).cores_each == 2 and Launcher(jobs=10_000).cores_each == 1
    assert Launcher(jobs=0).jobs == 1
    # what the run process sees: its share, which its workers: auto reads (available_cores)
    show = "import os; from fedmerge.engines.workers import available_cores; "
    show += "print(available_cores(), os.environ['OMP_NUM_THREADS'])"
    monkeypatch.setattr(RunJob, "command", lambda self: [sys.executable, "-c", show])
    Launcher(jobs=8).execute(RunJob("k", (), tmp_path / "k", tmp_path / "k.log"))  # 1 core each
    assert (tmp_path / "k.log").read_text().splitlines()[-1] == "1 1"  # the share caps the affinity
