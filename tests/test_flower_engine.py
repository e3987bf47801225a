"""Flower engine: same results as the local engine in Flower's simulation; failures drop a client.

The simulation tests start Ray (about 10-20 s each on two cores). The protocol tests drive the real
ClientApp in this process through a fake Grid, so retries, timeouts and the node-id <-> partition-id
map are checked without Ray.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Literal

import pytest
import torch
from helpers import assert_runs_identical, quick_config, run
from test_clusters import env, free_port

from fedmerge.algorithms.fedavg import FedAvg, FedAvgConfig
from fedmerge.config.schema import load_config
from fedmerge.core.algorithm import ALGORITHMS
from fedmerge.run.results import RunStore

flwr = pytest.importorskip("flwr", reason="Flower absent: pip install -e '.[flower]'")

SMALL = ["partition.num_clients=4", "rounds=3", "dataset.name=digits", "partition.name=dirichlet"]


class FailingConfig(FedAvgConfig):
    name: Literal["test_fedavg_fails_c1_r2"] = "test_fedavg_fails_c1_r2"


@ALGORITHMS.register(
    "test_fedavg_fails_c1_r2", config=FailingConfig, description="test only: client 1 raises in round 2"
)
class FailingFedAvg(FedAvg):
    name = "test_fedavg_fails_c1_r2"

    def client_update(self, payload, data, state, ctx):
        if ctx.cid == 1 and ctx.round == 2:
            raise RuntimeError("injected failure of client 1 in round 2")
        return super().client_update(payload, data, state, ctx)


# --- Flower's simulation runtime (Ray) ------------------------------------------------------------
@pytest.mark.parametrize(
    "algorithm",
    [
        ["algorithm.name=fedavg"],
        ["algorithm.name=fedprox", "algorithm.mu=0.1", "participation=0.5"],
        ["algorithm.name=ditto", "participation=0.5", "eval_clients=sample:2"],  # the loop picks whom to evaluate
    ],
    ids=["fedavg", "fedprox-partial", "ditto-eval-sample"],
)
def test_simulation_matches_local_engine_bit_for_bit(tmp_path, algorithm):
    pytest.importorskip("ray", reason="Flower simulation needs ray: pip install -e '.[flower]'")
    local = run(quick_config(*SMALL, *algorithm), tmp_path / "local")
    flower = run(quick_config(*SMALL, *algorithm, "engine=flower", "flower.num_cpus=1"), tmp_path / "flower")
    assert_runs_identical(local.run_dir, flower.run_dir)
    assert local.summary["last"] == flower.summary["last"]


def test_a_simulation_starts_its_own_ray_whatever_cluster_the_machine_names(tmp_path, monkeypatch):
    """A Ray cluster the user runs (or RAY_ADDRESS names) is not the simulation's: ray.init would join it and
    refuse the simulation's CPU count ("When connecting to an existing cluster, num_cpus ... must not be
    provided"), so the simulation asks for a private instance."""
    pytest.importorskip("ray", reason="Flower simulation needs ray: pip install -e '.[flower]'")
    monkeypatch.setenv("RAY_ADDRESS", "auto")  # join the machine's running cluster; with none running, fail
    flower = run(quick_config(*SMALL, "rounds=1", "engine=flower", "flower.num_cpus=1"), tmp_path / "flower")
    assert flower.summary["rounds_completed"] == 1


# --- joining a running Ray cluster (flower.ray_address) --------------------------------------------
@contextmanager
def localhost_ray_cluster(logs: Path, worker_cpus: int = 1) -> Iterator[str]:
    """A Ray head that only schedules (no CPUs) and one worker node on localhost, started with ``ray start``,
    each the leader of its own process group; both groups are killed whatever happens (never ``ray stop``,
    which would stop every Ray on the machine). The head's temp folder is private, so that no other
    ``auto`` on the machine finds this cluster."""
    ray = shutil.which("ray") or pytest.fail("the ray command is not installed (pip install 'fedmerge[cluster]')")
    port = free_port()
    address = f"127.0.0.1:{port}"
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths must fit in 107 bytes
    head = [ray, "start", "--head", "--port", str(port), "--num-cpus", "0", "--include-dashboard=false"]
    worker = [ray, "start", "--address", address, "--num-cpus", str(worker_cpus)]
    nodes: list[subprocess.Popen] = []
    try:
        for name, cmd in (("head", [*head, f"--temp-dir={temp}"]), ("worker", worker)):
            with (logs / f"ray_{name}.log").open("w") as log:
                nodes.append(subprocess.Popen(cmd, env=env(), start_new_session=True, stdout=log, stderr=log))
            assert nodes[-1].wait(timeout=120) == 0, (logs / f"ray_{name}.log").read_text()
        yield address
    finally:
        import ray as ray_module

        if ray_module.is_initialized():  # a failed run may leave this process connected
            ray_module.shutdown()
        for node in nodes:
            with suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


CLUSTER_ACTORS = """
import json, sys
import ray
from ray._private import state  # the GCS actor table, dead actors included (ray.util.state needs a dashboard)

ray.init(address=sys.argv[1], include_dashboard=False, log_to_driver=False, logging_level="ERROR")
workers = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")]
actors = [(a["ActorClassName"], a["Address"]["NodeID"]) for a in state.actors().values()]
print(json.dumps({"workers": workers, "actors": actors}))
"""


@pytest.mark.processes
def test_a_simulation_joins_a_running_ray_cluster_with_the_local_numbers(tmp_path, monkeypatch):
    """flower.ray_address: the ClientApps run as actors on the cluster's worker node (the head has no CPU),
    and the run's numbers are the local engine's."""
    pytest.importorskip("ray", reason="Flower simulation needs ray: pip install -e '.[flower]'")
    from fedmerge.engines.flower.simulation import cluster_address

    algo = ["algorithm.name=fedprox", "algorithm.mu=0.1", "participation=0.5"]
    local = run(quick_config(*SMALL, *algo), tmp_path / "local")
    with localhost_ray_cluster(tmp_path) as address:
        monkeypatch.setenv("RAY_ADDRESS", address)  # what `auto` resolves first
        assert cluster_address("auto").endswith(f":{address.split(':')[1]}")
        monkeypatch.delenv("RAY_ADDRESS")
        flower = run(quick_config(*SMALL, *algo, "engine=flower", f"flower.ray_address={address}"), tmp_path / "f")
        read = subprocess.run(
            [sys.executable, "-c", CLUSTER_ACTORS, address], env=env(), capture_output=True, text=True, timeout=120
        )
    assert read.returncode == 0, read.stderr
    seen = json.loads(read.stdout.strip().splitlines()[-1])
    (worker,) = seen["workers"]
    clients = [node for name, node in seen["actors"] if name == "ClientAppActor"]
    assert clients and set(clients) == {worker}, seen  # the run's ClientApps ran on the cluster's worker node
    assert_runs_identical(local.run_dir, flower.run_dir)
    assert local.summary["last"] == flower.summary["last"]


def test_a_ray_address_where_no_cluster_answers_is_refused_in_one_line(tmp_path, monkeypatch):
    """ray.init would wait for ever for an absent head: the address is checked first."""
    pytest.importorskip("ray", reason="Flower simulation needs ray: pip install -e '.[flower]'")
    from typer.testing import CliRunner

    from fedmerge.cli import app

    port = free_port()  # nothing listens there any more
    args = ["run", "engine=flower", "rounds=1", "partition.num_clients=2", "--no-progress"]
    result = CliRunner().invoke(app, [*args, f"flower.ray_address=127.0.0.1:{port}", "--out", str(tmp_path / "a")])
    assert result.exit_code == 1, result.output
    assert f"flower.ray_address=127.0.0.1:{port}: no Ray cluster answers at " in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    # `auto` finds its cluster as ray.init does: RAY_ADDRESS first
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    result = CliRunner().invoke(app, [*args, "flower.ray_address=auto", "--out", str(tmp_path / "b")])
    assert result.exit_code == 1 and "flower.ray_address=auto: no Ray cluster answers at " in result.output
    assert f":{port} (" in result.output  # the address RAY_ADDRESS named


def test_a_run_resumes_with_another_ray_address(tmp_path, task_identity):
    """A cluster's head may move (or be gone): the address is not part of the run's numbers."""
    from fedmerge.run.runner import run_from_files

    algo = ["algorithm.name=local", "rounds=4"]
    full = run(quick_config(*SMALL, *algo), tmp_path / "full")
    cut = run_on_grid(tmp_path / "cut", FakeGrid(4), *algo, "flower.ray_address=10.0.0.9:6379", stop_after=2)
    resumed = run_from_files(
        None, ["flower.ray_address=auto"], resume_dir=str(cut.run_dir), show_progress=False, grid=FakeGrid(4)
    )
    assert_runs_identical(full.run_dir, resumed.run_dir)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["flower.ray_address=ray://head:10001"], "flower.ray_address: auto, or HOST:PORT of a Ray cluster's head"),
        (["flower.ray_address=head"], "flower.ray_address: auto, or HOST:PORT"),
        (["flower.ray_address=auto", "flower.num_cpus=2"], "num_cpus sizes a private Ray"),
    ],
)
def test_bad_ray_addresses_are_refused_by_the_config(overrides, message):
    from fedmerge.config.schema import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        quick_config("engine=flower", *overrides)
    assert quick_config("engine=flower", "flower.ray_address=10.0.0.1:6379").flower.ray_address == "10.0.0.1:6379"


# The configuration of issue 18: a TwoNN trained at batch 10.
SUPERFED = Path(__file__).parent.parent / "configs" / "superfed_digits_pathological.yaml"
SMALL_SUPERFED = ["rounds=2", "eval_every=2", "partition.num_clients=5", "algorithm.start_round=2"]


def twonn_gradients(threads: int) -> list[torch.Tensor]:
    from torch.nn import functional as F

    from fedmerge.models import build_model
    from fedmerge.run.prepare import load_data

    torch.set_num_threads(threads)
    cfg = load_config(SUPERFED, SMALL_SUPERFED)
    client = load_data(cfg).clients[0]
    model = build_model(cfg.model, tuple(client.x_train.shape[1:]), 10, generator=torch.Generator().manual_seed(0))
    batch = slice(0, cfg.algorithm.batch_size)
    F.cross_entropy(model(client.x_train[batch]), client.y_train[batch]).backward()
    return [p.grad for p in model.parameters()]


def test_default_threads_give_the_local_numbers_on_flower_with_two_ray_cpus(tmp_path, monkeypatch):
    pytest.importorskip("ray", reason="Flower simulation needs ray: pip install -e '.[flower]'")
    # The control: for this model, 1 and 2 threads give different gradients (different reduction order)
    # on the AMD EPYC (AVX2) CI machines. Where a BLAS does not split such small products between
    # threads (MKL on an AVX-512 Xeon), every thread count gives the same numbers: nothing to show.
    if all(torch.equal(a, b) for a, b in zip(twonn_gradients(1), twonn_gradients(2))):
        pytest.skip("on this CPU, 1 and 2 threads give this model the same gradients: the test would show nothing")
    # A user's process: torch's default thread count (2 here), Ray free to set its workers' own.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    local = run(load_config(SUPERFED, SMALL_SUPERFED), tmp_path / "local")
    torch.set_num_threads(2)
    flower = run(load_config(SUPERFED, [*SMALL_SUPERFED, "engine=flower", "flower.num_cpus=2"]), tmp_path / "flower")
    assert_runs_identical(local.run_dir, flower.run_dir)


def test_client_that_raises_is_dropped_and_recorded(tmp_path):
    pytest.importorskip("ray", reason="Flower simulation needs ray: pip install -e '.[flower]'")
    cfg = quick_config(*SMALL, "algorithm.name=test_fedavg_fails_c1_r2", "engine=flower", "flower.num_cpus=1")
    result = run(cfg, tmp_path / "r")
    rows = RunStore(result.run_dir).read_metrics()
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert [r.get("failed_clients") for r in rows[::2]] == [None, None]
    (failure,) = rows[1]["failed_clients"]
    assert failure["cid"] == 1 and failure["phase"] == "train" and "injected failure" in failure["reason"]
    assert rows[1]["selected"] == [0, 1, 2, 3]
    assert sorted(rows[2]["eval"]["clients"]) == ["0", "1", "2", "3"]  # client 1 is back in round 3
    assert result.summary["last"]["round"] == 3


# --- the protocol, with the real ClientApp behind a fake Grid (no Ray) ---------------------------
class FakeGrid:
    """Delivers each Message to the ClientApp of its node in this process; nodes have random ids."""

    def __init__(self, num_nodes: int, drop: set[int] = frozenset(), partition_ids: list[int] | None = None):
        from flwr.app import Context, RecordDict

        from fedmerge.engines.flower.client import app

        self.app = app
        ids = random.Random(0).sample(range(1, 2**62), num_nodes)
        pids = partition_ids if partition_ids is not None else list(range(num_nodes))
        self.contexts = {
            n: Context(run_id=1, node_id=n, node_config={"partition-id": p}, state=RecordDict(), run_config={})
            for n, p in zip(ids, pids)
        }
        self.drop = drop  # partition ids that never answer training messages (a timeout)
        self.sent: list = []

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None):
        from flwr.app import Error, Message

        replies = []
        for msg in messages:
            self.sent.append(msg)
            ctx = self.contexts[msg.metadata.dst_node_id]
            if msg.metadata.message_type == "train" and ctx.node_config["partition-id"] in self.drop:
                continue
            try:
                replies.append(self.app(msg, ctx))
            except Exception as exc:
                replies.append(Message(Error(code=1, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg))
        return replies


def run_on_grid(tmp_path, grid, *overrides, **kw):
    cfg = quick_config(*SMALL, "engine=flower", *overrides)
    return run(cfg, tmp_path / "r", grid=grid, **kw)


def test_fake_grid_run_matches_local_and_keeps_state_in_context(tmp_path, task_identity):
    algo = ["algorithm.name=local", "participation=0.5"]  # per-client state: the client's own model
    grid = FakeGrid(4)
    flower = run_on_grid(tmp_path, grid, *algo)
    local = run(quick_config(*SMALL, *algo), tmp_path / "local")
    assert_runs_identical(local.run_dir, flower.run_dir)
    for ctx in grid.contexts.values():  # the state lives in context.state, as safetensors bytes
        assert "fedmerge.client_state" in ctx.state.config_records
    # one message per selected client, addressed by the handshake's node id <-> partition id map
    node_pid = {n: c.node_config["partition-id"] for n, c in grid.contexts.items()}
    trains = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert all(int(m.content.config_records["fedmerge.job"]["cid"]) == node_pid[m.metadata.dst_node_id] for m in trains)


@pytest.mark.parametrize(
    "algo",
    [
        ["algorithm.name=livar", "algorithm.ccvr={samples_per_class: 10}"],
        ["algorithm.name=regmean", "algorithm.gram_samples=50"],
        ["algorithm.name=fisher_avg", "algorithm.fisher_samples=16"],
        ["algorithm.name=fedproto"],
    ],
    ids=lambda a: a[0].split("=")[1],
)
def test_aggregation_rules_send_their_statistics_through_flower_unchanged(tmp_path, task_identity, algo):
    # Client statistics (Grams, Fishers, class moments, importances) ride in the update as tensors.
    flower = run_on_grid(tmp_path, FakeGrid(4), *algo, "participation=0.5")
    local = run(quick_config(*SMALL, *algo, "participation=0.5"), tmp_path / "local")
    assert_runs_identical(local.run_dir, flower.run_dir)


def test_each_client_gets_its_own_payload(tmp_path, task_identity):
    from fedmerge.core.types import Payload
    from fedmerge.engines.flower.records import get_record

    grid = FakeGrid(4)
    run_on_grid(tmp_path, grid, "rounds=1")
    trains = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert len(trains) == 4 and len({m.metadata.dst_node_id for m in trains}) == 4
    payloads = [get_record(m.content, "payload", Payload) for m in trains]
    assert all(p.meta == {"round": 1} for p in payloads)
    assert len({id(m.content.array_records["payload"]) for m in trains}) == 4  # own ArrayRecord each


def test_timeout_drops_client_then_too_few_replies_stop_with_clear_message(tmp_path, task_identity):
    result = run_on_grid(tmp_path, FakeGrid(4, drop={2}), "rounds=2")
    rows = RunStore(result.run_dir).read_metrics()
    assert [f["cid"] for r in rows for f in r["failed_clients"]] == [2, 2]
    assert "no reply within flower.round_timeout" in rows[0]["failed_clients"][0]["reason"]

    from fedmerge.engines.flower.engine import RoundFailed

    with pytest.raises(RoundFailed, match=r"round 1: 3 of 4 clients replied, fewer than flower.min_replies=4 after 2"):
        run_on_grid(tmp_path / "b", FakeGrid(4, drop={2}), "flower.min_replies=4", "flower.max_retries=2")


def test_partition_map_is_checked(tmp_path, task_identity):
    from fedmerge.engines.flower.engine import RoundFailed

    with pytest.raises(RoundFailed, match="claimed by two SuperNodes"):
        run_on_grid(tmp_path, FakeGrid(4, partition_ids=[0, 1, 1, 3]))
    with pytest.raises(RoundFailed, match=r"no SuperNode for partition-id \[3\]"):
        run_on_grid(tmp_path, FakeGrid(3), "flower.connect_timeout=0.5")


def test_resume_restores_client_state_into_fresh_supernodes(tmp_path, task_identity):
    algo = ["algorithm.name=local", "rounds=4"]
    full = run(quick_config(*SMALL, *algo), tmp_path / "full")
    cfg = quick_config(*SMALL, *algo, "engine=flower")
    run(cfg, tmp_path / "cut", grid=FakeGrid(4), stop_after=2)
    from fedmerge.run.runner import run_experiment

    resumed = run_experiment(cfg, tmp_path / "cut", resume=True, show_progress=False, grid=FakeGrid(4))
    assert_runs_identical(full.run_dir, resumed.run_dir)


# --- configuration --------------------------------------------------------------------------------
def test_local_config_yaml_has_no_flower_section(tmp_path):
    result = run(quick_config("rounds=1"), tmp_path / "r")
    assert "flower" not in (result.run_dir / "config.yaml").read_text()
    cfg = quick_config("engine=flower", "flower.min_replies=3")
    assert cfg.flower.min_replies == 3


def test_missing_flower_says_how_to_install(monkeypatch):
    from typer.testing import CliRunner

    import fedmerge.engines.flower as flower_pkg
    from fedmerge.cli import app

    monkeypatch.setattr(flower_pkg, "flower_available", lambda simulation=False: False)
    result = CliRunner().invoke(app, ["run", "engine=flower", "rounds=1", "--no-progress"])
    assert result.exit_code == 2
    assert "pip install 'flwr==1.41.*' ray" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_records_round_trip_any_dtype(task_identity):
    from flwr.app import RecordDict

    from fedmerge.core.types import Payload
    from fedmerge.engines.flower.records import get_record, put_record

    p = Payload({"w": torch.randn(3, 2), "i": torch.arange(4), "h": torch.randn(5).bfloat16()}, {"k": [1, "a"]})
    content = RecordDict()
    put_record(content, "x", p)
    q = get_record(content, "x", Payload)
    assert q.meta == json.loads(json.dumps(p.meta))
    assert all(torch.equal(q.tensors[k], v) and q.tensors[k].dtype == v.dtype for k, v in p.tensors.items())
