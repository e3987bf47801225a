"""What an operator of a deployment meets around the protocol (issue #42), in this process: the ServerApp's
one-line errors and its run folder (clients, name, summary figures, provenance without a secret), node
state kept per run, per-client communication, readable failure reasons, and the ``fedmerge deploy``
wrappers' exit statuses. Real SuperLink/SuperNode processes are in ``test_flower_deploy.py``."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from helpers import quick_config, run
from test_flower_nodes import DITTO, SMALL, NodeGrid, client_rows, export

from fedmerge.run.results import RunStore

pytest.importorskip("flwr", reason="Flower absent: pip install -e '.[flower]'")

TOKEN = "0123456789abcdef-the-serverapp-token"


def server_app(grid, run_config: dict, monkeypatch):
    """The ServerApp's main as a SuperLink runs it: the run config, and this process's command line is
    ``flwr-serverapp ... --token SECRET`` (what a provenance record must never copy)."""
    from flwr.app import Context, RecordDict

    from fedmerge.apps.flower import main

    monkeypatch.setattr(sys, "argv", ["flwr-serverapp", "--insecure", "--token", TOKEN, "--parent-pid", "1"])
    rc = {"config": "", "overrides": "", "output-dir": "", "resume": "", "pooled-test": "", **run_config}
    main(grid, Context(run_id=77, node_id=0, node_config={}, state=RecordDict(), run_config=rc))


@pytest.fixture
def exported(tmp_path):
    cfg = quick_config(*SMALL, *DITTO, "rounds=2")
    return cfg, export(cfg, tmp_path / "clients")


def test_deployed_run_folder_describes_its_federation_and_holds_no_secret(
    tmp_path, exported, task_identity, monkeypatch, capsys
):
    """digits_fedavg.yaml says FedAvg with 10 clients; the three nodes' files and the overrides make it
    Ditto with 3. The run folder says so (config.yaml, name, summary), its summary's size figures equal
    the local engine's, its provenance records the operator's request and no file holds the token; each
    round prints a line of progress; ``fedmerge run --resume`` of it is refused with the deployed command."""
    from typer.testing import CliRunner

    from fedmerge.cli import app

    cfg, files = exported
    local = run(cfg, tmp_path / "local")
    out = tmp_path / "runs"
    overrides = "algorithm.name=ditto algorithm.lam=0.1 algorithm.local_epochs=1 rounds=2"
    server_app(
        NodeGrid(files, tmp_path / "state"),
        {"config": str(Path("configs/digits_fedavg.yaml").resolve()), "overrides": overrides, "output-dir": str(out)},
        monkeypatch,
    )
    (run_dir,) = out.iterdir()
    assert run_dir.name.startswith("ditto-digits-")  # not the file's fedavg-digits
    written = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert written["partition"]["num_clients"] == 3 and written["algorithm"]["name"] == "ditto"
    assert written["name"] == "ditto-digits"
    assert client_rows(local.run_dir) == client_rows(run_dir)  # the federation the config describes ran

    summary, reference = (json.loads((d / "summary.json").read_text()) for d in (run_dir, local.run_dir))
    assert summary["num_clients"] == 3 and summary["algorithm"] == "ditto" and summary["dataset"] == "digits"
    assert summary["parameters"] == reference["parameters"]  # client state sizes too, from the nodes' shapes
    assert summary["parameter_budget"] == reference["parameter_budget"]
    assert summary["parameters"]["client_state_mean"] == summary["parameters"]["model"] > 0  # Ditto: one model

    for path in run_dir.rglob("*"):  # every file the run wrote
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path
    (line,) = (json.loads(x) for x in (run_dir / "provenance.jsonl").read_text().splitlines())
    assert line["flower_run_id"] == 77 and f'overrides="{overrides}"' in line["command"]

    stdout = capsys.readouterr().out.splitlines()
    progress = [x for x in stdout if x.startswith("fedmerge: round ")]
    assert [x.split(":")[1].strip() for x in progress] == ["round 1/2", "round 2/2"] and "loss " in progress[0]
    assert stdout[-1] == f"fedmerge: results in {run_dir}"

    result = CliRunner().invoke(app, ["run", "--resume", str(run_dir), "--no-progress"])
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "is a deployed run" in message and f"fedmerge deploy run SUPERLINK --resume {run_dir}" in message


def test_server_app_error_is_one_exception_line_that_flower_logs_without_traceback(
    tmp_path, exported, task_identity, monkeypatch, capsys
):
    """A node with a damaged file: the ServerApp prints one line and raises it as an ordinary exception
    (Flower then flushes the log to ``flwr run --stream``/``flwr log`` and marks the run failed with it,
    which ``SystemExit`` skipped); Flower's own report of the exception carries no traceback."""
    from flwr.supercore import log as flower_log

    from fedmerge.apps.flower import DeploymentFailed

    _, files = exported
    raw = bytearray(files[1].read_bytes())
    raw[-3] ^= 0xFF
    files[1].write_bytes(bytes(raw))
    out = tmp_path / "runs"
    with pytest.raises(DeploymentFailed) as stop:
        server_app(
            NodeGrid(files, tmp_path / "state"), {"overrides": " ".join(SMALL), "output-dir": str(out)}, monkeypatch
        )
    assert isinstance(stop.value, Exception)  # Flower's ServerApp runtime catches Exception, not SystemExit
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == [f"fedmerge: error: {stop.value}"] and "checksum mismatch" in lines[0]
    assert not out.exists()

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("flwr").addHandler(handler)
    try:  # what Flower's run_serverapp does with the exception
        flower_log(logging.ERROR, "%s raised an exception", "ServerApp", exc_info=stop.value)
        flower_log(logging.ERROR, "%s raised an exception", "ServerApp", exc_info=KeyError("other"))
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    assert records[0].exc_info is None and records[1].exc_info is not None  # other exceptions keep theirs


def test_a_node_never_reads_another_runs_state_and_says_when_it_has_none(tmp_path, exported, task_identity):
    """Run X stops after round 1; run Y (the same method, another setting) runs on the same state folders;
    X resumed there equals X uninterrupted: each run has its own store, so X never continues from Y's
    states (one store for all would hand X the states of Y's round 1 without an error). A resumed run
    whose nodes have no store for it drops them with one line naming the run; a state folder of an
    earlier fedmerge (one store for all runs) is refused."""
    from fedmerge.core.loop import RoundFailed
    from fedmerge.run.runner import run_experiment

    _, files = exported
    x = quick_config(*SMALL, *DITTO, "rounds=3", "engine=flower", "flower.max_retries=0")
    y = quick_config(*SMALL, *DITTO, "algorithm.lam=0.5", "rounds=2", "engine=flower")
    full = run(x, tmp_path / "full", grid=NodeGrid(files, tmp_path / "alone"), deployment=True)
    run(x, tmp_path / "x", grid=NodeGrid(files, tmp_path / "shared"), deployment=True, stop_after=1)
    run(y, tmp_path / "y", grid=NodeGrid(files, tmp_path / "shared"), deployment=True)
    resumed = run_experiment(x, tmp_path / "x", resume=True, show_progress=False,
                             grid=NodeGrid(files, tmp_path / "shared"), deployment=True)  # fmt: skip
    assert client_rows(resumed.run_dir) == client_rows(full.run_dir)
    assert len(list((tmp_path / "shared" / "node0").glob("run-*"))) == 2

    # X again from its round-1 checkpoint, with nodes whose state-dirs never held it
    run(x, tmp_path / "x2", grid=NodeGrid(files, tmp_path / "x2-state"), deployment=True, stop_after=1)
    with pytest.raises(RoundFailed) as err:
        run_experiment(x, tmp_path / "x2", resume=True, show_progress=False,
                       grid=NodeGrid(files, tmp_path / "elsewhere"), deployment=True)  # fmt: skip
    message = str(err.value)
    assert "\n" not in message and "client 0: NodeStateError: client 0 has no state for run " in message
    assert "the server has its results up to round 1" in message

    legacy = tmp_path / "legacy"
    for i in range(3):
        (legacy / f"node{i}").mkdir(parents=True)
        (legacy / f"node{i}" / "data.mdb").write_bytes(b"")
    grid = NodeGrid(files, legacy)
    with pytest.raises(RoundFailed, match=r"client 0: NodeStateError: state-dir .*node0 holds client states of an "):
        run(x, tmp_path / "old", grid=grid, deployment=True)


def test_each_round_logs_each_clients_communication_on_both_engines(tmp_path, exported, task_identity):
    """``comm_clients``: per client of the round, the values sent and (for those that replied) received;
    their means are ``comm_down``/``comm_up``. A reply lost in round 2 has no ``up``; the deployed figures
    equal what the server received from each client."""
    cfg, files = exported
    grid = NodeGrid(files, tmp_path / "state", lose={(2, 1)})
    deployed = run(
        quick_config(*SMALL, *DITTO, "rounds=2", "engine=flower"), tmp_path / "d", grid=grid, deployment=True
    )
    local = run(cfg, tmp_path / "local")
    received: dict[int, dict[int, int]] = {}
    for msg, reply in grid.received:
        if msg.metadata.message_type == "train" and not reply.has_error():
            job = msg.content.config_records["fedmerge.job"]
            values = sum(a.numpy().size for a in reply.content.array_records["update"].values())
            received.setdefault(int(job["round"]), {})[int(job["cid"])] = values
    for rows in (RunStore(local.run_dir).read_metrics(), RunStore(deployed.run_dir).read_metrics()):
        for row in rows:
            per = row["comm_clients"]
            assert sorted(per, key=int) == [str(c) for c in row["selected"]]
            ups = [c["up"] for c in per.values() if "up" in c]
            assert row["comm_down"] == sum(c["down"] for c in per.values()) / len(per)
            assert row["comm_up"] == sum(ups) / len(ups)
    rows = RunStore(deployed.run_dir).read_metrics()
    assert "up" not in rows[1]["comm_clients"]["1"] and rows[1]["comm_clients"]["1"]["down"] > 0
    assert {r["round"]: {int(c): v["up"] for c, v in r["comm_clients"].items() if "up" in v} for r in rows} == received


def test_failure_reasons_read_as_one_line():
    from fedmerge.engines.flower.federation import _one_line

    assert _one_line("<class 'KeyError'>:<''body.1.weight''>") == "KeyError: 'body.1.weight'"
    flower = "<class 'fedmerge.engines.flower.node.NodeStateError'>:<'client 2 has no state for run ab-cd'>"
    assert _one_line(flower) == "NodeStateError: client 2 has no state for run ab-cd"
    assert _one_line("<class 'RuntimeError'>:<'first\nsecond'>") == "RuntimeError: first"


def test_provenance_never_copies_a_credential_from_a_command_line():
    from fedmerge.run.provenance import redact

    argv = ["flwr-serverapp", "--token", "s3cret", "--api-password=pw", "--insecure", "--client-secret", "x"]
    assert redact(argv) == [
        "flwr-serverapp", "--token", "<redacted>", "--api-password=<redacted>", "--insecure", "--client-secret",
        "<redacted>",
    ]  # fmt: skip


def test_a_files_own_algorithm_dataset_name_follows_the_overrides(tmp_path):
    from fedmerge.config.schema import load_config

    assert load_config("configs/digits_fedavg.yaml", ["algorithm.name=ditto"]).name == "ditto-digits"
    assert load_config("configs/digits_fedavg.yaml", ["algorithm.name=ditto", "name=mine"]).name == "mine"
    assert load_config("configs/digits_fedavg.yaml").name == "fedavg-digits"
    (tmp_path / "c.yaml").write_text("name: my-study\nalgorithm: {name: fedavg}\n")
    assert load_config(tmp_path / "c.yaml", ["algorithm.name=ditto"]).name == "my-study"


# --- the fedmerge deploy wrappers ---------------------------------------------------------------------
def fake_program(folder: Path, name: str, body: str) -> str:
    path = folder / name
    path.write_text(f"#!{sys.executable}\nimport sys, json, time, signal\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_deploy_node_exits_non_zero_when_the_supernode_stops_unasked(tmp_path, capsys):
    """Flower 1.41's SuperNode exits 0 when its SuperLink answers 401 (a restart without --database);
    the wrapper makes that a failure a service manager restarts, passes other statuses through, and
    exits 0 when it was asked to stop."""
    from fedmerge.apps.deploy import supervise

    said: list[str] = []
    refused = fake_program(tmp_path, "refused", "print('httpx.HTTPStatusError: 401 Unauthorized'); sys.exit(0)")
    assert supervise([refused], said.append) == 1
    assert "401 Unauthorized" in capsys.readouterr().out
    assert said == [
        f"error: {refused} exited with status 0 but the SuperLink refused this node; exiting with 1 so that a "
        "service manager (Restart=on-failure) starts it again; its last line: httpx.HTTPStatusError: 401 Unauthorized"
    ]
    bad = fake_program(tmp_path, "bad", "sys.exit(202)")
    assert supervise([bad], said.append) == 202
    assert said[-1] == f"error: {bad} exited with status 202; it printed nothing"
    killed = fake_program(tmp_path, "killed", "print('bye', flush=True); import os; os.kill(os.getpid(), 9)")
    assert supervise([killed], said.append) == 137
    assert said[-1] == f"error: {killed} was killed by signal 9; its last line: bye"
    said.clear()

    waits = fake_program(
        tmp_path,
        "waits",
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); print('up', flush=True); time.sleep(60)",
    )
    main = threading.main_thread().ident  # a service manager's SIGTERM reaches the wrapper's only thread
    timer = threading.Timer(1.5, lambda: signal.pthread_kill(main, signal.SIGTERM))
    timer.start()
    started = time.monotonic()
    try:
        assert supervise([waits], said.append) == 0  # asked to stop: not a failure
    finally:
        timer.cancel()
    assert time.monotonic() - started < 20  # the child was stopped, not waited for
    assert said == []  # asked: no error line


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


FLOWER_2004 = (
    "ERROR :   Exit Code: 305\n[code: 2004] Failed to activate SuperNode.\n"
    "The SuperNode could not establish a connection to the SuperLink."
)


def test_deploy_node_exits_within_seconds_when_a_grandchild_keeps_its_output_open(tmp_path, capsys):
    """Flower 1.41's SuperNode, refused by its SuperLink, exits and leaves its ``flower-superexec``
    running with the same stdout: the wrapper waits for the child's exit, not for the end of the pipe,
    ends the whole process group and exits 1 within seconds, repeating the child's last line."""
    from fedmerge.apps.deploy import supervise

    pid_file = tmp_path / "grandchild.pid"
    supernode = fake_program(
        tmp_path,
        "supernode",
        f"""
import subprocess
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # inherits stdout
open({str(pid_file)!r}, "w").write(str(grandchild.pid))
print({FLOWER_2004!r}, flush=True)
sys.exit(1)
""",
    )
    said: list[str] = []
    started = time.monotonic()
    assert supervise([supernode], said.append) == 1
    assert time.monotonic() - started < 10
    assert said == [
        f"error: {supernode} exited with status 1; its last line: "
        "The SuperNode could not establish a connection to the SuperLink."
    ]
    assert "[code: 2004] Failed to activate SuperNode." in capsys.readouterr().out
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)


def test_deploy_node_without_a_superlink_is_refused_in_one_line():
    """flower-supernode without --superlink retries a default address forever and never names it."""
    from typer.testing import CliRunner

    from fedmerge.cli import app

    result = CliRunner().invoke(app, ["deploy", "node", "--insecure", "--node-config", 'data-path="x"'])
    assert result.exit_code == 2
    assert result.output.strip() == (
        "error: fedmerge deploy node needs --superlink HOST:PORT, the SuperLink's Fleet API address"
    )


def test_deploy_run_exits_with_the_runs_outcome(tmp_path, monkeypatch, capsys):
    """``fedmerge deploy run`` against a stand-in ``flwr``: the run config it submits, the log it streams,
    and exit status 1 with the ServerApp's line when ``flwr ls`` says the run failed (0 when it completed)."""
    from typer.testing import CliRunner

    import fedmerge.apps.deploy as deploy
    from fedmerge.cli import app

    calls = tmp_path / "calls.jsonl"
    status = tmp_path / "status"
    flwr = fake_program(
        tmp_path,
        "flwr",
        f"""
open({str(calls)!r}, "a").write(json.dumps(sys.argv[1:]) + "\\n")
if sys.argv[1] == "run":
    print("Successfully started run 42"); print(json.dumps({{"success": True, "run-id": "42"}}, indent=2))
elif sys.argv[1] == "log":
    print("fedmerge: error: SuperNode 9 cannot serve: /srv/x.safetensors: client file not found")
else:
    state, details = open({str(status)!r}).read().split("|")
    print(json.dumps({{"success": True, "runs": [{{"run-id": "42", "status": state, "status-details": details}}]}}))
""",
    )
    monkeypatch.setattr(deploy, "flower_command", lambda name: flwr)
    status.write_text(
        "finished:failed|ServerApp failed with exception: SuperNode 9 cannot serve: client file not found"
    )
    result = CliRunner().invoke(app, ["deploy", "run", "secure", "rounds=3", "--output-dir", "/srv/runs"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == (
        "error: Flower run 42 finished:failed: SuperNode 9 cannot serve: client file not found"
    )
    submitted = [json.loads(x) for x in calls.read_text().splitlines()]
    assert [c[0] for c in submitted] == ["run", "log", "ls"] and submitted[1] == ["log", "42", "secure", "--stream"]
    config = submitted[0][submitted[0].index("--run-config") + 1]
    assert 'overrides="rounds=3"' in config and 'output-dir="/srv/runs"' in config and "command=" in config

    status.write_text("finished:completed|")
    assert CliRunner().invoke(app, ["deploy", "run", "secure", "--resume", "/srv/runs/x"]).exit_code == 0
    assert 'resume="/srv/runs/x"' in json.loads(calls.read_text().splitlines()[-3])[4]


def test_a_deployed_run_with_another_seed_than_the_exports_is_refused_and_config_yaml_names_the_export(
    tmp_path, task_identity, monkeypatch, capsys
):
    """Files from ``fedmerge export-clients`` record the data config and seed they come from. A run whose
    seed is another is refused before round 1 (its config.yaml would not reproduce it); one with the
    export's seed records the export's data sections in config.yaml, whatever the server's config said."""
    from typer.testing import CliRunner

    from fedmerge.apps.flower import DeploymentFailed
    from fedmerge.cli import app

    data_args = ["dataset.name=digits", "partition.num_clients=3", "partition.alpha=5.0", "seed=3"]
    result = CliRunner().invoke(app, ["export-clients", *data_args, "--no-progress", str(tmp_path / "clients")])
    assert result.exit_code == 0, result.output
    files = sorted((tmp_path / "clients").glob("client-*.safetensors"))
    out = tmp_path / "runs"
    training = "rounds=1 algorithm.local_epochs=1"
    with pytest.raises(DeploymentFailed) as stop:
        server_app(NodeGrid(files, tmp_path / "state"), {"overrides": training, "output-dir": str(out)}, monkeypatch)
    assert str(stop.value) == (
        "the run's seed 0 is not the seed 3 the SuperNodes' client files were exported with; run with seed=3, "
        "or export the clients again with seed=0"
    )
    assert capsys.readouterr().out.strip().splitlines() == [f"fedmerge: error: {stop.value}"]
    assert not out.exists()

    server_app(
        NodeGrid(files, tmp_path / "state"), {"overrides": f"{training} seed=3", "output-dir": str(out)}, monkeypatch
    )
    (run_dir,) = out.iterdir()
    written = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert written["seed"] == 3 and written["partition"]["alpha"] == 5.0  # the server's default says 0.5
    assert written["partition"]["num_clients"] == 3 and written["dataset"]["name"] == "digits"


def test_deploy_run_refuses_on_the_operators_machine_what_secure_aggregation_cannot_run(tmp_path, monkeypatch):
    """FedMerge needs each client's update: with secure aggregation it is refused in one line (exit 2) before
    anything is submitted, from a config file on this machine or from overrides alone."""
    from typer.testing import CliRunner

    from fedmerge.apps import deploy
    from fedmerge.cli import app

    monkeypatch.setattr(deploy, "launch", lambda *a, **k: pytest.fail("a ServerApp was submitted"))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("algorithm:\n  name: fedmerge\nengine: flower\n")
    secure = "privacy.secure_aggregation.max_weight=1000"
    for args in (["deploy", "run", "secure", str(cfg), secure], ["deploy", "run", "secure", "algorithm.name=fedmerge",
                                                                   "engine=flower", secure]):  # fmt: skip
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output
        assert "privacy.secure_aggregation: fedmerge" in result.output and result.output.count("\n") <= 2
