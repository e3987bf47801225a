"""Deployment protocol with node-owned data and state, driven in this process through a fake Grid.

Each fake node is the real ClientApp with a node config naming only its own exported client file and
its own state folder, exactly as a SuperNode gets them. The server (``run_experiment(...,
deployment=True)``) is given no dataset: loading one would raise. Real processes, TLS and ``kill -9``
are in ``test_flower_deploy.py``.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import quick_config, run, strip_timing

from fedmerge.run.results import RunStore

flwr = pytest.importorskip("flwr", reason="Flower absent: pip install -e '.[flower]'")

SMALL = ["partition.num_clients=3", "rounds=3", "dataset.name=digits", "algorithm.local_epochs=1"]
DITTO = ["algorithm.name=ditto", "algorithm.lam=0.1"]


def export(cfg, folder: Path, edit=None) -> list[Path]:
    """The client files, and the pooled test file (``folder/pooled-test.safetensors``) for the server."""
    from fedmerge.data.client_files import POOLED_FILE, export_clients, write_pooled_test
    from fedmerge.run.prepare import load_data

    data = load_data(cfg)
    if edit is not None:
        data = edit(data)
    files = export_clients(data, folder)
    write_pooled_test(data, folder / POOLED_FILE)
    return files


class NodeGrid:
    """Delivers each Message to the ClientApp of its node in this process. Each node has a random
    Flower node id and a node config with its own ``data-path`` and ``state-dir``; every reply the
    server receives is kept in ``received``."""

    def __init__(
        self,
        files: list[Path],
        state_root: Path,
        lose: set[tuple[int, int]] = frozenset(),
        state_dirs: list[Path] | None = None,  # instead of state_root/nodeK
    ):
        from flwr.app import Context, RecordDict

        from fedmerge.engines.flower.client import app

        self.app = app
        ids = random.Random(len(files)).sample(range(1, 2**62), len(files))
        self.contexts = {
            n: Context(
                run_id=1,
                node_id=n,
                node_config={"state-dir": str(state_dirs[i] if state_dirs else state_root / f"node{i}")}
                | ({"data-path": str(f)} if f else {}),
                state=RecordDict(),
                run_config={},
            )
            for i, (n, f) in enumerate(zip(ids, files))
        }
        self.lose = lose  # (round, client): the node trains and saves, but its reply is lost
        self.received: list = []

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None):
        from flwr.app import Error, Message

        replies = []
        for msg in messages:
            try:
                reply = self.app(msg, self.contexts[msg.metadata.dst_node_id])
            except Exception as exc:
                reply = Message(Error(code=1, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)
            job = msg.content.config_records.get("fedmerge.job")
            if msg.metadata.message_type == "train" and (int(job["round"]), int(job["cid"])) in self.lose:
                continue
            self.received.append((msg, reply))
            replies.append(reply)
        return replies


def run_store(state_dir: Path) -> Path:
    """The one run's state store in a node's state-dir (``run-KEY``: stores are kept per run)."""
    (folder,) = state_dir.glob("run-*")
    return folder


def forbid_server_data(monkeypatch) -> None:
    """From now on, loading a dataset in this process (the server) fails the test."""
    import fedmerge.run.data_plan as data_plan

    def refuse(*_a, **_k):
        raise AssertionError("the deployed server loaded a dataset")

    monkeypatch.setattr(data_plan, "load_data", refuse)


def deploy(tmp_path, cfg, grid, **kw):
    return run(cfg, tmp_path / "deployed", grid=grid, deployment=True, **kw)


def client_rows(run_dir: Path, keep_global: bool = False) -> list[dict]:
    """Metrics rows without timing and, unless ``keep_global``, without the global model's pooled test
    (a deployed server has one only when its operator gives it the file)."""
    rows = strip_timing(RunStore(run_dir).read_metrics())
    for r in rows:
        if "eval" in r and not keep_global:
            r["eval"].pop("global", None)
    return rows


@pytest.fixture
def exported(tmp_path):
    cfg = quick_config(*SMALL, *DITTO)
    files = export(cfg, tmp_path / "clients")
    return cfg, files


def test_deployed_ditto_equals_local_engine_and_server_sees_no_state_or_sample(
    tmp_path, exported, task_identity, monkeypatch
):
    from fedmerge.core import state_store

    cfg, files = exported
    local = run(cfg, tmp_path / "local")
    forbid_server_data(monkeypatch)

    saved: list[torch.Tensor] = []  # every client-state tensor any node wrote to its store
    put = state_store.StateStore.put

    def recording_put(self, cid, state, rnd):
        saved.extend(t.clone() for t in state.tensors.values())
        return put(self, cid, state, rnd)

    monkeypatch.setattr(state_store.StateStore, "put", recording_put)
    grid = NodeGrid(files, tmp_path / "state")
    pooled = files[0].parent / "pooled-test.safetensors"  # the server operator's optional test set
    deployed = deploy(tmp_path, quick_config(*SMALL, *DITTO, "engine=flower"), grid, pooled_test=str(pooled))

    # per-client metrics, the global model's pooled test and every training figure: bit-identical
    assert client_rows(local.run_dir, keep_global=True) == client_rows(deployed.run_dir, keep_global=True)
    assert RunStore(deployed.run_dir).read_metrics()[-1]["eval"]["global"]["test_acc"] > 0.5

    # the server's checkpoint holds only server state
    from fedmerge.core.checkpoint import load_checkpoint

    ckpt = load_checkpoint(deployed.run_dir / "checkpoints")
    assert ckpt.client_states == {}
    assert ckpt.meta["node_state_rounds"] == {"0": 3, "1": 3, "2": 3}

    # everything the server received: handshake metadata, updates, metrics; no state, no sample
    assert saved, "the nodes saved their states"
    received_values: dict[int, list[int]] = {}
    for msg, reply in grid.received:
        content = reply.content
        assert set(content.array_records) <= {"update"}, content.array_records.keys()
        assert set(content.config_records) <= {"update.meta", "fedmerge.job"}
        if msg.metadata.message_type != "train":
            continue
        # an update holds the model's tensors (Ditto: the global model), shaped as the payload sent
        sent, got = msg.content.array_records["payload"], content.array_records["update"]
        assert {k: a.shape for k, a in got.items()} == {k: a.shape for k, a in sent.items()}
        for array in got.values():
            t = torch.from_numpy(array.numpy())
            assert not any(t.shape == s.shape and torch.equal(t, s) for s in saved), "a client-state tensor"
        rnd = int(msg.content.config_records["fedmerge.job"]["round"])
        received_values.setdefault(rnd, []).append(sum(a.numpy().size for a in got.values()))
    rows = RunStore(deployed.run_dir).read_metrics()
    assert [r["comm_up"] for r in rows] == [sum(v) / len(v) for _, v in sorted(received_values.items())]
    # and what went down: each client's payload, the job (no data section), never a state
    for msg, _ in grid.received:
        assert set(msg.content.array_records) <= {"payload"}
        job = msg.content.config_records.get("fedmerge.job")
        if "experiment" in job:
            assert "data" not in job["experiment"] and "digits" not in job["experiment"]


def test_server_resume_continues_with_the_nodes_own_states(tmp_path, exported, task_identity, monkeypatch):
    from fedmerge.run.runner import run_experiment

    forbid_server_data(monkeypatch)
    _, files = exported
    cfg = quick_config(*SMALL, *DITTO, "engine=flower", "rounds=4")
    full = run(cfg, tmp_path / "full", grid=NodeGrid(files, tmp_path / "state-full"), deployment=True)
    # the server stops after round 2 (a crash); the nodes keep their stores, then serve the resumed run
    run(cfg, tmp_path / "cut", grid=NodeGrid(files, tmp_path / "state"), deployment=True, stop_after=2)
    resumed = run_experiment(
        cfg, tmp_path / "cut", resume=True, show_progress=False, grid=NodeGrid(files, tmp_path / "state"),
        deployment=True,
    )  # fmt: skip
    assert client_rows(full.run_dir) == client_rows(resumed.run_dir)


def test_state_from_a_round_the_server_never_aggregated_is_discarded(tmp_path, exported, task_identity):
    """Client 1 trains and saves in round 2 but its reply is lost: the server drops it from round 2, and
    the node continues from its round-1 state, exactly as a node that never ran round 2 does."""
    from fedmerge.core.state_store import StateStore

    _, files = exported
    cfg = quick_config(*SMALL, *DITTO, "engine=flower")
    lost = run(cfg, tmp_path / "lost", grid=NodeGrid(files, tmp_path / "s1", lose={(2, 1)}), deployment=True)

    class Dead(NodeGrid):  # client 1's node does not answer round 2's training message at all
        def send_and_receive(self, messages, *, timeout=None):
            keep = [m for m in messages if not _is(m, "train", 2, 1)]
            return super().send_and_receive(keep, timeout=timeout)

    dead = run(cfg, tmp_path / "dead", grid=Dead(files, tmp_path / "s2"), deployment=True)
    rows = client_rows(lost.run_dir)
    assert [f["cid"] for f in rows[1]["failed_clients"]] == [1]
    assert rows == client_rows(dead.run_dir)
    with StateStore(run_store(tmp_path / "s1" / "node1")) as a, StateStore(run_store(tmp_path / "s2" / "node1")) as b:
        assert a.round_of(1) == b.round_of(1) == 3
        sa, sb = a.get(1), b.get(1)
        assert all(torch.equal(v, sb.tensors[k]) for k, v in sa.tensors.items())


def _is(msg, kind: str, rnd: int, cid: int) -> bool:
    job = msg.content.config_records.get("fedmerge.job")
    return msg.metadata.message_type == kind and int(job["round"]) == rnd and int(job["cid"]) == cid


def _relabel(data, **changes):
    return replace(data, **changes)


@pytest.mark.parametrize(
    "case",
    ["missing", "corrupt", "no_data_path", "classes", "class_names", "duplicate", "absent", "pooled_test"],
)
def test_bad_node_input_stops_the_run_in_one_line_and_writes_nothing(tmp_path, exported, task_identity, case):
    from fedmerge.engines.flower.engine import RoundFailed

    cfg, files = exported
    files, pooled = list(files), None
    if case == "missing":
        files[1] = tmp_path / "nowhere" / "client-0001.safetensors"
        expect = r"SuperNode \d+ cannot serve: .*client-0001.safetensors: client file not found"
    elif case == "corrupt":
        raw = bytearray(files[2].read_bytes())
        raw[-5] ^= 0xFF
        files[2].write_bytes(bytes(raw))
        expect = "SuperNode .* cannot serve: .*checksum mismatch"
    elif case in ("classes", "class_names"):
        change = {"num_classes": 11} if case == "classes" else {"class_names": [f"c{i}" for i in range(10)]}
        odd = export(cfg, tmp_path / "odd", edit=lambda d: _relabel(d, **change))
        files[2] = odd[2]
        expect = "clients disagree on the " + ("number of classes" if case == "classes" else "class names")
    elif case == "no_data_path":
        files[1] = None
        expect = "SuperNode .* cannot serve: this SuperNode has no data-path"
    elif case == "absent":  # client 2's node never connects
        files = files[:2]
        expect = r"no SuperNode for partition-id \[2\] after 0s \(2 of 3 connected\)"
    elif case == "duplicate":
        files[2] = files[0]
        expect = "partition-id 0 is claimed by two SuperNodes"
    else:  # the server's pooled test file comes from another export
        export(cfg, tmp_path / "odd", edit=lambda d: _relabel(d, num_classes=11))
        pooled = str(tmp_path / "odd" / "pooled-test.safetensors")
        expect = "clients disagree on the number of classes"
    out = tmp_path / "runs"
    from fedmerge.data.errors import ClientFileError

    cfg = quick_config(*SMALL, *DITTO, "engine=flower", f"output_dir={out}", "flower.connect_timeout=0.3")
    grid = NodeGrid(files, tmp_path / "state")
    with pytest.raises((RoundFailed, ClientFileError), match=expect) as err:
        run(cfg, None, grid=grid, deployment=True, pooled_test=pooled)
    assert "\n" not in str(err.value)
    assert not out.exists() and not (tmp_path / "state").exists()  # nothing written, server or nodes


def test_export_clients_writes_the_pooled_test_file_the_server_may_hold(tmp_path):
    from typer.testing import CliRunner

    from fedmerge.cli import app
    from fedmerge.data.client_files import load_pooled_test
    from fedmerge.run.prepare import load_data

    args = ["partition.num_clients=3", "dataset.name=digits"]
    result = CliRunner().invoke(app, ["export-clients", *args, str(tmp_path / "out"), "--pooled-test", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "and pooled-test.safetensors" in result.output
    x, y, meta = load_pooled_test(tmp_path / "out" / "pooled-test.safetensors")
    want_x, want_y = load_data(quick_config(*args)).pooled_test()
    assert torch.equal(x, want_x) and torch.equal(y, want_y) and meta.num_clients == 3


def test_nodes_with_raw_data_split_it_themselves_as_the_simulation_does(tmp_path, task_identity, monkeypatch):
    """Each site holds only its own rows of a naturally partitioned .npz (no client file) and splits
    them itself with the run's split rules and seed: the run equals the local engine's on the whole file.
    Site 2 lacks class 9 and is told the federation's classes."""
    import numpy as np

    from fedmerge.data import load_pool

    pool = load_pool({"name": "digits"})
    owner = np.arange(len(pool.y)) % 3
    keep = ~((owner == 2) & (pool.y == 9))  # site 2 has no sample of class 9
    x, y, owner = pool.x[keep], pool.y[keep], owner[keep]
    np.savez(tmp_path / "all.npz", x=x, y=y, client_id=owner)
    sites = []
    for k in range(3):
        sites.append(tmp_path / f"site{k}.npz")
        np.savez(sites[-1], x=x[owner == k], y=y[owner == k])
    data = ["dataset.name=npz", f"dataset.path={tmp_path / 'all.npz'}", "partition.name=natural"]
    cfg = quick_config(*SMALL, *DITTO, *data, "split.val_fraction=0.15")
    local = run(cfg, tmp_path / "local")
    forbid_server_data(monkeypatch)

    grid = NodeGrid(sites, tmp_path / "state")
    classes = ",".join(str(c) for c in range(10))
    for i, ctx in enumerate(grid.contexts.values()):
        ctx.node_config.update({"partition-id": i, "num-partitions": 3, "classes": classes})
    deployed = deploy(tmp_path, quick_config(*SMALL, *DITTO, *data, "split.val_fraction=0.15", "engine=flower"), grid)
    assert client_rows(local.run_dir) == client_rows(deployed.run_dir)


def test_a_raw_data_node_needs_its_partition_in_one_line(tmp_path, task_identity):
    import numpy as np

    from fedmerge.engines.flower.engine import RoundFailed

    np.savez(tmp_path / "site.npz", x=np.zeros((20, 4), np.float32), y=np.arange(20) % 2)
    with pytest.raises(RoundFailed, match=r"cannot serve: .*site.npz is raw data: give the node partition-id=N"):
        run(quick_config(*SMALL, "engine=flower"), tmp_path / "r", grid=NodeGrid([tmp_path / "site.npz"],
            tmp_path / "state"), deployment=True)  # fmt: skip
