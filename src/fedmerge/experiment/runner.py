"""Run an experiment end to end: data, model, algorithm, engine, round loop, results folder."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from fedmerge.algorithms import ALGORITHMS, Algorithm
from fedmerge.core.checkpoint import load_checkpoint, save_checkpoint
from fedmerge.core.loop import Engine, Schedule, run_rounds
from fedmerge.core.types import ServerState
from fedmerge.data import DataUnavailable, FederatedDataset, build_federated_dataset
from fedmerge.engines.local import LocalEngine
from fedmerge.engines.workers import set_threads, workers_problem
from fedmerge.models import build_model, count_parameters

from .config import ConfigError, FlowerSettings, load_config, to_yaml
from .progress import RoundProgress
from .results import RunStore, new_run_dir
from .summary import TIMING_KEYS, build_summary, summarize_eval, summary_markdown

RESUME_OVERRIDABLE = {"rounds", "device", "eval_batch_size", "workers"}


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]
    server_state: ServerState


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device: {name!r} requested but CUDA is not available (torch.cuda.is_available() is False)")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device: 'mps' requested but it is not available")
    return torch.device(name)


def load_data(cfg: BaseModel) -> FederatedDataset:
    try:
        return build_federated_dataset(cfg.dataset, cfg.partition, cfg.split, cfg.noise, cfg.seed)
    except DataUnavailable:
        raise
    except ValueError as exc:  # impossible values only known once the data is loaded
        raise ConfigError(str(exc).splitlines()[0]) from None


def config_digest(cfg: BaseModel) -> str:
    # Engine tuning (``flower``: timeouts, retries) does not change the numbers a run produces.
    fixed = cfg.model_dump(mode="json", exclude=RESUME_OVERRIDABLE | {"flower"})
    return hashlib.sha256(repr(sorted(fixed.items())).encode()).hexdigest()


def run_experiment(
    cfg: BaseModel,
    run_dir: str | Path | None = None,
    *,
    resume: bool = False,
    show_progress: bool = True,
    stop_after: int | None = None,
    grid: Any = None,
) -> RunResult:
    """Run (or resume) ``cfg``. ``stop_after`` ends after that round, as a crash would (tests).

    ``grid``: a Flower Grid, when called by the deployed ServerApp (``engine: flower``).
    """
    if cfg.engine == "flower":
        _require_flower(simulation=grid is None)
    device = resolve_device(cfg.device)
    if (problem := workers_problem(cfg.workers, cfg.threads, device, cfg.engine)) is not None:
        raise ConfigError(problem)
    set_threads(cfg.threads)
    data = load_data(cfg).to(device)
    store = RunStore(run_dir if run_dir is not None else new_run_dir(cfg.output_dir, cfg.name))

    def model_factory(generator: torch.Generator) -> torch.nn.Module:
        return build_model(cfg.model, data.input_shape, data.num_classes, generator=generator)

    entry = ALGORITHMS.get(cfg.algorithm.name)
    algorithm = entry.obj(cfg.algorithm, model_factory, len(data.clients), cfg.seed)
    model = model_factory(torch.Generator().manual_seed(0))
    with _open_engine(cfg, data, model, device, grid) as engine:
        groups = [c.group for c in data.clients]
        return _run(cfg, store, algorithm, model, engine, device, groups, resume, show_progress, stop_after)


def _run(
    cfg: BaseModel,
    store: RunStore,
    algorithm: Algorithm,
    model: torch.nn.Module,
    engine: Engine,
    device: torch.device,
    groups: list[int | None],
    resume: bool,
    show_progress: bool,
    stop_after: int | None,
) -> RunResult:
    num_clients = len(groups)
    schedule = Schedule(cfg.rounds, num_clients, cfg.participation, cfg.eval_every, cfg.seed)

    start_round = 0
    if resume:
        ckpt = load_checkpoint(store.checkpoint_dir) if (store.checkpoint_dir / "latest.json").exists() else None
        if ckpt is not None:
            if ckpt.meta.get("config_digest") != config_digest(cfg):
                raise ConfigError(f"{store.dir}: config.yaml no longer matches the checkpoint; refusing to resume")
            state = ckpt.server_state.to(device)
            engine.load_client_states(ckpt.client_states)
            start_round = ckpt.round
        else:
            state = algorithm.init_server_state().to(device)
        store.truncate_metrics(start_round)
    else:
        store.write_config(to_yaml(cfg))
        state = algorithm.init_server_state().to(device)

    digest = config_digest(cfg)
    t_start = time.perf_counter()

    def checkpoint(rnd: int, server_state: ServerState) -> None:
        save_checkpoint(
            store.checkpoint_dir,
            rnd,
            server_state,
            engine.client_states(),
            {"config_digest": digest},
            keep=cfg.keep_checkpoints,
        )

    with RoundProgress(cfg.rounds, start_round, len(schedule.sample(1)), enabled=show_progress) as progress:
        engine.on_client_done = progress.client_done

        def on_round_end(rnd: int, server_state: ServerState, record: dict[str, Any]) -> None:
            failures = engine.pop_failures() if hasattr(engine, "pop_failures") else []
            if failures:  # clients dropped from this round (Flower engine); absent when none
                record["failed_clients"] = failures
            if "eval" in record:
                record["summary"] = summarize_eval(record["eval"]["clients"])
            record["elapsed_seconds"] = time.perf_counter() - t_start
            store.append_metrics(record)
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
    summary = build_summary(rows, info)
    store.write_summary(summary, summary_markdown(summary))
    return RunResult(store.dir, summary, state)


class _Stop(Exception):
    pass


def _require_flower(simulation: bool) -> None:
    from fedmerge.engines.flower import INSTALL_HINT, flower_available

    if not flower_available(simulation=simulation):
        raise ConfigError(INSTALL_HINT)


@contextmanager
def _open_engine(
    cfg: BaseModel, data: FederatedDataset, model: torch.nn.Module, device: torch.device, grid: Any
) -> Iterator[Engine]:
    if cfg.engine != "flower" and grid is None:
        with LocalEngine(
            data.clients,
            model,
            device,
            cfg.seed,
            pooled_test=data.pooled_test,
            eval_batch_size=cfg.eval_batch_size,
            workers=cfg.workers,
        ) as engine:
            yield engine
        return
    from fedmerge.engines.flower.engine import FlowerEngine, FlowerOptions
    from fedmerge.engines.flower.simulation import SimulationOptions, simulation

    fs = cfg.flower or FlowerSettings()
    options = FlowerOptions(fs.min_replies, fs.max_retries, fs.round_timeout, fs.connect_timeout)

    def engine_on(target: Any) -> FlowerEngine:
        return FlowerEngine(
            target,
            cfg.model_dump(mode="json"),
            len(data.clients),
            model,
            device,
            cfg.seed,
            options,
            data.pooled_test,
            cfg.eval_batch_size,
        )

    if grid is not None:  # deployment: the ServerApp was handed a Grid by the SuperLink
        yield engine_on(grid)
        return
    with simulation(len(data.clients), SimulationOptions(fs.num_cpus, fs.client_cpus, fs.client_gpus)) as relay:
        yield engine_on(relay)


def _parameter_counts(
    algorithm: Algorithm, model: torch.nn.Module, state: ServerState, engine: Engine
) -> dict[str, float]:
    states = list(engine.client_states().values())
    model_params = count_parameters(model)
    return {
        "model": float(model_params),
        "server_state": float(state.num_parameters()),
        "client_state_mean": float(sum(s.num_parameters() for s in states) / max(len(states), 1)),
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
    show_progress: bool = True,
    grid: Any = None,
) -> RunResult:
    if resume_dir is not None:
        store = RunStore(resume_dir)
        if not store.read_config_path().exists():
            raise ConfigError(f"--resume {resume_dir}: no {store.read_config_path().name} there; is it a run folder?")
        bad = [o for o in overrides if o.partition("=")[0] not in RESUME_OVERRIDABLE]
        if bad or config_path is not None:
            raise ConfigError(
                f"cannot change {bad[0].partition('=')[0] if bad else 'the config file'} when resuming; "
                f"only {sorted(RESUME_OVERRIDABLE)} may be overridden"
            )
        cfg = load_config(store.read_config_path(), overrides)
        return run_experiment(cfg, store.dir, resume=True, show_progress=show_progress, grid=grid)
    cfg = load_config(config_path, overrides)
    return run_experiment(cfg, show_progress=show_progress, grid=grid)


__all__ = ["RunResult", "run_experiment", "run_from_files", "TIMING_KEYS"]
