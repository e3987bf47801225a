"""Secure aggregation through Flower's SecAgg+ (its client mod and server workflow), driven by our round loop.

In process: three deployed nodes behind a fake Grid (the real ClientApp with Flower's mod, each node with its
own client file and Context), the server given no data. Real SuperLink and SuperNode processes: the last test.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import quick_config
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
