"""Where a study's runs execute (``--launcher local|ray|slurm``), the preflight before any run starts, and
``fedmerge study --dry-run``. Nothing here starts a run; the launchers on real engines are in
tests/test_clusters.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fedmerge.cli import app
from fedmerge.config.schema import ConfigError
from fedmerge.study import preflight
from fedmerge.study.spec import load_study_file
from fedmerge.sweep.clusters import LaunchOptions, RayLauncher, SlurmLauncher, SlurmRun, make_launcher
from fedmerge.sweep.launch import Launcher, RunJob

TINY = Path(__file__).resolve().parent / "data" / "study_tiny"


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    for name in ("base.yaml", "study_tiny.yaml"):
        shutil.copy(TINY / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def on_cuda(folder: Path) -> None:
    base = yaml.safe_load((folder / "base.yaml").read_text())
    (folder / "base.yaml").write_text(yaml.safe_dump({**base, "device": "cuda"}))


def test_the_launcher_is_chosen_by_name_and_local_stays_the_default(tmp_path):
    assert type(make_launcher(LaunchOptions())) is Launcher
    assert make_launcher(LaunchOptions(jobs=3)).jobs == 3
    assert isinstance(make_launcher(LaunchOptions("ray", ray_address="auto", gpus_per_run=0.25)), RayLauncher)
    slurm = make_launcher(LaunchOptions("slurm", jobs=4, cpus_per_run=2), work_dir=tmp_path)
    assert isinstance(slurm, SlurmLauncher) and slurm.cores_each == 2


@pytest.mark.parametrize(
    "options, message",
    [
        (LaunchOptions("kubernetes"), "expected one of local, ray, slurm"),
        (LaunchOptions("slurm", gpus_per_run=0.5), "SLURM gives whole GPUs"),
        (LaunchOptions("local", ray_address="auto"), "--ray-address is for --launcher ray"),
        (LaunchOptions("ray", slurm_partition="gpu"), "--slurm-partition is for --launcher slurm"),
        (LaunchOptions("ray", cpus_per_run=0), "--cpus-per-run must be above 0"),
    ],
)
def test_launch_options_that_cannot_work_are_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        options.check()


def test_a_cuda_study_on_a_machine_without_cuda_is_refused_in_one_line_before_any_run_folder(tiny, monkeypatch):
    on_cuda(tiny)
    monkeypatch.setattr(preflight, "cuda_available", lambda: False)
    result = CliRunner().invoke(app, ["study", "study_tiny.yaml"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith("error: study_tiny.yaml: its runs ask for device: cuda, and this machine has no CUDA")
    assert not (tiny / "runs").exists()


def test_a_cuda_study_on_a_cluster_needs_a_gpu_per_run_and_gpus_in_the_cluster(tiny):
    on_cuda(tiny)
    study = load_study_file(Path("study_tiny.yaml")).history()[-1]
    with pytest.raises(preflight.PreflightError, match="give each run a GPU"):
        preflight.check_device(study, LaunchOptions("slurm"))
    with pytest.raises(preflight.PreflightError, match="the Ray cluster has 0 GPU"):
        preflight.check_device(study, LaunchOptions("ray", gpus_per_run=0.5), cluster_gpus=0)
    preflight.check_device(study, LaunchOptions("ray", gpus_per_run=0.5), cluster_gpus=1)  # half a GPU each
    preflight.check_device(study, LaunchOptions("slurm", gpus_per_run=1))


def test_a_cpu_study_passes_the_preflight_everywhere(tiny):
    study = load_study_file(Path("study_tiny.yaml")).history()[-1]
    for launcher in ("local", "ray", "slurm"):
        preflight.check_device(study, LaunchOptions(launcher), cluster_gpus=0)


def test_the_dry_run_prints_the_runs_their_resources_the_count_and_the_stated_gpu_hours(tiny):
    spec = yaml.safe_load((tiny / "study_tiny.yaml").read_text())
    spec["description"] += " Estimated cost: about 1,234.5 GPU hours on one H100. Downloads: none."
    (tiny / "study_tiny.yaml").write_text(yaml.safe_dump(spec))
    args = ["study", "study_tiny.yaml", "--dry-run", "--launcher", "ray", "--gpus-per-run", "0.5"]
    result = CliRunner().invoke(app, [*args, "--cpus-per-run", "2", "--ray-address", "auto"])
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    # the latest revision: Local 2 points, FedAvg 1 + its extra point, tuned on seed 1; then seed 0 per row
    assert "tuning (seed 1): local-g0-s1: algorithm.name=local algorithm.lr=0.05 seed=1" in lines
    assert "seeds: FedAvg, its chosen point, seed 0" in lines
    assert "each run: 2 CPU(s), 0.5 GPU(s) per Ray task on auto" in lines
    assert "6 runs (4 tuning, 2 seeds); then 2 central reference(s), trained in this process" in lines
    assert lines[-1] == "the study states about 1234.5 GPU hours on one H100"
    assert not (tiny / "runs").exists()


def test_every_paper_study_states_its_gpu_hours_for_the_dry_run():
    root = Path(__file__).resolve().parents[1] / "studies" / "paper"
    files = sorted(root.glob("*.yaml"))
    assert files
    for file in files:
        study = load_study_file(file).history()[-1]
        assert preflight.stated_gpu_hours(study) is not None, file.name


def test_a_requeued_slurm_task_continues_the_run_from_its_checkpoint(tmp_path):
    """submitit calls checkpoint() on preemption or time-out; the requeued callable makes its command when
    it starts, so once the run folder exists it is `fedmerge run --resume FOLDER`, not a new run."""
    submitit = pytest.importorskip("submitit")
    job = RunJob("k", ("base.yaml", "--output-dir", str(tmp_path / "k")), tmp_path / "k", tmp_path / "k.log")
    again = SlurmRun(job, {}).checkpoint()
    assert isinstance(again, submitit.helpers.DelayedSubmission)
    assert "--output-dir" in again.function.job.command()
    run = tmp_path / "k" / "study-tiny-20260101-000000"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("name: x\n")
    assert again.function.job.command()[-3:] == ["--resume", str(run), "--no-progress"]


def test_status_shows_each_rows_runs_read_from_the_run_folders(tiny):
    shutil.copytree(TINY / "runs", tiny / "runs")
    run = next((tiny / "runs/repro/study_tiny/fedavg-g1-s1").glob("*/summary.json")).parent
    (run / "summary.json").unlink()  # a run stopped before its end; its tuning row is not over
    (run / "metrics.jsonl").write_text('{"round": 1}\n')
    result = CliRunner().invoke(app, ["study", "study_tiny.yaml", "--revision", "first", "--status"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[1:] == [
        "Local: tuning 2/2 done",
        "Local: seeds 1/1 done",
        "FedAvg: tuning 1/2 done",
        "  fedavg-g1-s1: stopped at round 1/2",
        "  seeds [0]: after tuning",
        "central references: 2/2",
    ]
    (run / ".writer.json").write_text('{"pid": 1, "host": "node7"}')
    result = CliRunner().invoke(app, ["study", "study_tiny.yaml", "--revision", "first", "--status"])
    assert "  fedavg-g1-s1: running on node7 (round 1/2)" in result.output.splitlines()


def test_a_cluster_job_carries_absolute_paths_and_the_studys_folder(tiny):
    job = RunJob("k", ("base.yaml", "--output-dir", "runs/k"), Path("runs/k"), Path("runs/logs/k.log"))
    far = job.anywhere()
    assert (far.where, far.log, far.cwd) == (tiny / "runs/k", tiny / "runs/logs/k.log", str(tiny))
    assert far.args == job.args  # relative to far.cwd, where the run process starts
    assert far.anywhere() == far


def test_ray_runs_no_node_can_hold_are_refused_before_any_run():
    """A task asking for more than any one node has waits in Ray's queue forever: refused in one line. By hand:
    4 CPUs fit the 8-CPU node; 1 GPU with 4 CPUs needs a node with both (the GPU node has only 2 CPUs)."""
    from fedmerge.study.preflight import PreflightError, check_ray_nodes

    nodes = [{"CPU": 8.0}, {"CPU": 2.0, "GPU": 1.0}]
    check_ray_nodes(LaunchOptions("ray", ray_address="auto", cpus_per_run=4), nodes)
    check_ray_nodes(LaunchOptions("ray", ray_address="auto", cpus_per_run=2, gpus_per_run=0.5), nodes)
    with pytest.raises(PreflightError) as info:
        check_ray_nodes(LaunchOptions("ray", ray_address="auto", cpus_per_run=4, gpus_per_run=1), nodes)
    message = str(info.value)
    assert "\n" not in message and "no node of the Ray cluster has them" in message
    assert "the largest: 2 CPU(s), 1 GPU(s)" in message
    with pytest.raises(PreflightError):
        check_ray_nodes(LaunchOptions("ray", ray_address="auto", cpus_per_run=16), nodes)
    check_ray_nodes(LaunchOptions(), [])  # the local launcher asks nothing of a cluster
