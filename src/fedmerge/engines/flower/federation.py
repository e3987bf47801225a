"""Finding the federation on a Flower Grid: which node holds which client (a handshake,
[`connect()`][fedmerge.engines.flower.federation.connect]), what
deployed nodes report of their data (classes and input shape, which must agree), newcomers, and the one
send-and-receive that polls until replies or the timeout."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from fedmerge.core.loop import RoundFailed  # noqa: F401  (re-exported: raised here)
from fedmerge.data.client_files import ClientFileMeta, check_consistent
from fedmerge.data.errors import ClientFileError

from .node import meta_from_report
from .protocol import DEPLOYMENT, JOB

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


@dataclass
class Federation:
    """Who serves which client: the handshake's result.

    ``reports``: per client id, what its node's data file says about itself (deployment only)."""

    node_of: dict[int, int]
    num_clients: int
    reports: dict[int, ClientFileMeta] = field(default_factory=dict)
    # deployment: the server operator's pooled test set (x, y), if given
    pooled_test: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def first(self) -> ClientFileMeta:
        return self.reports[min(self.reports)]

    @property
    def groups(self) -> list[int | None]:
        return [self.reports[c].group if c in self.reports else None for c in range(self.num_clients)]


class FederationError(RoundFailed):
    """The SuperNodes cannot form this federation (bad file, disagreement, duplicate client id)."""


POLL_SECONDS = 0.2


def send_and_receive(grid: GridLike, messages: list[Message], timeout: float) -> list[Message]:
    """``grid.send_and_receive``, polling for replies every 0.2 s where the Grid can push and pull
    (Flower's own loop sleeps 3 s between pulls, which a round pays once per exchange)."""
    if not (hasattr(grid, "push_messages") and hasattr(grid, "pull_messages")):
        return list(grid.send_and_receive(messages, timeout=timeout))
    pending = {i for i in grid.push_messages(messages) if i}
    replies: list[Message] = []
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        got = list(grid.pull_messages(pending))
        replies.extend(got)
        pending -= {m.metadata.reply_to_message_id for m in got}
        if pending:
            time.sleep(POLL_SECONDS)
    return replies


def query_nodes(grid: GridLike, nodes: list[int], mode: str, timeout: float) -> list[tuple[int, dict[str, Any]]]:
    """Ask ``nodes`` who they are; (node, answer) for each node that answered."""
    messages = [
        Message(RecordDict({JOB: ConfigRecord({"mode": mode})}), dst_node_id=n, message_type=MessageType.QUERY)
        for n in nodes
    ]
    out = []
    for reply in send_and_receive(grid, messages, timeout):
        node = reply.metadata.src_node_id
        if reply.has_error():
            log.warning("node %s did not say its partition-id: %s", node, _one_line(reply.error.reason))
            continue
        out.append((node, dict(reply.content.config_records[JOB])))
    return out


def connect(grid: GridLike, options: FlowerOptions, mode: str, num_clients: int | None = None) -> Federation:
    """The handshake: ask every node for its client id (and, deployed, its data file's metadata) until
    each client id 0..N-1 has exactly one node. ``num_clients``: known in a simulation; deployed, the
    nodes' files say it. Stops at the first node that cannot serve, at a client id claimed twice, and
    at nodes whose files disagree (classes, input shape, number of clients, export)."""
    deadline = time.monotonic() + options.connect_timeout
    node_of: dict[int, int] = {}
    reports: dict[int, ClientFileMeta] = {}
    asked: set[int] = set()
    while True:
        new = [n for n in grid.get_node_ids() if n not in asked]
        if new:
            for node, answer in query_nodes(grid, new, mode, max(deadline - time.monotonic(), 1.0)):
                asked.add(node)
                if answer.get("error"):
                    raise FederationError(f"SuperNode {node} cannot serve: {answer['error']}")
                pid = int(answer["partition_id"])
                if pid in node_of and node_of[pid] != node:
                    raise FederationError(
                        f"partition-id {pid} is claimed by two SuperNodes ({node_of[pid]}, {node}); "
                        "give each node its own client file"
                    )
                if mode == DEPLOYMENT:
                    reports[pid] = meta_from_report(str(answer["data"]), f"SuperNode {node}")
                    try:
                        check_consistent(list(reports.values()))
                    except ClientFileError as exc:
                        raise FederationError(str(exc)) from None
                    num_clients = reports[pid].num_clients
                if num_clients is not None and not 0 <= pid < num_clients:
                    log.warning("node %s has partition-id %s outside 0..%s; ignored", node, pid, num_clients - 1)
                    continue
                node_of[pid] = node
        if num_clients is not None and len(node_of) == num_clients:
            return Federation(node_of, num_clients, reports)
        if time.monotonic() > deadline:
            how = "start one per client with --node-config " + (
                "'data-path=\"FILE\"'" if mode == DEPLOYMENT else "partition-id=N"
            )
            if num_clients is None:
                raise RoundFailed(f"no SuperNode connected within {options.connect_timeout:.0f}s; {how}")
            missing = sorted(set(range(num_clients)) - set(node_of))
            raise RoundFailed(
                f"no SuperNode for partition-id {missing[:10]} after {options.connect_timeout:.0f}s "
                f"({len(node_of)} of {num_clients} connected); {how}"
            )
        time.sleep(0.2)


def connect_newcomers(
    grid: GridLike, options: FlowerOptions, participants: int, wanted: list[int] | None = None
) -> Federation:
    """The handshake of an onboarding (deployment): the SuperNodes of clients that never trained, i.e. whose client
    id is ``participants`` or more. ``wanted``: wait (up to ``connect_timeout``) for exactly these clients; else
    take every newcomer online once at least one is, and leave participants' nodes alone. Stops at a node that
    cannot serve, a client id claimed twice, nodes whose files disagree, and a wanted client that trained."""
    deadline = time.monotonic() + options.connect_timeout
    node_of: dict[int, int] = {}
    reports: dict[int, ClientFileMeta] = {}
    asked: set[int] = set()
    for pid in wanted or []:
        if pid < participants:
            raise FederationError(
                f"partition-id {pid} took part in training (clients 0..{participants - 1}); onboarding is for "
                "clients that never trained"
            )
    while True:
        new = [n for n in grid.get_node_ids() if n not in asked]
        for node, answer in query_nodes(grid, new, DEPLOYMENT, max(deadline - time.monotonic(), 1.0)) if new else []:
            asked.add(node)
            if answer.get("error"):
                raise FederationError(f"SuperNode {node} cannot serve: {answer['error']}")
            pid = int(answer["partition_id"])
            if pid < participants or (wanted is not None and pid not in wanted):
                log.info("SuperNode %s serves client %s, which is not to be onboarded; left alone", node, pid)
                continue
            if pid in node_of and node_of[pid] != node:
                raise FederationError(f"partition-id {pid} is claimed by two SuperNodes ({node_of[pid]}, {node})")
            reports[pid] = meta_from_report(str(answer["data"]), f"SuperNode {node}")
            try:
                check_consistent(list(reports.values()))
            except ClientFileError as exc:
                raise FederationError(str(exc)) from None
            node_of[pid] = node
        missing = sorted(set(wanted) - set(node_of)) if wanted is not None else ([] if node_of else [-1])
        if not missing:
            size = max(max(node_of) + 1, *(m.num_clients for m in reports.values()))
            return Federation(node_of, size, reports)
        if time.monotonic() > deadline:
            how = "start it with --node-config 'data-path=\"FILE\"' (its own client file)"
            if wanted is None:
                raise RoundFailed(
                    f"no SuperNode of a client that never trained (client id {participants} or more) connected "
                    f"within {options.connect_timeout:.0f}s; {how}"
                )
            raise RoundFailed(
                f"no SuperNode for partition-id {missing[:10]} after {options.connect_timeout:.0f}s; {how}"
            )
        time.sleep(0.2)


_FLOWER_REASON = re.compile(r"<class '(?:[\w.]*\.)?(\w+)'>:<'(.*)'>", re.DOTALL)


def _one_line(text: str, limit: int = 300) -> str:
    """A failure reason as one readable line: ``KeyError: 'body.1.weight'`` for Flower's wrapping of a
    ClientApp exception; otherwise the last informative line of a long, multi-line reason."""
    text = text.replace("\\n", "\n")
    if (m := _FLOWER_REASON.fullmatch(text.strip())) is not None:
        first = m.group(2).strip().splitlines()[0] if m.group(2).strip() else ""
        return f"{m.group(1)}: {first}"[:limit] if first else m.group(1)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    msg = next((ln for ln in reversed(lines) if "Message:" in ln or "Error" in ln), lines[-1] if lines else text)
    return msg[:limit]
