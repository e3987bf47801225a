"""The Engine protocol over a Flower Grid: one Message per selected client, each with its own arrays.

The server maps Flower node ids to partition (client) ids explicitly with a handshake (`connect()`;
deployed nodes also report their data file's classes and input shape, which must agree, so the server
needs no dataset); a SuperNode that comes back with a new id is found again before each exchange; a client that
raises or does not answer in time is dropped from that round and recorded in ``failures``; a round
with fewer training replies than ``min_replies`` is retried on the failed clients, then stopped.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from torch import nn

from fedmerge.core.algorithm import Algorithm
from fedmerge.core.loop import RoundFailed  # noqa: F401  (re-exported: raised here)
from fedmerge.core.secure_sum import SummedUpdates, combine
from fedmerge.core.types import ClientState, Payload, ServerState, Update
from fedmerge.data.client_files import check_consistent
from fedmerge.data.errors import ClientFileError
from fedmerge.engines.local import LocalEngine

from .federation import Federation, FlowerOptions, GridLike, _one_line, query_nodes, send_and_receive
from .node import meta_from_report
from .protocol import DEPLOYMENT, JOB, METRICS, PAYLOAD, SIMULATION, STATE, UPDATE
from .records import get_record, has_record, put_record

log = logging.getLogger(__name__)
Metrics = dict[str, float]


class FlowerEngine:
    """Runs client work on Flower SuperNodes (virtual or real). Server-side only.

    ``mode`` (``protocol``): in a simulation the engine keeps the state copy each reply carries, so
    that checkpoints (and exact resume) hold every client state, as with ``local``. Deployed, client
    states stay on the nodes; the engine only tracks, per client, the last round whose result it
    received (``state_round`` in each message), which the checkpoint keeps.
    """

    def __init__(
        self,
        grid: GridLike,
        federation: Federation,
        job: dict[str, Any],
        model: nn.Module,
        device: torch.device,
        seed: int,
        options: FlowerOptions,
        pooled_test: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None,
        eval_batch_size: int = 1024,
        on_client_done: Callable[[int], None] | None = None,
        mode: str = SIMULATION,
        run_key: str = "",
        secure_aggregation: Any = None,
    ) -> None:
        self.grid = grid
        # privacy.secure_aggregation: each round's training runs Flower's SecAgg+ (secure.py)
        self.secure_aggregation = secure_aggregation
        # where the client states stay: on the nodes when deployed, and in a secure simulation too (a state in a
        # reply would hand the server a client's personal model, which secure aggregation promises it never sees)
        self.states_on_nodes = mode == DEPLOYMENT or secure_aggregation is not None
        self.job_json = json.dumps(job, sort_keys=True)
        self.mode = mode
        self.federation = federation
        self.num_clients = federation.num_clients
        self.options = options
        self.on_client_done = on_client_done
        # The pooled test of a global model runs on the server, exactly as in the local engine.
        self._server = LocalEngine([], model, device, seed, pooled_test, eval_batch_size)
        self._states: dict[int, ClientState] = {}
        self._push: set[int] = set()  # clients whose context.state must be restored (after resume)
        self.failures: list[dict[str, Any]] = []
        self.node_of = dict(federation.node_of)
        self._cid_of = {node: cid for cid, node in self.node_of.items()}
        self._asked = set(self._cid_of)
        self.state_round: dict[int, int] = {}  # deployment: per client, last round whose result arrived
        self._kept: dict[int, int] = {}  # the same, as of the oldest checkpoint kept
        self._snapshots: list[dict[int, int]] = []  # the same, as of each checkpoint kept
        # deployment: which of a node's stored runs this one is (config digest and a fresh id, kept by
        # the checkpoints), so that a node never continues from another run's state
        self.run_key = run_key
        self._state_shapes: dict[int, ClientState] = {}  # deployment: per client, its state's shapes only

    # --- node id <-> partition id after the start ---------------------------------------------------
    def _rejoin(self, cids: list[int]) -> None:
        """Before an exchange: wait (up to ``flower.connect_timeout``) until the node of every client in
        ``cids`` is online. A SuperNode that was restarted comes back with its old node id (SuperNode
        authentication ties the id to its key) or a new one, which the handshake maps again. So a node
        that is restarted in time misses only the exchanges it was down for, whatever the timing."""
        deadline = time.monotonic() + self.options.connect_timeout
        while True:
            online = set(self.grid.get_node_ids())
            new = [n for n in online if n not in self._asked]
            if new:
                self._adopt(new)
            missing = [c for c in cids if self.node_of.get(c) not in online]
            if not missing:
                return
            if time.monotonic() > deadline:
                log.warning("clients %s have no SuperNode online; their messages will fail", missing[:10])
                return
            time.sleep(0.5)

    def _adopt(self, nodes: list[int]) -> None:
        for node, answer in query_nodes(self.grid, nodes, self.mode, self.options.connect_timeout):
            self._asked.add(node)
            if answer.get("error"):
                log.warning("SuperNode %s cannot serve: %s", node, answer["error"])
                continue
            pid = int(answer["partition_id"])
            if not 0 <= pid < self.num_clients:
                continue
            if self.mode == DEPLOYMENT:
                try:
                    check_consistent([self.federation.first, meta_from_report(str(answer["data"]), f"node {node}")])
                except ClientFileError as exc:
                    log.warning("SuperNode %s ignored: %s", node, exc)
                    continue
            log.warning("client %s is now served by SuperNode %s (was %s)", pid, node, self.node_of.get(pid))
            self._cid_of.pop(self.node_of.get(pid, -1), None)
            self.node_of[pid] = node
            self._cid_of[node] = pid

    # --- client state copies (checkpoints) ---------------------------------------------------
    def client_states(self) -> dict[int, ClientState]:
        return self._states  # deployment: always empty, the states stay on the nodes

    def load_client_states(self, states: dict[int, ClientState]) -> None:
        self._states = dict(states)
        self._push = set(states)

    def client_state_shapes(self) -> dict[int, ClientState]:
        """The client states as the summary sizes them. Deployed, the nodes keep their states and report
        only their tensors' shapes and dtypes: meta-device stand-ins of those (no value exists here)."""
        return self._states if not self.states_on_nodes else dict(self._state_shapes)

    def checkpoint_meta(self, keep: int = 1) -> dict[str, Any]:
        """What a checkpoint must keep of this engine (deployment: the rounds of the nodes' states).
        ``keep``: how many checkpoints the run keeps; nodes keep every state version any of them needs."""
        if self.mode != DEPLOYMENT:
            return {}
        self._snapshots = [*self._snapshots, dict(self.state_round)][-max(keep, 1) :]
        self._kept = self._snapshots[0]  # the oldest checkpoint kept: nodes prune up to it
        rounds = {str(c): r for c, r in sorted(self.state_round.items())}
        return {"node_state_rounds": rounds, "node_run_key": self.run_key}

    def restore(self, meta: dict[str, Any]) -> None:
        rounds = {int(c): int(r) for c, r in (meta.get("node_state_rounds") or {}).items()}
        self.state_round, self._kept, self._snapshots = dict(rounds), dict(rounds), [dict(rounds)]
        self.run_key = str(meta.get("node_run_key") or self.run_key)

    # --- rounds ------------------------------------------------------------------------------
    def fit(self, algorithm: Algorithm, rnd: int, payloads: dict[int, Payload]) -> dict[int, Update] | SummedUpdates:
        if self.secure_aggregation is not None:
            return self._secure_fit(algorithm, rnd, payloads)
        need = min(self.options.min_replies, len(payloads))
        updates: dict[int, Update] = {}
        pending = dict(payloads)
        for attempt in range(self.options.max_retries + 1):
            for cid, reply in self._exchange(MessageType.TRAIN, algorithm, rnd, pending).items():
                updates[cid] = get_record(reply, UPDATE, Update)
            if len(updates) >= need:
                break
            pending = {cid: p for cid, p in payloads.items() if cid not in updates}
            if attempt < self.options.max_retries:
                log.warning(
                    "round %s: %s of %s replies (< min_replies=%s); retrying %s",
                    rnd,
                    len(updates),
                    len(payloads),
                    need,
                    sorted(pending),
                )
        if len(updates) < need:
            reasons = "; ".join(f"client {f['cid']}: {f['reason']}" for f in self.failures if f["round"] == rnd)
            raise RoundFailed(
                f"round {rnd}: {len(updates)} of {len(payloads)} clients replied, fewer than "
                f"flower.min_replies={need} after {self.options.max_retries} retries ({reasons})"
            )
        return {cid: updates[cid] for cid in sorted(updates)}

    def evaluate(
        self, algorithm: Algorithm, rnd: int, payloads: dict[int, Payload], *, newcomers: bool = False
    ) -> dict[int, Metrics]:
        replies = self._exchange(MessageType.EVALUATE, algorithm, rnd, payloads, onboard=newcomers)
        return {cid: {k: float(v) for k, v in replies[cid].metric_records[METRICS].items()} for cid in sorted(replies)}

    def onboard(
        self, algorithm: Algorithm, rnd: int, payloads: dict[int, Payload]
    ) -> dict[int, tuple[Metrics, dict[str, str]]]:
        """Deployment: each newcomer's metrics and what its node says of the model it kept (``newcomer.py``:
        where it saved it); failures are in ``failures``."""
        replies = self._exchange(MessageType.EVALUATE, algorithm, rnd, payloads, onboard=True)
        out = {}
        for cid, content in sorted(replies.items()):
            notes = dict(content.config_records[JOB]) if JOB in content.config_records else {}
            metrics = {k: float(v) for k, v in content.metric_records[METRICS].items()}
            out[cid] = (metrics, {k: str(v) for k, v in notes.items()})
        return out

    def evaluate_global(self, algorithm: Algorithm, state: ServerState) -> Metrics | None:
        return self._server.evaluate_global(algorithm, state)

    def pop_failures(self) -> list[dict[str, Any]]:
        out, self.failures = self.failures, []
        return out

    def _secure_fit(self, algorithm: Algorithm, rnd: int, payloads: dict[int, Payload]) -> SummedUpdates:
        """One round of training through Flower's SecAgg+: only the sum of the clients' vectors and each
        client's metadata reach this process (``secure.py``). A client that fails in any stage is left out
        of the sum (the protocol unmasks without it); too few, and the round stops with one line."""
        from .secure import LAYOUT, META, STATE_SHAPES, run_round, sum_settings

        if len(payloads) < 2:
            raise RoundFailed(
                f"round {rnd}: secure aggregation needs at least 2 clients in a round, not {len(payloads)}"
            )
        self._rejoin(sorted(payloads))
        settings = sum_settings(self.secure_aggregation, len(payloads))
        contents = {}
        for cid, payload in sorted(payloads.items()):
            message = self._message(MessageType.TRAIN, algorithm, rnd, cid, payload, secure=settings.to_json())
            contents[message.metadata.dst_node_id] = message.content
        total, metrics, errors = run_round(
            lambda messages, timeout: send_and_receive(self.grid, messages, timeout),
            contents, rnd, self.secure_aggregation, self.options.round_timeout,
        )  # fmt: skip
        included = {self._cid_of[n]: m for n, m in metrics.items() if n in self._cid_of}
        for cid in sorted(set(payloads) - set(included)):
            node = self.node_of.get(cid, -1)
            reason = _one_line(errors[node]) if node in errors else "left out of the secure sum (no reply in time)"
            self._fail(rnd, cid, MessageType.TRAIN, reason)
        need = max(2, min(self.options.min_replies, len(payloads)))
        if total is None or len(included) < need:
            reasons = "; ".join(f"client {f['cid']}: {f['reason']}" for f in self.failures if f["round"] == rnd)
            raise RoundFailed(
                f"round {rnd}: secure aggregation ended with {len(included)} of {len(payloads)} clients "
                f"(needs {need}){': ' + reasons if reasons else ''}"
            )
        metas = {cid: json.loads(str(m[META])) for cid, m in sorted(included.items())}
        layouts = {str(m[LAYOUT]) for m in included.values()}
        if len(layouts) != 1:
            raise RoundFailed(f"round {rnd}: the clients' secure vectors differ in layout, so their sum means nothing")
        layout = [(k, d, list(s)) for k, d, s in json.loads(layouts.pop())]
        weights = {cid: algorithm.secure_weight(meta) for cid, meta in metas.items()}
        sent = {cid: payloads[cid].tensors for cid in metas}
        tensors, bound = combine(total, layout, sent, weights, algorithm.secure_summed, settings)
        combined = Update(tensors, {"num_examples": int(sum(int(m["num_examples"]) for m in metas.values()))})
        size = 1 + sum(int(np.prod(s)) for _, _, s in layout)  # the masked vector (and its weight factor)
        for cid, m in sorted(included.items()):
            if self.mode == DEPLOYMENT:
                self.state_round[cid] = max(self.state_round.get(cid, 0), rnd)
            if STATE_SHAPES in m:  # secure rounds keep every state on its node (simulated or deployed)
                self._state_shapes[cid] = state_stand_in(str(m[STATE_SHAPES]))
            self._push.discard(cid)
            if self.on_client_done is not None:
                self.on_client_done(cid)
        return SummedUpdates(combined, metas, bound, {cid: size for cid in metas})

    # --- messages ----------------------------------------------------------------------------
    def _exchange(
        self, kind: str, algorithm: Algorithm, rnd: int, payloads: dict[int, Payload], onboard: bool = False
    ) -> dict[int, RecordDict]:
        """Send each client its own payload; return the contents of the good replies by client id. ``onboard``:
        an evaluation of clients that never trained (no state travels either way)."""
        self._rejoin(sorted(payloads))
        messages = [
            self._message(kind, algorithm, rnd, cid, payload, onboard) for cid, payload in sorted(payloads.items())
        ]
        replies = send_and_receive(self.grid, messages, self.options.round_timeout)
        # Flower sets each message's id when it is sent; the SuperLink answers for an unreachable
        # node itself, so a reply is matched by the message it answers, else by its sender
        cid_of_message = {
            m.metadata.message_id: cid for m, cid in zip(messages, sorted(payloads)) if m.metadata.message_id
        }
        good: dict[int, RecordDict] = {}
        errored: set[int] = set()
        for reply in replies:
            cid = cid_of_message.get(reply.metadata.reply_to_message_id, self._cid_of.get(reply.metadata.src_node_id))
            if cid is None or cid not in payloads:
                continue
            if reply.has_error():
                errored.add(cid)
                self._fail(rnd, cid, kind, _one_line(reply.error.reason))
                continue
            content = reply.content
            if onboard:
                pass  # a newcomer keeps no state: nothing to track
            elif self.states_on_nodes:
                if self.mode == DEPLOYMENT:
                    self.state_round[cid] = max(self.state_round.get(cid, 0), rnd)
                if JOB in content.config_records and "state_shapes" in content.config_records[JOB]:
                    self._state_shapes[cid] = state_stand_in(str(content.config_records[JOB]["state_shapes"]))
            elif has_record(content, STATE):
                self._states[cid] = get_record(content, STATE, ClientState)
            self._push.discard(cid)
            good[cid] = content
            if self.on_client_done is not None:
                self.on_client_done(cid)
        for cid in sorted(set(payloads) - set(good) - errored):
            self._fail(rnd, cid, kind, f"no reply within flower.round_timeout={self.options.round_timeout:g}s")
        return good

    def _fail(self, rnd: int, cid: int, kind: str, reason: str) -> None:
        log.warning("round %s: client %s failed in %s and is dropped: %s", rnd, cid, kind, reason)
        self.failures.append({"round": rnd, "cid": cid, "phase": kind, "reason": reason})

    def _message(
        self,
        kind: str,
        algorithm: Algorithm,
        rnd: int,
        cid: int,
        payload: Payload,
        onboard: bool = False,
        secure: str | None = None,
    ) -> Message:
        content = RecordDict()
        job: dict[str, Any] = {
            "round": rnd,
            "cid": cid,
            "experiment": self.job_json,
            "algorithm_module": type(algorithm).__module__,
            "mode": self.mode,
        }
        if onboard:
            job["onboard"] = True
        if secure is not None:  # the node answers with its vector for the secure sum (core/secure_sum.py)
            job["secure_aggregation"] = secure
        if self.states_on_nodes and self.mode != DEPLOYMENT:
            job["keep_state"] = True  # a secure simulation: the state stays in the node's context
        if self.mode == DEPLOYMENT:
            job["state_round"] = self.state_round.get(cid, 0)
            job["keep_round"] = self._kept.get(cid, 0)
            job["run_key"] = self.run_key
        content[JOB] = ConfigRecord(job)
        put_record(content, PAYLOAD, payload)
        if cid in self._push and self.mode != DEPLOYMENT and not onboard:
            put_record(content, STATE, self._states[cid])
        return Message(content, dst_node_id=self.node_of[cid], message_type=kind)


def state_stand_in(shapes: str) -> ClientState:
    """A ClientState of meta-device tensors shaped as a node reported (``{key: [dtype, shape]}``)."""
    meta, reported = torch.device("meta"), json.loads(shapes)
    return ClientState({k: torch.empty(s, dtype=getattr(torch, d), device=meta) for k, (d, s) in reported.items()})


# Flower's reason for a ClientApp that raised: "<class 'KeyError'>:<''body.1.weight''>"
