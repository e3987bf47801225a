"""Secure aggregation with Flower's own SecAgg+ (``privacy.secure_aggregation``), driven by our round loop.

Flower 1.41's ``SecAggPlusWorkflow`` is written for its legacy strategy workflow: it reads the round from a
``LegacyContext``, asks ``strategy.configure_fit`` whom to train, sends its four stages through the Grid
and hands the unmasked aggregate to ``strategy.aggregate_fit``. Nothing in it needs that strategy to run the
rounds, so one round of our loop runs the unchanged workflow against a one-round context: a strategy that
names the round's nodes and keeps the aggregate it is given
([`_RoundStrategy`][fedmerge.engines.flower.secure._RoundStrategy]), and our own messages
(each client's job and payload) in place of the legacy fit instructions
([`_RoundWorkflow`][fedmerge.engines.flower.secure._RoundWorkflow]). The
cryptography (key agreement, Shamir shares, masks, quantization) is all Flower's.

On the nodes Flower's ``secaggplus_mod`` wraps our ``train``: it runs it, reads the vector our ``train``
put where a legacy fit result holds its parameters (``core/secure_sum.summands``), masks it and empties
every array of the reply. Each vector enters with weight 1 (``max_weight`` 1 for Flower), since our
clients pre-multiply by their own weights; the server gets the mean of the vectors, multiplies it by
their number and recovers each tensor's weighted mean or sum (``core/secure_sum.combine``). The server
never holds a client's vector: what reaches
[`aggregate_fit()`][fedmerge.engines.flower.secure._RoundStrategy.aggregate_fit] is the unmasked sum
and each client's metadata (sample count, losses, the layout of its vector), in the clear.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import FitIns, FitRes, Parameters, Status, parameters_to_ndarrays
from flwr.common.typing import Code
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import SecAggPlusWorkflow, WorkflowState

from fedmerge.core.secure_sum import SumSettings, quantization_range

log = logging.getLogger(__name__)

# fit-result metrics (in the clear) that carry what the server may know of a client's update
META, LAYOUT, STATE_SHAPES = "fedmerge.meta", "fedmerge.layout", "fedmerge.state_shapes"


def count_or_fraction(value: float) -> int | float:
    """Flower reads an int as a count and a float as a fraction of the round (``num_shares``, threshold)."""
    return int(value) if value > 1 and float(value).is_integer() else float(value)


def sum_settings(settings: Any, clients: int) -> SumSettings:
    """The numbers of a round of ``clients`` (``settings``: ``privacy.secure_aggregation``)."""
    return SumSettings(float(settings.max_weight), float(settings.clipping_range), quantization_range(clients))


class _Node(ClientProxy):
    """Only a node id: the workflow maps its replies back to the proxies the strategy named."""

    def __init__(self, node_id: int) -> None:
        super().__init__(str(node_id))
        self.node_id = node_id

    def get_properties(self, ins, timeout, group_id):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    get_parameters = fit = evaluate = reconnect = get_properties


class _RoundStrategy(Strategy):
    """One round of Flower's legacy strategy: the round's nodes, and the aggregate the workflow unmasks."""

    def __init__(self, nodes: list[int]) -> None:
        self.nodes = [_Node(n) for n in nodes]
        self.results: list[tuple[ClientProxy, FitRes]] | None = None

    def configure_fit(self, server_round, parameters, client_manager):  # type: ignore[no-untyped-def]
        return [(node, FitIns(Parameters([], ""), {})) for node in self.nodes]  # replaced by our messages

    def aggregate_fit(self, server_round, results, failures):  # type: ignore[no-untyped-def]
        self.results = list(results)  # each FitRes's parameters: the unmasked aggregate, the same object
        return (results[0][1].parameters if results else None), {}

    def initialize_parameters(self, client_manager):  # type: ignore[no-untyped-def]
        return None

    def configure_evaluate(self, server_round, parameters, client_manager):  # type: ignore[no-untyped-def]
        return []

    def aggregate_evaluate(self, server_round, results, failures):  # type: ignore[no-untyped-def]
        return None, {}

    def evaluate(self, server_round, parameters):  # type: ignore[no-untyped-def]
        return None


class _RoundWorkflow(SecAggPlusWorkflow):
    """Flower's workflow, unchanged but for what its third stage sends: each node's own message content
    (our job and payload) instead of the legacy fit instructions of a strategy."""

    def __init__(self, contents: dict[int, RecordDict], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.contents = contents

    def setup_stage(self, grid, context, state: WorkflowState) -> bool:  # type: ignore[no-untyped-def]
        ok = super().setup_stage(grid, context, state)
        state.nid_to_fitins = dict(self.contents)
        return ok


class _Stage:
    """The Grid as the workflow uses it, with the engine's faster polling; keeps every error reply's reason."""

    def __init__(self, exchange: Any, timeout: float) -> None:
        self.exchange, self.timeout = exchange, timeout
        self.errors: dict[int, str] = {}

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Message]:
        replies = self.exchange(list(messages), self.timeout if timeout is None else timeout)
        for reply in replies:
            if reply.has_error():
                self.errors.setdefault(reply.metadata.src_node_id, reply.error.reason)
        return replies


def run_round(
    exchange: Any, contents: dict[int, RecordDict], rnd: int, settings: Any, timeout: float
) -> tuple[list[np.ndarray] | None, dict[int, dict[str, Any]], dict[int, str]]:
    """One round of SecAgg+ over ``contents`` (node id -> message content). Returns the unmasked sum of the
    vectors (None when the protocol halted), each included node's fit metrics, and the failed nodes' reasons.
    ``exchange(messages, timeout)``: send and wait for the replies."""
    nodes = sorted(contents)
    s = sum_settings(settings, len(nodes))
    strategy = _RoundStrategy(nodes)
    context = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})
    context.state[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: rnd})
    context.state[MAIN_PARAMS_RECORD] = ArrayRecord()
    workflow = _RoundWorkflow(
        contents,
        num_shares=count_or_fraction(settings.num_shares),
        reconstruction_threshold=count_or_fraction(settings.reconstruction_threshold),
        max_weight=1.0,  # each vector enters with weight 1: clients weigh their own (core/secure_sum.py)
        clipping_range=s.clipping_range,
        quantization_range=s.quantization_range,
        modulus_range=2**32,
        timeout=timeout,
    )
    grid = _Stage(exchange, timeout)
    workflow(grid, LegacyContext(context, strategy=strategy))  # type: ignore[arg-type]
    if strategy.results is None:
        return None, {}, grid.errors
    metrics = {proxy.node_id: dict(res.metrics) for proxy, res in strategy.results}
    mean = parameters_to_ndarrays(strategy.results[0][1].parameters)  # Flower divides by the vectors' weights
    total = [np.asarray(a, dtype=np.float64) * len(metrics) for a in mean]
    return total, metrics, grid.errors


def fit_reply(vector: list[np.ndarray], metrics: dict[str, Any]) -> RecordDict:
    """A client's reply in the form Flower's client mod reads: the vector as a fit result's parameters
    (with weight 1), what may be known of the update in its metrics."""
    from flwr.common import ndarrays_to_parameters
    from flwr.compat.common import recorddict_compat as compat

    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(vector), num_examples=1, metrics=metrics)
    return compat.fitres_to_recorddict(res, keep_input=False)


def layout_json(layout: Any) -> str:
    return json.dumps(layout)
