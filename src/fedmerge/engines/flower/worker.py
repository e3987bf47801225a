"""The ClientApp's work: a one-client LocalEngine behind Flower messages.

ClientApps are ephemeral (a new process per message in deployment, shared processes in simulation),
so nothing about a client survives in module globals except a cache of what is rebuilt identically
from the experiment config (data partition, model object, algorithm object). The client's state lives
in ``context.state`` as the ClientState's bytes. Running the update through ``LocalEngine`` gives
the same seeding (torch's global RNG per round, client and purpose) and hence the same numbers.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedmerge.core.algorithm import ALGORITHMS, Algorithm
from fedmerge.core.types import ClientState, Payload
from fedmerge.engines.local import LocalEngine
from fedmerge.engines.workers import set_threads

from .client import partition_id
from .protocol import JOB, METRICS, PAYLOAD, STATE, STATE_KEY, UPDATE
from .records import get_record, has_record, put_record, state_from_config, state_to_config


@dataclass
class _Worker:
    algorithm: Algorithm
    engine: LocalEngine
    num_clients: int


# Rebuilt identically from the experiment config, so safe to share between the virtual clients a
# simulation process serves; the client state never lives here.
_cache: dict[tuple[str, str], _Worker] = {}


def _worker(job: ConfigRecord) -> _Worker:
    key = (str(job["experiment"]), str(job["algorithm_module"]))
    if key not in _cache:
        _cache.clear()  # one experiment at a time per process
        _cache[key] = _build_worker(json.loads(key[0]), key[1])
    return _cache[key]


def _build_worker(experiment: dict, algorithm_module: str) -> _Worker:
    # The experiment layer rebuilds data and model from the config, as the server did (imported
    # here, not at module level: experiment imports engines).
    from fedmerge.experiment.config import experiment_model, validate
    from fedmerge.experiment.runner import load_data, resolve_device
    from fedmerge.models import build_model

    if experiment["algorithm"]["name"] not in ALGORITHMS:
        importlib.import_module(algorithm_module)  # an algorithm registered outside fedmerge.algorithms
        experiment_model.cache_clear()
    cfg = validate(experiment)
    set_threads(cfg.threads)  # as on the server and in the local engine: the same numbers
    device = resolve_device(cfg.device)
    data = load_data(cfg).to(device)

    def model_factory(generator: torch.Generator) -> torch.nn.Module:
        return build_model(cfg.model, data.input_shape, data.num_classes, generator=generator)

    algorithm = ALGORITHMS.get(cfg.algorithm.name).obj(cfg.algorithm, model_factory, len(data.clients), cfg.seed)
    model = model_factory(torch.Generator().manual_seed(0))
    engine = LocalEngine(data.clients, model, device, cfg.seed, eval_batch_size=cfg.eval_batch_size)
    return _Worker(algorithm, engine, len(data.clients))


def _prepare(msg: Message, context: Context) -> tuple[_Worker, int, int, Payload, bool]:
    """Worker, round and payload for this message; loads the client state from ``context.state``."""
    job = msg.content.config_records[JOB]
    cid = partition_id(context)
    if int(job["cid"]) != cid:
        raise ValueError(f"message for client {job['cid']} reached the SuperNode of partition {cid}")
    worker = _worker(job)
    if not 0 <= cid < worker.num_clients:
        raise ValueError(f"partition-id {cid} is outside 0..{worker.num_clients - 1}")
    if has_record(msg.content, STATE):  # the server restores a checkpointed state (resume)
        state: ClientState | None = get_record(msg.content, STATE, ClientState)
        context.state[STATE_KEY] = state_to_config(state)
    elif STATE_KEY in context.state.config_records:
        state = state_from_config(context.state.config_records[STATE_KEY])
    else:
        state = None
    worker.engine.load_client_states({cid: state} if state is not None else {})
    return worker, cid, int(job["round"]), get_record(msg.content, PAYLOAD, Payload), state is None


def _save_state(context: Context, worker: _Worker, cid: int, content: RecordDict) -> None:
    state = worker.engine.client_states()[cid]
    context.state[STATE_KEY] = state_to_config(state)
    put_record(content, STATE, state)  # a copy for the server's checkpoints


def train(msg: Message, context: Context) -> Message:
    worker, cid, rnd, payload, _ = _prepare(msg, context)
    update = worker.engine.fit(worker.algorithm, rnd, {cid: payload})[cid]
    content = RecordDict()
    put_record(content, UPDATE, update)
    _save_state(context, worker, cid, content)
    return Message(content, reply_to=msg)


def evaluate(msg: Message, context: Context) -> Message:
    worker, cid, rnd, payload, fresh = _prepare(msg, context)
    metrics = worker.engine.evaluate(worker.algorithm, rnd, {cid: payload})[cid]
    content = RecordDict({METRICS: MetricRecord({k: float(v) for k, v in metrics.items()})})
    if fresh:  # evaluation never changes a state, but creates it for a client not trained yet
        _save_state(context, worker, cid, content)
    return Message(content, reply_to=msg)
