"""Studies on real distributed engines (``--launcher ray|slurm``), against the local launcher's report.

Ray: a head (no CPUs: it only schedules) and two worker nodes of one CPU each, started with ``ray start`` on
localhost; a study of eight tiny runs goes to them and one worker node is killed (its whole process group,
raylet, Ray workers and the ``fedmerge run`` it ran, as if the machine were lost) while runs are in
progress. Ray retries the lost task on the other node, the retry continues the run folder
(``fedmerge run --resume``), and the report is the local launcher's.

SLURM: no SLURM controller can be started in this test environment (no ``slurm-wlm``/``munge`` here; see
docs/guide/clusters.md), so the SLURM launcher runs its job arrays through submitit's local executor, which
runs the same pickled callables, with the same checkpoint/requeue protocol, as local processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "study_tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def eight_run_study(folder: Path) -> Path:
    """The tiny golden study, first revision, on three seeds: 4 tuning runs, then 2 rows x 2 more seeds."""
    shutil.copy(TINY / "base.yaml", folder / "base.yaml")
    spec = yaml.safe_load((TINY / "study_tiny.yaml").read_text())
    spec.pop("revisions")
    spec["seeds"] = [0, 1, 2]
    (folder / "study8.yaml").write_text(yaml.safe_dump(spec))
    return folder / "study8.yaml"


def env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "RAY_USAGE_STATS_ENABLED": "0"}


def study(folder: Path, runs: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fedmerge", "study", "study8.yaml", "--runs", runs, "--out", f"{runs}.md", *args]
    return subprocess.run(cmd, cwd=folder, env=env(), capture_output=True, text=True, timeout=timeout)


def numbers(folder: Path, runs: str) -> dict:
    """What the report says of the runs: every row and regime check (paths, times and commits left out)."""
    data = json.loads((folder / f"{runs}.json").read_text())
    return {"rows": data["rows"], "chosen": data.get("chosen"), "regime": data["regime"]}


@pytest.fixture(scope="module")
def local_report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("local")
    eight_run_study(folder)
    done = study(folder, "local", "-j", "2")
    assert done.returncode == 0, done.stderr
    return numbers(folder, "local")


SWEEP = ["base.yaml", "algorithm.name=[local,fedavg]", "rounds=1", "--no-progress"]


def sweep_numbers(folder: Path) -> dict:
    """Each sweep run's results (best-validation and last round), by run key."""
    summaries = sorted((folder / "runs").glob("*/summary.json"))
    return {s.parent.name: {k: json.loads(s.read_text())[k] for k in ("best_val", "last")} for s in summaries}


@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory):
    folder = tmp_path_factory.mktemp("local_sweep")
    eight_run_study(folder)
    cmd = [sys.executable, "-m", "fedmerge", "sweep", *SWEEP, "--out", "sweep", "-j", "2"]
    done = subprocess.run(cmd, cwd=folder, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return sweep_numbers(folder / "sweep")


def in_progress(runs: Path) -> list[Path]:
    """Run folders that have started (config.yaml) and not finished (summary.json)."""
    return [c.parent for c in runs.glob("*/*/config.yaml") if not (c.parent / "summary.json").exists()]


@pytest.mark.processes
def test_a_study_on_a_localhost_ray_cluster_survives_a_lost_node_with_the_local_report(
    tmp_path, local_report, local_sweep
):
    pytest.importorskip("ray")
    ray = shutil.which("ray") or pytest.fail("the ray command is not installed (pip install 'fedmerge[cluster]')")
    port = free_port()
    address = f"127.0.0.1:{port}"
    head_env = {
        **env(),  # a lost node is found within seconds, not the default half a minute
        "RAY_health_check_initial_delay_ms": "0",
        "RAY_health_check_period_ms": "1000",
        "RAY_health_check_timeout_ms": "1000",
        "RAY_health_check_failure_threshold": "3",
    }
    nodes: list[subprocess.Popen] = []
    try:
        head = [ray, "start", "--head", "--port", str(port), "--num-cpus", "0", "--include-dashboard=false"]
        subprocess.run(head, env=head_env, cwd=tmp_path, check=True, capture_output=True, timeout=120)
        for _ in range(2):  # each worker node in a process group of its own: killed as a machine would be lost
            worker = [ray, "start", "--address", address, "--num-cpus", "1"]
            nodes.append(
                subprocess.Popen(worker, env=env(), cwd=tmp_path, start_new_session=True, stdout=subprocess.DEVNULL)
            )
            assert nodes[-1].wait(timeout=120) == 0
        eight_run_study(tmp_path)
        cmd = [sys.executable, "-m", "fedmerge", "study", "study8.yaml", "--runs", "ray", "--out", "ray.md"]
        cmd += ["--launcher", "ray", "--ray-address", address, "--cpus-per-run", "1"]
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 300
        while len(in_progress(tmp_path / "ray")) < 2:  # both nodes busy: the lost one takes a started run with it
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.2)
        lost = in_progress(tmp_path / "ray")
        os.killpg(nodes[0].pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, stderr
        # a sweep on what is left of the cluster (one worker node)
        cmd = [sys.executable, "-m", "fedmerge", "sweep", *SWEEP, "--out", "sweep", "--launcher", "ray"]
        swept = subprocess.run(
            [*cmd, "--ray-address", address], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=600
        )
        assert swept.returncode == 0, swept.stderr
    finally:
        subprocess.run([ray, "stop", "--force"], env=env(), capture_output=True, timeout=120)
        for node in nodes:
            try:
                os.killpg(node.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    # progress in the local launcher's lines: tuning (4 runs), then the other seeds (4 more)
    assert "4 runs to do (0 done)" in stderr and "4 runs to do (2 done)" in stderr
    assert stderr.count("[4/4] ") == 2 and "FAILED" not in stderr
    assert numbers(tmp_path, "ray") == local_report
    assert sweep_numbers(tmp_path / "sweep") == local_sweep and len(local_sweep) == 2
    logs = {p.name: p.read_text() for p in (tmp_path / "ray" / "logs").glob("*.log")}
    resumed = [name for name, text in logs.items() if "--resume" in text]
    assert resumed, f"no run continued from its folder after the node was lost ({[p.name for p in lost]})"
    for name in resumed:  # the retry continued the folder that the lost attempt had started
        assert logs[name].count("\n$ ") + logs[name].startswith("$ ") >= 2


@pytest.mark.processes
def test_a_study_as_submitit_job_arrays_gives_the_local_report(tmp_path, local_report):
    pytest.importorskip("submitit")
    eight_run_study(tmp_path)
    done = study(tmp_path, "slurm", "--launcher", "slurm", "--slurm-cluster", "local", "-j", "2", "--slurm-time", "10")
    assert done.returncode == 0, done.stderr
    assert numbers(tmp_path, "slurm") == local_report
    assert len(list((tmp_path / "slurm" / "slurm").iterdir())) >= 8  # submitit's files of every array task


def slurm_running() -> bool:
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return False
    done = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
    return done.returncode == 0 and bool({"idle", "mix"} & set(done.stdout.split()))


@pytest.mark.processes
def test_a_study_as_real_slurm_job_arrays_survives_a_requeued_job_with_the_local_report(tmp_path, local_report):
    """On a running SLURM (.ci/run starts a one-node one with scripts/slurm_one_node.sh): the running jobs are
    taken away mid-run (``scontrol requeue``: SIGTERM, SIGKILL, back in the queue), as a preemption does; each
    requeued job continues its run folder."""
    pytest.importorskip("submitit")
    if not slurm_running():
        pytest.skip("no SLURM controller answers here (.ci/run starts one: scripts/slurm_one_node.sh)")
    eight_run_study(tmp_path)
    cmd = [sys.executable, "-m", "fedmerge", "study", "study8.yaml", "--runs", "slurm", "--out", "slurm.md"]
    cmd += ["--launcher", "slurm", "-j", "2", "--slurm-time", "30"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not any((run / "metrics.jsonl").is_file() for run in in_progress(tmp_path / "slurm")):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.2)
        queue = subprocess.run(["squeue", "-h", "-t", "RUNNING", "-o", "%i"], capture_output=True, text=True)
        jobs = queue.stdout.split()  # every running array task: one of them has started its run
        subprocess.run(["scontrol", "requeue", ",".join(jobs)], check=True, capture_output=True)
        stdout, stderr = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            subprocess.run(["scancel", "--name", "submitit"], capture_output=True)
    assert proc.returncode == 0, stderr
    assert numbers(tmp_path, "slurm") == local_report
    logs = [p.read_text() for p in (tmp_path / "slurm" / "logs").glob("*.log")]
    assert any("--resume" in text for text in logs), f"jobs {jobs} were requeued, but no run continued its folder"
