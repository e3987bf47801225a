"""The ClientApp. Handlers import the heavy work lazily, so the partition handshake is cheap
(a deployed SuperNode starts a fresh ClientApp process for every message)."""

from __future__ import annotations

from typing import Any

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp

from .protocol import DEPLOYMENT, JOB, partition_id

SECAGG_CONFIGS = "secaggplus_configs"  # flwr.common.secure_aggregation.secaggplus_constants.RECORD_KEY_CONFIGS


def secure_aggregation(msg: Message, context: Context, call_next: Any) -> Message:
    """Flower's SecAgg+ client mod for the messages of its protocol (``privacy.secure_aggregation``); every
    other message (the handshake, evaluation, training without it) goes straight to its handler."""
    if msg.metadata.message_type == MessageType.TRAIN and SECAGG_CONFIGS in msg.content.config_records:
        from flwr.client.mod import secaggplus_mod

        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


app = ClientApp(mods=[secure_aggregation])


@app.query()
def query(msg: Message, context: Context) -> Message:
    """The handshake: which partition (client id) this node owns and, when deployed, what its data
    file says about itself (classes, input shape, number of clients: never a sample). A node that
    cannot serve answers with a one-line ``error`` instead of raising, so the server can say why."""
    job = msg.content.config_records.get(JOB)
    answer: dict = {"partition_id": -1, "data": "", "error": ""}
    if job is not None and str(job.get("mode", "")) == DEPLOYMENT:
        from fedmerge.data.errors import ClientFileError

        from .node import NodeConfigError, data_report, node_meta, node_settings

        try:
            meta = node_meta(node_settings(dict(context.node_config)))
            answer.update(partition_id=meta.client_id, data=data_report(meta))
        except (ClientFileError, NodeConfigError) as exc:
            answer["error"] = str(exc).splitlines()[0]
    else:
        answer["partition_id"] = partition_id(dict(context.node_config))
    return Message(RecordDict({JOB: ConfigRecord(answer)}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    from . import worker

    return worker.train(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    from . import worker

    return worker.evaluate(msg, context)
