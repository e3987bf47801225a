"""Secure aggregation through Flower's SecAgg+ (its client mod and server workflow), driven by our round loop.

In process: three deployed nodes behind a fake Grid (the real ClientApp with Flower's mod, each node with its
own client file and Context), the server given no data. Real SuperLink and SuperNode processes: the last test.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import quick_config
from test_flower_deploy import deployment  # noqa: F401  (a fixture)
from test_flower_nodes import NodeGrid, deploy, export

from fedmerge.run.results import RunStore

flwr = pytest.importorskip("flwr", reason="Flower absent: pip install -e '.[flower]'")

SMALL = ["partition.num_clients=3", "dataset.name=digits", "algorithm.local_epochs=1", "algorithm.name=scaffold"]
SECURE = ["privacy.secure_aggregation.max_weight=1000"]


class SecureGrid(NodeGrid):
    """Every reply the server receives is kept with the message it answers (SecAgg+'s stages too). Each node
    gets its own copy of a message, as over a network (SecAgg+'s setup sends one content to all nodes, and
    Flower's mod pops the stage from it)."""

    def send_and_receive(self, messages, *, timeout=None):
        from flwr.app import Error, Message

        replies = []
        for msg in messages:
            try:
                reply = self.app(copy.deepcopy(msg), self.contexts[msg.metadata.dst_node_id])
            except Exception as exc:
                reply = Message(Error(code=1, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)
            self.received.append((msg, reply))
            replies.append(reply)
        return replies


def test_secure_round_gives_the_weighted_mean_within_the_bound_and_the_server_no_update(
    tmp_path, task_identity, monkeypatch
):
    """SCAFFOLD (a weighted mean of the models, a sum of the control-variate changes), 2 rounds: the server's
    aggregate equals the plain aggregate of the updates the nodes computed, within the logged bound; every
    reply the server received has no array left; aggregation gets one update, the round's combination."""
    from fedmerge.algorithms.scaffold import Scaffold
    from fedmerge.engines.flower import worker

    cfg = quick_config(*SMALL, "rounds=2")
    files = export(cfg, tmp_path / "clients")
    computed: dict[int, dict] = {}  # round -> {cid: update} as each node computed it (node side only)
    secure_reply = worker._secure_reply

    def recording(call, context, update, settings):
        computed.setdefault(call.rnd, {})[call.cid] = update.clone()
        return secure_reply(call, context, update, settings)

    monkeypatch.setattr(worker, "_secure_reply", recording)
    aggregated: list = []  # (the server's algorithm, updates given to aggregate, state before, state after)
    plain_aggregate = Scaffold.aggregate

    def spy(self, state, rnd, updates):
        new = plain_aggregate(self, state, rnd, updates)
        aggregated.append((self, updates, state, new))
        return new

    monkeypatch.setattr(Scaffold, "aggregate", spy)
    grid = SecureGrid(files, tmp_path / "state")
    result = deploy(tmp_path, quick_config(*SMALL, "rounds=2", "engine=flower", *SECURE), grid)
    rows = RunStore(result.run_dir).read_metrics()
    assert [r["secure_aggregation"]["clients"] for r in rows] == [[0, 1, 2], [0, 1, 2]]

    # what the server held: in every reply no array (the mod empties them after masking)
    trains = [(m, r) for m, r in grid.received if m.metadata.message_type == "train"]
    assert len(trains) == 2 * 4 * 3  # 2 rounds x SecAgg+'s 4 stages x 3 nodes
    for _, reply in trains:
        assert not reply.has_error()
        assert all(len(record) == 0 for record in reply.content.array_records.values())
    # aggregation got one update per round: the combination, never a client's
    assert [len(updates) for _, updates, _, _ in aggregated] == [1, 1]
    for (server, updates, before, new), row in zip(aggregated, rows):
        rnd = row["round"]
        (combined,) = updates.values()
        for update in computed[rnd].values():
            assert any(not torch.equal(combined.tensors[k], v) for k, v in update.tensors.items())
        # ... and aggregates to the plain result of the updates the nodes computed, within the bound
        bound = row["secure_aggregation"]["error_bound"]
        assert 0 < bound < 1e-5
        reference = plain_aggregate(server, before, rnd, computed[rnd])
        for k, v in reference.tensors.items():
            err = float((new.tensors[k].double() - v.double()).abs().max())
            assert err <= bound + 1e-6 * float(v.abs().max()), (rnd, k, err, bound)
        assert any(not torch.equal(new.tensors[k], before.tensors[k]) for k in before.tensors)


@pytest.mark.slow
@pytest.mark.processes
def test_real_superlink_and_three_supernodes_aggregate_securely(tmp_path, deployment, task_identity):  # noqa: F811
    """A SuperLink and three SuperNode processes (each with only its own client file), ``fedmerge deploy
    run`` with SCAFFOLD under SecAgg+ for 2 rounds: the run completes with every client in each round's sum,
    and its final server state equals a plain deployment's (in process, no secure aggregation) up to the
    quantization's effect; each client sent one masked vector (its tensors and Flower's weight factor)."""
    from helpers import run
    from test_flower_deploy import export_three, fedmerge_cli, free_port, wait_for_port, write_connections

    from fedmerge.config.schema import load_config
    from fedmerge.core.checkpoint import load_checkpoint

    procs, home = deployment
    files = export_three(tmp_path / "clients")
    port = free_port()
    write_connections(home, {"local": f'address = "127.0.0.1:{port}"\ninsecure = true'})
    link = procs.start("link", "flower-superlink", "--insecure", "--port", str(port),
                       "--disable-runtime-dependency-installation")  # fmt: skip
    wait_for_port(port, link)
    for i, f in enumerate(files):
        node_config = f'data-path="{f}" state-dir="{tmp_path / f"s{i}"}"'
        procs.start(f"node{i}", "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{port}",
                    "--port", str(free_port()), "--node-config", node_config)  # fmt: skip
    # one evaluation (each exchange costs every node a fresh ClientApp process)
    overrides = ["rounds=2", "eval_every=2", "algorithm.name=scaffold", "algorithm.local_epochs=1", *SECURE]
    out = tmp_path / "runs"
    launch = procs.start("launch", *fedmerge_cli("deploy", "run", "local", *overrides, "--output-dir", str(out)))
    try:
        launch.wait(timeout=420)
    except Exception:
        pytest.fail(f"fedmerge deploy run did not end:\n{procs.log('launch')[-3000:]}")
    assert launch.returncode == 0, procs.log("launch")[-3000:]
    (run_dir,) = out.iterdir()
    rows = RunStore(run_dir).read_metrics()
    assert [r["secure_aggregation"]["clients"] for r in rows] == [[0, 1, 2], [0, 1, 2]]
    secure = load_checkpoint(run_dir / "checkpoints").server_state.tensors
    size = 1 + sum(v.numel() for v in secure.values())  # SCAFFOLD's update: the model and the control changes
    assert all(c["up"] == size for r in rows for c in r["comm_clients"].values())

    plain_cfg = load_config(None, [*overrides[:4], "engine=flower"])
    plain = run(plain_cfg, tmp_path / "plain", grid=NodeGrid(files, tmp_path / "plain-state"), deployment=True)
    reference = load_checkpoint(plain.run_dir / "checkpoints").server_state.tensors
    assert secure.keys() == reference.keys()
    for k, v in reference.items():
        torch.testing.assert_close(secure[k], v, rtol=0, atol=1e-5)


class RecordingFakeGrid:
    """A simulation's fake Grid (each message to its node's ClientApp in this process) that keeps every reply;
    each node gets its own copy of a message, as SecAgg+'s mod needs."""

    def __init__(self, num_nodes: int):
        from test_flower_engine import FakeGrid

        self.inner = FakeGrid(num_nodes)
        self.received: list = []

    def get_node_ids(self):
        return self.inner.get_node_ids()

    def send_and_receive(self, messages, *, timeout=None):
        replies = self.inner.send_and_receive([copy.deepcopy(m) for m in messages], timeout=timeout)
        self.received += replies
        return replies


def test_a_secure_simulation_sends_no_client_state_to_the_server_and_refuses_to_resume(tmp_path, task_identity):
    """Ditto keeps a personal model in its state; in a Flower simulation under SecAgg+ no reply (training or
    evaluation: a client not trained yet makes its state there) carries a client state, only its shapes."""
    from helpers import run

    from fedmerge.config.schema import ConfigError
    from fedmerge.engines.flower.protocol import STATE
    from fedmerge.engines.flower.records import has_record

    overrides = ["partition.num_clients=3", "participation=0.67", "algorithm.name=ditto", "rounds=2", "engine=flower",
                 *SECURE]  # fmt: skip
    grid = RecordingFakeGrid(3)
    result = run(quick_config(*overrides), tmp_path / "r", grid=grid)
    assert len(grid.received) > 3 * 4
    for reply in grid.received:
        assert not reply.has_error()
        assert not has_record(reply.content, STATE)
        for record in [*reply.content.metric_records.values(), *reply.content.config_records.values()]:
            # SecAgg+'s own keys and shares are short; a serialized state (Ditto's personal model) is kilobytes
            big = [k for k, v in record.items() if isinstance(v, bytes) and (len(v) > 1024 or "state" in k)]
            assert not big, (reply.metadata.message_type, big)
    assert "comm_up" in RunStore(result.run_dir).read_metrics()[-1]
    with pytest.raises(ConfigError, match="cannot resume"):
        run(quick_config(*overrides), tmp_path / "r", resume=True, grid=RecordingFakeGrid(3))
