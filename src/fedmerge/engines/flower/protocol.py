"""Keys of the records exchanged by the ServerApp and the ClientApp (kept import-light)."""

from __future__ import annotations

from typing import Any

JOB = "fedmerge.job"  # ConfigRecord: round, cid, client job (JSON), algorithm module, mode, state rounds
PAYLOAD = "payload"  # server -> client: the client's own Payload
UPDATE = "update"  # client -> server: the Update
STATE = "state"  # simulation only: client -> server copy of the ClientState (checkpoints); server -> client on resume
METRICS = "metrics"  # client -> server: evaluation metrics (MetricRecord)
STATE_KEY = "fedmerge.client_state"  # simulation: in context.state, ConfigRecord {"bytes": ClientState.to_bytes()}

# Modes of a run. ``simulation``: one machine; the job carries the data config and client states ride
# with the messages (so resume is exact, as in the local engine). ``deployment``: every node loads its
# own client file and keeps its own state store; neither data config nor client state travels.
SIMULATION = "simulation"
DEPLOYMENT = "deployment"


def partition_id(node_config: dict[str, Any]) -> int:
    """The client id a simulated SuperNode serves (its ``partition-id``, set by the simulation)."""
    if "partition-id" not in node_config:
        raise ValueError("this SuperNode has no partition-id; start it with --node-config partition-id=N")
    return int(node_config["partition-id"])
