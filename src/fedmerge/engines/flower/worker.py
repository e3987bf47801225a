"""The ClientApp's work: a one-client LocalEngine behind Flower messages.

ClientApps are ephemeral (a new process per message in deployment, shared processes in simulation),
so nothing about a client survives in module globals except a cache of what is rebuilt identically
from the job (data, model object, algorithm object). Running the update through ``LocalEngine`` gives
the same seeding (torch's global RNG per round, client and purpose) and hence the same numbers.

Where a client's state lives depends on the run's mode (``protocol``):

- deployment: in the node's [`StateStore`][fedmerge.core.state_store.StateStore] on its own disk, one
  version per round that produced it. It never travels. Each message names ``state_round``, the last
  round whose result from this client the server received (its update, or its evaluation), and
  ``keep_round``, the same as of the server's last checkpoint. The node first drops every version
  newer than ``state_round`` (work the server never aggregated, or lost in a crash it resumed from),
  keeps the newest version up to ``keep_round`` and those after it, and then uses the newest it has.
- simulation: in ``context.state`` as the ClientState's bytes, with a copy in each reply for the
  server's checkpoints, so resume is exact as with the local engine.

A client that never trained (an onboarding message) has no state and keeps none; deployed, it saves the model
it builds in its own state-dir (``newcomer.py``) and replies with its metrics and that file's path.
"""

from __future__ import annotations

import hashlib
import json
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedmerge.algorithms.privacy import build_algorithm
from fedmerge.algorithms.privacy_settings import PrivacySettings
from fedmerge.core.algorithm import Algorithm, adapt_epochs
from fedmerge.core.types import ClientState, Payload
from fedmerge.engines.device import resolve_device
from fedmerge.engines.local import LocalEngine
from fedmerge.engines.memory import keep_freed_memory
from fedmerge.engines.workers import set_threads

from .job import build_data, load_job_plugins, parse_sections
from .node import NodeSettings, NodeStateError, node_data, node_meta, node_settings
from .protocol import DEPLOYMENT, JOB, METRICS, PAYLOAD, SIMULATION, STATE, STATE_KEY, UPDATE, partition_id
from .records import get_record, has_record, put_record, state_from_config, state_to_config


@dataclass
class _Worker:
    algorithm: Algorithm
    engine: LocalEngine
    num_clients: int  # the participants (the algorithm's clients)
    unseen: int = 0  # then the clients that never train (split.unseen_clients), ids num_clients..


# Rebuilt identically from the job, so safe to share between the virtual clients a simulation
# process serves; the client state never lives here.
_cache: dict[tuple[str, ...], _Worker] = {}


def _build_worker(job: dict[str, Any], algorithm_module: str, clients: Any, input_shape, num_classes) -> _Worker:
    algo_cfg, model_cfg = parse_sections(job, algorithm_module)
    from fedmerge.models import build_model

    set_threads(job["threads"])  # as on the server and in the local engine: the same numbers
    if job.get("keep_freed_memory", True):  # a simulation's ClientApp process serves many clients
        keep_freed_memory()
    device = resolve_device(job["device"])
    seed, num_clients = int(job["seed"]), int(job["num_clients"])

    def model_factory(generator: torch.Generator) -> torch.nn.Module:
        return build_model(model_cfg, input_shape, num_classes, generator=generator)

    privacy = PrivacySettings.model_validate(job["privacy"]) if job.get("privacy") is not None else None
    rounds, participation = int(job.get("rounds", 1)), float(job.get("participation", 1.0))
    algorithm = build_algorithm(
        algo_cfg, model_factory, num_clients, seed, privacy, rounds=rounds, participation=participation
    )
    model = model_factory(torch.Generator().manual_seed(0))
    engine = LocalEngine(clients, model, device, seed, eval_batch_size=int(job["eval_batch_size"]))
    return _Worker(algorithm, engine, num_clients, int(job.get("unseen_clients", 0)))


def _worker(job: ConfigRecord, settings: NodeSettings | None) -> _Worker:
    where = str(settings.data_path) if settings is not None else ""
    key = (str(job["experiment"]), str(job["algorithm_module"]), where)
    if key not in _cache:
        _cache.clear()  # one experiment at a time per process
        spec = json.loads(key[0])
        load_job_plugins(spec)  # before the data (a plugin's dataset) and the sections are read
        device = resolve_device(spec["device"])
        if settings is not None:  # deployment: this node's own data and nothing else
            client, meta = node_data(settings, spec.get("split"), int(spec["seed"]))
            clients: Any = {meta.client_id: client.to(device)}
            _cache[key] = _build_worker(spec, key[1], clients, meta.input_shape, meta.num_classes)
        else:
            data = build_data(spec["data"]).to(device)
            _cache[key] = _build_worker(spec, key[1], data.clients, data.input_shape, data.num_classes)
    return _cache[key]


@dataclass
class _Call:
    worker: _Worker
    cid: int
    rnd: int
    payload: Payload
    fresh: bool  # no state existed: the engine creates one
    store: Any  # deployment: the open StateStore
    newcomer: NodeSettings | None = None  # a deployed client that never trained: where it saves its model
    keep_state: bool = False  # a secure simulation: no state in any reply


def _state_digest(state: ClientState) -> str:
    return hashlib.sha256(state.to_bytes()).hexdigest()[:16]


def state_shapes(state: ClientState) -> str:
    """``{key: [dtype, shape]}`` of a state's tensors, as JSON: what the server may know of a node's state."""
    shapes = {k: [str(t.dtype).removeprefix("torch."), list(t.shape)] for k, t in sorted(state.tensors.items())}
    return json.dumps(shapes)


def _note(cid: int, rnd: int, phase: str, from_round: int | None, state: ClientState | None) -> None:
    """One line on the node's console: which saved state this message continues from."""
    where = f"state of round {from_round} (sha256 {_state_digest(state)})" if state is not None else "a fresh state"
    print(f"fedmerge node: client {cid}, round {rnd} {phase}: starts from {where}", file=sys.stderr, flush=True)


def _prepare(msg: Message, context: Context, phase: str, store_scope: Any) -> _Call:
    job = msg.content.config_records[JOB]
    rnd = int(job["round"])
    payload = get_record(msg.content, PAYLOAD, Payload)
    if bool(job.get("onboard", False)):  # a client that never trained: no state is read, made or kept
        if str(job.get("mode", SIMULATION)) == DEPLOYMENT:  # its own data; it keeps its model (newcomer.py)
            settings = node_settings(dict(context.node_config))
            cid = node_meta(settings).client_id
            if int(job["cid"]) != cid:
                raise ValueError(f"onboarding message for client {job['cid']} reached the SuperNode of client {cid}")
            worker = _worker(job, settings)
            if cid < worker.num_clients:
                raise ValueError(
                    f"client {cid} took part in training (clients 0..{worker.num_clients - 1}); onboarding is for "
                    "clients that never trained"
                )
            return _Call(worker, cid, rnd, payload, False, None, settings)
        cid = partition_id(dict(context.node_config))
        worker = _worker(job, None)
        if not worker.num_clients <= cid < worker.num_clients + worker.unseen:
            raise ValueError(f"onboarding message for client {cid}, which is not a client that never trained")
        return _Call(worker, cid, rnd, payload, False, None)
    if str(job.get("mode", SIMULATION)) == DEPLOYMENT:
        settings = node_settings(dict(context.node_config))
        cid = node_meta(settings).client_id
        if int(job["cid"]) != cid:
            raise ValueError(f"message for client {job['cid']} reached the SuperNode of client {cid}")
        worker = _worker(job, settings)
        from fedmerge.core.state_store import StateStore

        state_round = int(job["state_round"])
        # one store per run: another run's states (or an earlier config's) are never read
        store = store_scope.enter_context(StateStore(settings.run_store(cid, str(job["run_key"]), state_round)))
        store.rewind(state_round)  # versions the server never aggregated (or lost in a crash)
        store.prune(min(int(job["keep_round"]), state_round))
        state = store.get(cid)
        if state is None and state_round > 0:
            raise NodeStateError(
                f"client {cid}'s state store {store.path} has no state up to round {state_round}, which the "
                "server has results of: was it emptied or copied from elsewhere?"
            )
        _note(cid, rnd, phase, store.round_of(cid), state)
    else:
        cid = partition_id(dict(context.node_config))
        if int(job["cid"]) != cid:
            raise ValueError(f"message for client {job['cid']} reached the SuperNode of partition {cid}")
        worker = _worker(job, None)
        store = None
        if has_record(msg.content, STATE):  # the server restores a checkpointed state (resume)
            state = get_record(msg.content, STATE, ClientState)
            context.state[STATE_KEY] = state_to_config(state)
        elif STATE_KEY in context.state.config_records:
            state = state_from_config(context.state.config_records[STATE_KEY])
        else:
            state = None
    if not 0 <= cid < worker.num_clients:
        raise ValueError(f"partition-id {cid} is outside 0..{worker.num_clients - 1} (the clients that train)")
    worker.engine.load_client_states({cid: state} if state is not None else {})
    return _Call(worker, cid, rnd, payload, state is None, store, keep_state=bool(job.get("keep_state", False)))


def _save_state(call: _Call, context: Context, content: RecordDict) -> None:
    state = call.worker.engine.client_states()[call.cid]
    if call.store is not None:  # deployment: on this node's disk only, tagged with its round
        call.store.put(call.cid, state, call.rnd)
        call.store.flush()
        content[JOB] = ConfigRecord({"state_shapes": state_shapes(state)})  # the summary's sizes, no value
        return
    context.state[STATE_KEY] = state_to_config(state)
    if call.keep_state:  # a secure simulation: the server learns the state's shapes, as of a deployed node
        content[JOB] = ConfigRecord({"state_shapes": state_shapes(state)})
        return
    put_record(content, STATE, state)  # simulation: a copy for the server's checkpoints


def _secure_reply(call: _Call, context: Context, update: Any, settings: str) -> RecordDict:
    """``privacy.secure_aggregation``: the update as its vector for the secure sum, which Flower's client mod
    masks (and then empties every array of this reply); only the update's metadata stays readable."""
    from fedmerge.core.secure_sum import SumSettings, layout_of, summands

    from .secure import LAYOUT, META, STATE_SHAPES, fit_reply

    alg = call.worker.algorithm
    weight = alg.secure_weight(update.meta)
    vector = summands(update, call.payload.tensors, weight, alg.secure_summed, SumSettings.from_json(settings))
    metrics: dict[str, Any] = {META: json.dumps(update.meta, sort_keys=True), LAYOUT: json.dumps(layout_of(update))}
    state = call.worker.engine.client_states()[call.cid]
    if call.store is not None:  # deployment: on this node's disk only
        call.store.put(call.cid, state, call.rnd)
        call.store.flush()
        metrics[STATE_SHAPES] = state_shapes(state)
    else:  # simulation: the state stays in the node's context; the server learns its shapes only
        context.state[STATE_KEY] = state_to_config(state)
        metrics[STATE_SHAPES] = state_shapes(state)
    return fit_reply(vector, metrics)


def train(msg: Message, context: Context) -> Message:
    with ExitStack() as scope:
        call = _prepare(msg, context, "train", scope)
        update = call.worker.engine.fit(call.worker.algorithm, call.rnd, {call.cid: call.payload})[call.cid]
        secure = msg.content.config_records[JOB].get("secure_aggregation")
        if secure:
            return Message(_secure_reply(call, context, update, str(secure)), reply_to=msg)
        content = RecordDict()
        put_record(content, UPDATE, update)
        _save_state(call, context, content)
    return Message(content, reply_to=msg)


def _onboard_deployed(call: _Call, run_key: str) -> RecordDict:
    """A deployed newcomer: its model by the method's rule, saved in its own state-dir; the reply holds its
    metrics and the file's path, never a weight."""
    from .newcomer import NOT_SAVED, SAVED, save_onboarded

    assert call.newcomer is not None
    alg = call.worker.algorithm
    metrics, models = call.worker.engine.onboard_client(alg, call.rnd, call.cid, call.payload, keep=True)
    meta = {"algorithm": str(getattr(alg, "name", type(alg).__name__)), "adapt_epochs": adapt_epochs(call.payload)}
    path, predictors = save_onboarded(call.newcomer, call.cid, run_key, call.rnd, models, meta)
    print(f"fedmerge node: client {call.cid} onboarded from round {call.rnd}; model in {path}", file=sys.stderr)
    return RecordDict(
        {
            METRICS: MetricRecord({k: float(v) for k, v in metrics.items()}),
            JOB: ConfigRecord({SAVED: str(path), NOT_SAVED: json.dumps(predictors)}),
        }
    )


def evaluate(msg: Message, context: Context) -> Message:
    with ExitStack() as scope:
        call = _prepare(msg, context, "evaluate", scope)
        job = msg.content.config_records[JOB]
        if call.newcomer is not None:
            return Message(_onboard_deployed(call, str(job["run_key"])), reply_to=msg)
        onboard = bool(job.get("onboard", False))
        engine, payloads = call.worker.engine, {call.cid: call.payload}
        metrics = engine.evaluate(call.worker.algorithm, call.rnd, payloads, newcomers=onboard)[call.cid]
        content = RecordDict({METRICS: MetricRecord({k: float(v) for k, v in metrics.items()})})
        if call.fresh:  # evaluation never changes a state, but creates it for a client not trained yet
            _save_state(call, context, content)
    return Message(content, reply_to=msg)


__all__ = ["evaluate", "train"]
