"""The Engine protocol over a Flower Grid: one Message per selected client, each with its own arrays.

The server maps Flower node ids to partition (client) ids explicitly with a handshake; a client that
raises or does not answer in time is dropped from that round and recorded in ``failures``; a round
with fewer training replies than ``min_replies`` is retried on the failed clients, then stopped.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from torch import nn

from fedmerge.core.algorithm import Algorithm
from fedmerge.core.loop import RoundFailed  # noqa: F401  (re-exported: raised here)
from fedmerge.core.types import ClientState, Payload, ServerState, Update
from fedmerge.engines.local import LocalEngine

from .protocol import JOB, METRICS, PAYLOAD, STATE, UPDATE
from .records import get_record, has_record, put_record

log = logging.getLogger(__name__)
Metrics = dict[str, float]


class GridLike(Protocol):
    """What the engine needs of a ``flwr.serverapp.Grid`` (the simulation proxies it from a thread)."""

    def get_node_ids(self) -> Iterable[int]: ...

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]: ...


@dataclass(frozen=True)
class FlowerOptions:
    min_replies: int = 1
    max_retries: int = 1
    round_timeout: float = 600.0
    connect_timeout: float = 120.0


class FlowerEngine:
    """Runs client work on Flower SuperNodes (virtual or real). Server-side only.

    Client states live in each ClientApp's ``context.state``; the engine keeps the copy each reply
    carries only so that checkpoints (and exact resume) hold every client state, as with ``local``.
    """

    def __init__(
        self,
        grid: GridLike,
        experiment: dict[str, Any],
        num_clients: int,
        model: nn.Module,
        device: torch.device,
        seed: int,
        options: FlowerOptions,
        pooled_test: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None,
        eval_batch_size: int = 1024,
        on_client_done: Callable[[int], None] | None = None,
    ) -> None:
        self.grid = grid
        self.experiment_json = json.dumps(experiment, sort_keys=True)
        self.num_clients = num_clients
        self.options = options
        self.on_client_done = on_client_done
        # The pooled test of a global model runs on the server, exactly as in the local engine.
        self._server = LocalEngine([], model, device, seed, pooled_test, eval_batch_size)
        self._states: dict[int, ClientState] = {}
        self._push: set[int] = set()  # clients whose context.state must be restored (after resume)
        self.failures: list[dict[str, Any]] = []
        self.node_of = self._map_partitions()
        self._cid_of = {node: cid for cid, node in self.node_of.items()}

    # --- node id <-> partition id ----------------------------------------------------------
    def _map_partitions(self) -> dict[int, int]:
        """Ask every node for its ``partition-id`` until each client id 0..N-1 has exactly one node."""
        deadline = time.monotonic() + self.options.connect_timeout
        node_of: dict[int, int] = {}
        asked: set[int] = set()
        while True:
            new = [n for n in self.grid.get_node_ids() if n not in asked]
            if new:
                messages = [Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY) for n in new]
                for reply in self.grid.send_and_receive(messages, timeout=max(deadline - time.monotonic(), 1.0)):
                    node = reply.metadata.src_node_id
                    if reply.has_error():
                        log.warning("node %s did not say its partition-id: %s", node, reply.error.reason)
                        continue
                    asked.add(node)
                    pid = int(reply.content.config_records[JOB]["partition_id"])
                    if pid in node_of and node_of[pid] != node:
                        raise RoundFailed(f"partition-id {pid} is claimed by two SuperNodes ({node_of[pid]}, {node})")
                    if not 0 <= pid < self.num_clients:
                        log.warning(
                            "node %s has partition-id %s outside 0..%s; ignored", node, pid, self.num_clients - 1
                        )
                        continue
                    node_of[pid] = node
            if len(node_of) == self.num_clients:
                return node_of
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.num_clients)) - set(node_of))
                raise RoundFailed(
                    f"no SuperNode for partition-id {missing[:10]} after {self.options.connect_timeout:.0f}s "
                    f"({len(node_of)} of {self.num_clients} connected); start one per partition with "
                    "--node-config partition-id=N"
                )
            time.sleep(0.2)

    # --- client state copies (checkpoints) ---------------------------------------------------
    def client_states(self) -> dict[int, ClientState]:
        return self._states

    def load_client_states(self, states: dict[int, ClientState]) -> None:
        self._states = dict(states)
        self._push = set(states)

    # --- rounds ------------------------------------------------------------------------------
    def fit(self, algorithm: Algorithm, rnd: int, payloads: dict[int, Payload]) -> dict[int, Update]:
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

    def evaluate(self, algorithm: Algorithm, rnd: int, payloads: dict[int, Payload]) -> dict[int, Metrics]:
        replies = self._exchange(MessageType.EVALUATE, algorithm, rnd, payloads)
        return {cid: {k: float(v) for k, v in replies[cid].metric_records[METRICS].items()} for cid in sorted(replies)}

    def evaluate_global(self, algorithm: Algorithm, state: ServerState) -> Metrics | None:
        return self._server.evaluate_global(algorithm, state)

    def pop_failures(self) -> list[dict[str, Any]]:
        out, self.failures = self.failures, []
        return out

    # --- messages ----------------------------------------------------------------------------
    def _exchange(
        self, kind: str, algorithm: Algorithm, rnd: int, payloads: dict[int, Payload]
    ) -> dict[int, RecordDict]:
        """Send each client its own payload; return the contents of the good replies by client id."""
        messages = [self._message(kind, algorithm, rnd, cid, payload) for cid, payload in sorted(payloads.items())]
        good: dict[int, RecordDict] = {}
        errored: set[int] = set()
        for reply in self.grid.send_and_receive(messages, timeout=self.options.round_timeout):
            cid = self._cid_of.get(reply.metadata.src_node_id)
            if cid is None or cid not in payloads:
                continue
            if reply.has_error():
                errored.add(cid)
                self._fail(rnd, cid, kind, _one_line(reply.error.reason))
                continue
            content = reply.content
            if has_record(content, STATE):
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

    def _message(self, kind: str, algorithm: Algorithm, rnd: int, cid: int, payload: Payload) -> Message:
        content = RecordDict()
        content[JOB] = ConfigRecord(
            {
                "round": rnd,
                "cid": cid,
                "experiment": self.experiment_json,
                "algorithm_module": type(algorithm).__module__,
            }
        )
        put_record(content, PAYLOAD, payload)
        if cid in self._push:
            put_record(content, STATE, self._states[cid])
        return Message(content, dst_node_id=self.node_of[cid], message_type=kind)


def _one_line(text: str, limit: int = 300) -> str:
    """Flower wraps ClientApp exceptions in long, multi-line reasons; keep the last informative line."""
    lines = [ln.strip() for ln in text.replace("\\n", "\n").splitlines() if ln.strip()]
    msg = next((ln for ln in reversed(lines) if "Message:" in ln or "Error" in ln), lines[-1] if lines else text)
    return msg[:limit]
