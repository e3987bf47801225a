"""Run an experiment end to end: data, model, algorithm, engine, round loop, results folder."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel
from torch.nn.modules.batchnorm import _BatchNorm

from fedmerge.algorithms import Algorithm
from fedmerge.algorithms.privacy import build_algorithm, privacy_problem
from fedmerge.core.checkpoint import (
    CLIENT_STORE,
    LATEST,
    Checkpoint,
    CheckpointError,
    load_checkpoint,
    newest_checkpoint_file,
    parse_checkpoint,
    save_checkpoint,
)
from fedmerge.core.loop import Engine, Schedule, parse_eval_clients, run_rounds
from fedmerge.core.state_store import StateStore, StoredStates
from fedmerge.core.types import ServerState
from fedmerge.data import DataUnavailable, FederatedDataset, build_federated_dataset
from fedmerge.engines.device import DeviceUnavailable
from fedmerge.engines.device import resolve_device as engine_device
from fedmerge.engines.local import LocalEngine
from fedmerge.engines.memory import keep_freed_memory
from fedmerge.engines.vectorized import vectorize_problem
from fedmerge.engines.workers import set_threads, workers_problem
from fedmerge.models import build_model, count_parameters

from .config import ConfigError, FlowerSettings, config_warnings, defaults_left_out, load_config, to_yaml
from .progress import RoundProgress
from .provenance import record_segment
from .results import CHECKPOINT_DIR, CONFIG_FILE, RunStore, new_run_dir
from .summary import TIMING_KEYS, build_summary, summarize_eval, summary_markdown
from .tensorboard_log import ScalarLog, require_tensorboard
from .tuned import load_tuned_config

RESUME_OVERRIDABLE = {"rounds", "device", "eval_batch_size", "workers", "state.cache_size", "keep_freed_memory"}


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]
    server_state: ServerState


def resolve_device(name: str) -> torch.device:
    try:
        return engine_device(name)
    except DeviceUnavailable as exc:
        raise ConfigError(str(exc)) from None


def load_data(cfg: BaseModel) -> FederatedDataset:
    try:
        return build_federated_dataset(cfg.dataset, cfg.partition, cfg.split, cfg.noise, cfg.seed)
    except DataUnavailable:
        raise
    except ValueError as exc:  # impossible values only known once the data is loaded
        raise ConfigError(str(exc).splitlines()[0]) from None


def describe_inputs(x: torch.Tensor) -> str:
    shape = tuple(x.shape[1:])
    kind = "token ids" if not x.is_floating_point() else "images" if len(shape) == 3 else "features"
    return f"{kind} of shape {shape}, {str(x.dtype).removeprefix('torch.')}"


def check_compatibility(
    cfg: BaseModel, sample: torch.Tensor, num_classes: int, device: torch.device
) -> torch.nn.Module:
    """Build the model for inputs like ``sample`` (a batch) and run it on them, so that a model that
    cannot read the dataset's inputs (e.g. ``mlp`` on token ids) is refused in one line before
    anything is written. Returns the model (the engine's reusable instance)."""
    where = f"model {cfg.model.name!r} does not fit dataset {cfg.dataset.name!r} ({describe_inputs(sample)})"
    hint = "; token data needs model.name=minilm_lora or lstm" if not sample.is_floating_point() else ""
    try:
        model = build_model(cfg.model, tuple(sample.shape[1:]), num_classes, torch.Generator().manual_seed(0))
        model = model.to(device)
    except (ValueError, TypeError, RuntimeError) as exc:  # includes a missing optional dependency (LoRA)
        raise ConfigError(f"{where}: {_first_line(exc)}{hint}") from None
    was_training = model.training
    try:
        # eval mode + forked RNG: the probe changes no weight, buffer or random stream of the run
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            model.eval()
            logits = model(sample.to(device))
    except (ValueError, TypeError, RuntimeError, IndexError) as exc:
        raise ConfigError(f"{where}: {_first_line(exc)}{hint}") from None
    finally:
        model.train(was_training)
    if tuple(logits.shape) != (len(sample), num_classes):
        raise ConfigError(f"{where}: it returns shape {tuple(logits.shape)}, expected (N, {num_classes})")
    if getattr(cfg.algorithm, "batch_size", None) == 1 and any(isinstance(m, _BatchNorm) for m in model.modules()):
        raise ConfigError(
            f"algorithm.batch_size: 1 cannot train model {cfg.model.name!r}: its BatchNorm layers need 2 or more "
            "samples per batch"
        )
    return model


def _latest_names(folder: Path, file: str) -> bool:
    """Whether ``latest.json`` (when readable) points at ``file``: then its checksum can be verified."""
    try:
        return json.loads((folder / LATEST).read_text()).get("file") == Path(file).name
    except (OSError, ValueError, AttributeError):
        return False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def config_digest(cfg: BaseModel) -> str:
    # Engine tuning (``flower``: timeouts, retries) and extra outputs (``log``) do not change the
    # numbers a run produces.
    # Nor does where client states live (``state``): a checkpoint records that itself (``client_store``).
    fixed = cfg.model_dump(
        mode="json", exclude=RESUME_OVERRIDABLE | {"flower", "log", "state"} | defaults_left_out(cfg)
    )
    return hashlib.sha256(repr(sorted(fixed.items())).encode()).hexdigest()


def run_experiment(
    cfg: BaseModel,
    run_dir: str | Path | None = None,
    *,
    resume: bool = False,
    show_progress: bool = True,
    stop_after: int | None = None,
    grid: Any = None,
    deployment: bool = False,
    pooled_test: str | None = None,
    checkpoint: str | None = None,
    notify: Notify | None = None,
    withhold_test: bool = False,
    data: FederatedDataset | None = None,
) -> RunResult:
    """Run (or resume) ``cfg``. ``stop_after`` ends after that round, as a crash would (tests).

    ``withhold_test``: the test split is removed before training starts, so nothing (no metric, no
    summary, no model selection) can read it: ``fedmerge tune``'s trials.

    ``grid``: a Flower Grid, when called by a ServerApp (``engine: flower``); with ``deployment`` the
    nodes own their data and their states (docs/deployment.md): the server loads no dataset, and
    tests a global model only on ``pooled_test``, a file ``fedmerge export-clients --pooled-test`` wrote.
    ``checkpoint``: resume from this file of ``RUN_DIR/checkpoints`` instead of the one ``latest.json``
    names. ``notify``: receives one-line notices (warnings, "resuming from round N of M").
    ``data``: a dataset already built (benchmarks), used instead of loading ``cfg``'s.
    """
    notify = notify or (lambda message: None)
    if cfg.engine == "flower":
        _require_flower(simulation=grid is None)
    if deployment and grid is None:
        raise ValueError("deployment=True needs the Grid of a ServerApp")
    if pooled_test is not None and not deployment:
        raise ConfigError("pooled-test applies to a deployment; a simulation tests on its own data")
    if cfg.state is not None and (cfg.engine != "local" or grid is not None):
        raise ConfigError("state (client states on disk) applies to engine=local; remove it for engine=flower")
    for warning in config_warnings(cfg):
        notify(f"warning: {warning}")
    ckpt = None
    if resume:
        if run_dir is None:
            raise ValueError("resume=True needs the run folder")
        ckpt = resume_checkpoint(Path(run_dir), cfg, checkpoint)
    if cfg.log is not None and cfg.log.tensorboard:
        require_tensorboard()
    device = resolve_device(cfg.device)
    if (problem := workers_problem(cfg.workers, cfg.threads, device, cfg.engine)) is not None:
        raise ConfigError(problem)
    set_threads(cfg.threads)
    if cfg.keep_freed_memory:
        keep_freed_memory()  # forked workers inherit it
    # Everything that can be refused is checked before the run folder exists.
    federation = None
    if deployment:
        # The server holds no data: the nodes' handshake says the input shape and the classes.
        federation = _connect(cfg, grid)
        first = federation.first
        sample = torch.zeros(2, *first.input_shape, dtype=getattr(torch, first.input_dtype))
        data, num_classes, input_shape = None, first.num_classes, first.input_shape
        num_clients, groups = federation.num_clients, federation.groups
        server_test = _server_test(pooled_test, federation, device) if pooled_test is not None else None
    else:
        # token datasets declare their input shape, so a model that cannot read tokens is refused
        # before the (slow) tokenization
        tokens = cfg.dataset.token_length()
        if tokens is not None:
            check_compatibility(cfg, torch.ones(2, tokens, dtype=torch.int64), 2, device)
        data = (load_data(cfg) if data is None else data).to(device)
        if withhold_test:
            data = without_test(data)
        sample = next(c.x_train[:2] for c in data.clients if c.n_train)
        num_classes, input_shape = data.num_classes, data.input_shape
        num_clients, groups = len(data.clients), data.groups()
    model = check_compatibility(cfg, sample, num_classes, device)

    def model_factory(generator: torch.Generator) -> torch.nn.Module:
        return build_model(cfg.model, input_shape, num_classes, generator=generator)

    privacy = getattr(cfg, "privacy", None)
    if privacy is not None:
        problem = privacy_problem(cfg.algorithm.name, privacy, model, sample.to(device))
        if problem is None and cfg.vectorize:
            problem = "vectorize: not with privacy (DP-SGD's per-sample step and the private aggregate run per client)"
        if problem is not None:
            raise ConfigError(problem)
    try:
        algorithm = build_algorithm(
            cfg.algorithm, model_factory, num_clients, cfg.seed, privacy,
            rounds=cfg.rounds, participation=cfg.participation,
        )  # fmt: skip
    except ValueError as exc:  # settings that conflict with the model or the data (e.g. fedlora without LoRA)
        raise ConfigError(f"algorithm {cfg.algorithm.name!r}: {str(exc).splitlines()[0]}") from None
    if privacy is not None:  # e.g. a target epsilon that no noise achieves
        sizes = [int(c.y_train.shape[0]) for c in data.clients] if data is not None else []
        problem = algorithm.noise_problem(sizes)
        if problem is not None:
            raise ConfigError(problem)
    if cfg.vectorize:
        problem = vectorize_problem(algorithm, model)
        if problem is None and (cfg.engine != "local" or cfg.workers != 1):
            problem = "vectorize: batched clients are an option of engine=local with workers=1"
        if problem is not None:
            raise ConfigError(problem)
    store = RunStore(run_dir if run_dir is not None else new_run_dir(cfg.output_dir, cfg.name))
    if federation is not None:
        (store.dir / "federation.json").write_text(json.dumps(federation_summary(federation), indent=1) + "\n")
        federation.pooled_test = server_test
    with (
        _client_store(cfg, store) as states,
        _open_engine(cfg, data, model, device, grid, states, federation) as engine,
    ):
        segment = _Segment(resume, ckpt, show_progress, stop_after, notify)
        return _run(cfg, store, algorithm, model, engine, device, groups, segment, states)


Notify = Callable[[str], None]


def without_test(data: FederatedDataset) -> FederatedDataset:
    """The same clients with empty test splits (evaluation skips an empty split)."""
    empty = [replace(c, x_test=c.x_test[:0], y_test=c.y_test[:0]) for c in data.clients]
    return replace(data, clients=empty)


@dataclass
class _Segment:
    """How this process's part of a run starts and ends."""

    resume: bool
    checkpoint: Checkpoint | None
    show_progress: bool
    stop_after: int | None
    notify: Notify


def resume_checkpoint(run_dir: Path, cfg: BaseModel, file: str | None = None) -> Checkpoint | None:
    """The checkpoint to continue from: ``file`` if given, else the one ``latest.json`` names
    (checksum verified). None when the run stopped before its first checkpoint. A folder whose
    ``latest.json`` is gone while round files remain is refused: restarting would discard them."""
    folder = run_dir / CHECKPOINT_DIR
    with_clients = getattr(cfg, "state", None) is None  # a store's states are read as clients need them
    if file is not None and not _latest_names(folder, file):
        ckpt = parse_checkpoint(Path(file) if Path(file).is_file() else folder / Path(file).name, None, with_clients)
    elif (folder / LATEST).exists():
        ckpt = load_checkpoint(folder, with_clients)  # checksum verified
    else:
        newest = newest_checkpoint_file(folder)
        if newest is None:
            return None
        raise CheckpointError(
            f"{folder / LATEST} is missing but checkpoints remain (newest: {newest.name}); to continue from it: "
            f"fedmerge run --resume {run_dir} --checkpoint {newest.name}"
        )
    if ckpt.meta.get("config_digest") != config_digest(cfg) or (ckpt.client_store is None) != with_clients:
        raise ConfigError(f"{run_dir}: config.yaml no longer matches the checkpoint; refusing to resume")
    return ckpt


def _run(
    cfg: BaseModel,
    store: RunStore,
    algorithm: Algorithm,
    model: torch.nn.Module,
    engine: Engine,
    device: torch.device,
    groups: list[int | None],
    segment: _Segment,
    client_store: StateStore | None = None,
) -> RunResult:
    num_clients = len(groups)
    schedule = Schedule(cfg.rounds, num_clients, cfg.participation, cfg.eval_every, cfg.seed, cfg.eval_clients)

    start_round = 0
    earlier_seconds = 0.0  # wall time of the earlier segments of a resumed run
    ckpt = segment.checkpoint
    if segment.resume:
        # elapsed_seconds is cumulative, so the last row written (kept or about to be replayed) holds
        # the time every earlier segment ran
        earlier_seconds = max((r.get("elapsed_seconds", 0.0) for r in store.read_metrics()), default=0.0)
        if ckpt is not None:
            state = ckpt.server_state.to(device)
            if hasattr(engine, "restore"):  # deployment: the rounds of the states the nodes keep
                engine.restore(ckpt.meta)
            start_round = ckpt.round
            if client_store is None:
                engine.load_client_states(ckpt.client_states)
        else:
            state = algorithm.init_server_state().to(device)
        if client_store is not None:  # states of rounds after the checkpoint are redone
            client_store.rewind(start_round)
        store.truncate_metrics(start_round)
        segment.notify(f"resuming from round {start_round} of {cfg.rounds}")
    else:
        store.write_config(to_yaml(cfg))
        state = algorithm.init_server_state().to(device)

    record_segment(store.dir, start_round, segment.resume)
    digest = config_digest(cfg)
    t_start = time.perf_counter() - earlier_seconds

    def checkpoint(rnd: int, server_state: ServerState) -> None:
        save_checkpoint(
            store.checkpoint_dir,
            rnd,
            server_state,
            engine.client_states() if client_store is None else client_store,
            {"config_digest": digest, **_engine_meta(engine, cfg.keep_checkpoints)},
            keep=cfg.keep_checkpoints,
        )

    show_progress, stop_after = segment.show_progress, segment.stop_after
    tensorboard = ScalarLog(store.dir, start_round) if cfg.log is not None and cfg.log.tensorboard else None
    with (
        RoundProgress(cfg.rounds, start_round, len(schedule.sample(1)), enabled=show_progress) as progress,
        tensorboard or nullcontext(),
    ):
        engine.on_client_done = progress.client_done

        def on_round_end(rnd: int, server_state: ServerState, record: dict[str, Any]) -> None:
            # clients dropped from this round: by the engine (Flower: no reply) or by the round loop
            # (an update that is not finite or not shaped like the others); absent when none
            failures = engine.pop_failures() if hasattr(engine, "pop_failures") else []
            failures += record.pop("failed_clients", [])
            if failures:
                record["failed_clients"] = failures
            if "eval" in record:
                record["summary"] = summarize_eval(record["eval"]["clients"])
            record["elapsed_seconds"] = time.perf_counter() - t_start
            store.append_metrics(record)
            if tensorboard is not None:
                tensorboard.round(rnd, record)
            if rnd % cfg.checkpoint_every == 0 or rnd == cfg.rounds:
                checkpoint(rnd, server_state)
            progress.round_done(rnd, _progress_text(record))
            if stop_after is not None and rnd >= stop_after:
                raise _Stop

        try:
            state = run_rounds(algorithm, engine, schedule, state, start_round, on_round_end)
        except _Stop:
            return RunResult(store.dir, {}, state)

    rows = store.read_metrics()
    info = {
        "name": cfg.name,
        "algorithm": cfg.algorithm.name,
        "dataset": cfg.dataset.name,
        "partition": cfg.partition.name,
        "model": cfg.model.name,
        "num_clients": num_clients,
        "seed": cfg.seed,
        "parameters": _parameter_counts(algorithm, model, state, engine),
        # ground-truth groups (cluster/domain partitions): the summary scores cluster recovery
        "client_groups": groups if all(g is not None for g in groups) else None,
        "wall_seconds": time.perf_counter() - t_start,
    }
    if hasattr(algorithm, "privacy_summary"):  # privacy: the guarantees spent (per client for DP-SGD)
        info["privacy"] = algorithm.privacy_summary(state)
    summary = build_summary(rows, info)
    store.write_summary(summary, summary_markdown(summary))
    return RunResult(store.dir, summary, state)


def _engine_meta(engine: Engine, keep: int) -> dict[str, Any]:
    """What the engine needs a checkpoint to hold (a deployed Flower server: its nodes' state rounds)."""
    return engine.checkpoint_meta(keep) if hasattr(engine, "checkpoint_meta") else {}


class _Stop(Exception):
    pass


def _require_flower(simulation: bool) -> None:
    from fedmerge.engines.flower import INSTALL_HINT, flower_available

    if not flower_available(simulation=simulation):
        raise ConfigError(INSTALL_HINT)


def _flower_options(cfg: BaseModel) -> Any:
    from fedmerge.engines.flower.engine import FlowerOptions

    fs = cfg.flower or FlowerSettings()
    return FlowerOptions(fs.min_replies, fs.max_retries, fs.round_timeout, fs.connect_timeout)


def _connect(cfg: BaseModel, grid: Any) -> Any:
    """Deployment: the handshake with the SuperNodes (their files must agree), as a one-line error."""
    from fedmerge.engines.flower.engine import connect
    from fedmerge.engines.flower.protocol import DEPLOYMENT

    return connect(grid, _flower_options(cfg), DEPLOYMENT)


def _server_test(path: str, federation: Any, device: torch.device) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """The deployed server's optional pooled test set, which must match the nodes' files (one line)."""
    from fedmerge.data.client_files import check_consistent, load_pooled_test

    x, y, meta = load_pooled_test(path)
    check_consistent([federation.first, meta])
    x, y = x.to(device), y.to(device)
    return lambda: (x, y)


def federation_summary(federation: Any) -> dict[str, Any]:
    """What the nodes said about their data (written to RUN_DIR/federation.json): no sample."""
    first = federation.first
    return {
        "num_clients": federation.num_clients,
        "dataset": first.dataset,
        "num_classes": first.num_classes,
        "class_names": first.class_names,
        "input_shape": list(first.input_shape),
        "input_dtype": first.input_dtype,
        "source_digest": first.source_digest,
        "groups": federation.groups,
    }


def _pooled_test(cfg: BaseModel, data: FederatedDataset) -> Callable[[], tuple[torch.Tensor, torch.Tensor]] | None:
    """The global model's test set: every client's test split, or with ``eval_clients: sample:K`` those
    of the K evaluated clients (the same every round), so that no evaluation grows with the population."""
    has_test = data.clients.has_test() if hasattr(data.clients, "has_test") else any(c.n_test for c in data.clients)
    if not has_test:  # no test split (withheld while tuning): no global-model test either
        return None
    if parse_eval_clients(cfg.eval_clients)[0] != "sample":
        return data.pooled_test
    sample = Schedule(cfg.rounds, len(data.clients), seed=cfg.seed, eval_clients=cfg.eval_clients).evaluated(0, [])
    return partial(data.pooled_test, sample)


@contextmanager
def _client_store(cfg: BaseModel, run: RunStore) -> Iterator[StateStore | None]:
    """The run's on-disk client-state store (``state:`` set), closed when the run ends; else None."""
    if cfg.state is None:
        yield None
        return
    # durable=False: each checkpoint fsyncs the store (a killed process loses no committed put anyway)
    with StateStore(run.checkpoint_dir / CLIENT_STORE, cfg.state.cache_size, durable=False) as store:
        yield store


@contextmanager
def _open_engine(
    cfg: BaseModel,
    data: FederatedDataset | None,
    model: torch.nn.Module,
    device: torch.device,
    grid: Any,
    client_store: StateStore | None = None,
    federation: Any = None,
) -> Iterator[Engine]:
    # a deployed server has no data: only the pooled test file its operator gave, if any
    pooled_test = _pooled_test(cfg, data) if data is not None else getattr(federation, "pooled_test", None)
    if cfg.engine != "flower" and grid is None:
        with LocalEngine(
            data.clients,
            model,
            device,
            cfg.seed,
            pooled_test=pooled_test,
            eval_batch_size=cfg.eval_batch_size,
            workers=cfg.workers,
            states=None if client_store is None else StoredStates(client_store, device),
            vectorize=cfg.vectorize,
        ) as engine:
            yield engine
        return
    from fedmerge.engines.flower.engine import FlowerEngine, connect
    from fedmerge.engines.flower.job import client_job
    from fedmerge.engines.flower.protocol import DEPLOYMENT, SIMULATION
    from fedmerge.engines.flower.simulation import SimulationOptions, simulation

    fs = cfg.flower or FlowerSettings()
    options = _flower_options(cfg)
    mode = DEPLOYMENT if federation is not None else SIMULATION
    num_clients = federation.num_clients if federation is not None else len(data.clients)
    # deployment: the job names no data; each node reads its own file
    job = client_job(cfg.model_dump(mode="json"), num_clients, with_data=mode == SIMULATION)

    def engine_on(target: Any) -> FlowerEngine:
        fed = federation if federation is not None else connect(target, options, SIMULATION, num_clients)
        return FlowerEngine(
            target, fed, job, model, device, cfg.seed, options, pooled_test, cfg.eval_batch_size, mode=mode
        )

    if grid is not None:  # a ServerApp was handed a Grid by the SuperLink (or a test's fake one)
        yield engine_on(grid)
        return
    with simulation(num_clients, SimulationOptions(fs.num_cpus, fs.client_cpus, fs.client_gpus)) as relay:
        yield engine_on(relay)


def _parameter_counts(
    algorithm: Algorithm, model: torch.nn.Module, state: ServerState, engine: Engine
) -> dict[str, float]:
    held = engine.client_states()
    if isinstance(held, StoredStates):  # counted from the records' headers; a few decoded states suffice
        sizes = list(held.store.parameter_counts().values())
        states = [held[cid] for cid in held.store.ids()[:8]]
    else:
        states = list(held.values())
        sizes = [s.num_parameters() for s in states]
    model_params = count_parameters(model)
    return {
        "model": float(model_params),
        "server_state": float(state.num_parameters()),
        "client_state_mean": float(sum(sizes) / max(len(sizes), 1)),
        "client_optimized": algorithm.client_optimized_parameters(model_params, states),
        # models with a frozen backbone (LoRA) count only what trains and travels above; this is all
        "model_full": float(getattr(model, "full_parameter_count", lambda: model_params)()),
    }


def _progress_text(record: dict[str, Any]) -> str:
    parts = [f"loss {record['train_loss']:.3f}"]
    s = record.get("summary", {})
    if "test_acc" in s:
        parts.append(f"acc {s['test_acc']['mean']:.3f}")
    if "val_nll" in s:
        parts.append(f"val_nll {s['val_nll']['mean']:.3f}")
    return "  ".join(parts)


def run_from_files(
    config_path: str | None,
    overrides: list[str],
    *,
    resume_dir: str | None = None,
    checkpoint: str | None = None,
    show_progress: bool = True,
    grid: Any = None,
    deployment: bool = False,
    pooled_test: str | None = None,
    notify: Notify | None = None,
    run_dir: str | None = None,
    tuned: str | None = None,
) -> RunResult:
    """``run_dir``: create the run in exactly this folder (``fedmerge sweep``); ``tuned``: a
    ``fedmerge tune`` file whose values for the config's algorithm apply under ``overrides``."""
    if checkpoint is not None and resume_dir is None:
        raise ConfigError("--checkpoint only applies with --resume RUN_DIR")
    if resume_dir is not None and (run_dir is not None or tuned is not None):
        raise ConfigError(f"{'--run-dir' if run_dir is not None else '--tuned'} does not apply with --resume")
    if resume_dir is not None:
        if not (Path(resume_dir) / CONFIG_FILE).is_file():
            raise ConfigError(f"--resume {resume_dir}: no {CONFIG_FILE} there; is it a run folder?")
        store = RunStore(resume_dir)
        bad = [o for o in overrides if o.partition("=")[0] not in RESUME_OVERRIDABLE]
        if bad or config_path is not None:
            raise ConfigError(
                f"cannot change {bad[0].partition('=')[0] if bad else 'the config file'} when resuming; "
                f"only {sorted(RESUME_OVERRIDABLE)} may be overridden"
            )
        cfg = load_config(store.read_config_path(), overrides)
        return run_experiment(
            cfg,
            store.dir,
            resume=True,
            show_progress=show_progress,
            grid=grid,
            deployment=deployment,
            pooled_test=pooled_test,
            checkpoint=checkpoint,
            notify=notify,
        )
    cfg = load_tuned_config(config_path, overrides, tuned) if tuned else load_config(config_path, overrides)
    if run_dir is not None and (Path(run_dir) / CONFIG_FILE).exists():
        raise ConfigError(f"--run-dir {run_dir} already holds a run; to continue it: fedmerge run --resume {run_dir}")
    return run_experiment(
        cfg,
        run_dir,
        show_progress=show_progress,
        grid=grid,
        deployment=deployment,
        pooled_test=pooled_test,
        notify=notify,
    )


__all__ = ["RunResult", "run_experiment", "run_from_files", "TIMING_KEYS"]
