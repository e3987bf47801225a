"""The ClientApp. Handlers import the heavy work lazily, so the partition handshake is cheap
(a deployed SuperNode starts a fresh ClientApp process for every message)."""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from .protocol import JOB

app = ClientApp()


def partition_id(context: Context) -> int:
    if "partition-id" not in context.node_config:
        raise ValueError("this SuperNode has no partition-id; start it with --node-config partition-id=N")
    return int(context.node_config["partition-id"])


@app.query()
def query(msg: Message, context: Context) -> Message:
    """The handshake: tell the server which partition (client id) this node owns."""
    return Message(RecordDict({JOB: ConfigRecord({"partition_id": partition_id(context)})}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    from . import worker

    return worker.train(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    from . import worker

    return worker.evaluate(msg, context)
