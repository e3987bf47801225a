"""The one mapping from a config to an engine: local (in-process, workers, vectorised) or Flower
(simulation, deployment)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from fedmerge.config.schema import ConfigError, ExperimentConfig, FlowerSettings
from fedmerge.core.checkpoint import (
    CLIENT_STORE,
)
from fedmerge.core.loop import Engine, Schedule, parse_eval_clients
from fedmerge.core.state_store import StateStore, StoredStates
from fedmerge.data import FederatedDataset
from fedmerge.engines.local import LocalEngine
from fedmerge.engines.workers import WorkerCount
from fedmerge.run.results import RunStore


def flower_problem(cfg: ExperimentConfig, simulation: bool) -> str | None:
    """``engine: flower`` where Flower (and for a simulation, Ray) is not installed."""
    from fedmerge.engines.flower import INSTALL_HINT, flower_available

    if cfg.engine == "flower" and not flower_available(simulation=simulation):
        return INSTALL_HINT
    return None


def require_flower(simulation: bool) -> None:
    from fedmerge.engines.flower import INSTALL_HINT, flower_available

    if not flower_available(simulation=simulation):
        raise ConfigError(INSTALL_HINT)


def flower_options(cfg: ExperimentConfig) -> Any:
    from fedmerge.engines.flower.federation import FlowerOptions

    fs = cfg.flower or FlowerSettings()
    return FlowerOptions(fs.min_replies, fs.max_retries, fs.round_timeout, fs.connect_timeout)


def connect_nodes(cfg: ExperimentConfig, grid: Any) -> Any:
    """Deployment: the handshake with the SuperNodes (their files must agree), as a one-line error."""
    from fedmerge.engines.flower.federation import connect
    from fedmerge.engines.flower.protocol import DEPLOYMENT

    return connect(grid, flower_options(cfg), DEPLOYMENT)


def server_test(path: str, federation: Any, device: torch.device) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
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


DATA_SECTIONS = ("dataset", "partition", "split", "noise")  # what fedmerge export-clients records


def deployed_config(cfg: ExperimentConfig, federation: Any) -> ExperimentConfig:
    """``cfg`` as the federation that answered the handshake runs it: its number of clients (the nodes'
    files decide the data, not the server's data sections: those of their export replace them when the files
    record it, and a seed other than the export's is refused) and, unless ``name`` was chosen, the name
    ALGORITHM-DATASET with the nodes' dataset. Refused in one line when the partition section cannot
    hold that many clients."""
    from fedmerge.config.schema import default_name, validate

    data = cfg.model_dump(mode="json", exclude_none=True)
    chosen = cfg.name != default_name(data)
    source = federation.first.source
    if source is not None:  # files of fedmerge export-clients name the data config and seed they come from
        if cfg.seed != source.get("seed", 0):
            raise ConfigError(
                f"the run's seed {cfg.seed} is not the seed {source.get('seed', 0)} the SuperNodes' client files "
                f"were exported with; run with seed={source.get('seed', 0)}, or export the clients again with "
                f"seed={cfg.seed}"
            )
        # config.yaml then describes the data the nodes hold, so that it reproduces the run
        data |= {k: v for k, v in source.items() if k in DATA_SECTIONS}
    data["partition"] = {**data["partition"], "num_clients": federation.num_clients}
    if not chosen:
        data["name"] = default_name({"algorithm": data["algorithm"], "dataset": {"name": federation.first.dataset}})
    try:
        return validate(data)
    except ConfigError as exc:
        raise ConfigError(
            f"the SuperNodes form a federation of {federation.num_clients} clients, which this config's partition "
            f"section cannot describe: {exc}"
        ) from None


def new_run_key(cfg: ExperimentConfig) -> str:
    """A deployed run's name on its nodes' disks: its config digest and a fresh id (kept by checkpoints)."""
    import secrets

    from fedmerge.run.resume import config_digest

    return f"{config_digest(cfg)[:12]}-{secrets.token_hex(4)}"


def pooled_test_of(
    cfg: ExperimentConfig, data: FederatedDataset
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]] | None:
    """The global model's test set: every client's test split, or with ``eval_clients: sample:K`` those
    of the K evaluated clients (the same every round), so that no evaluation grows with the population."""
    has_test = data.clients.has_test() if hasattr(data.clients, "has_test") else any(c.n_test for c in data.clients)
    if not has_test:  # no test split (withheld while tuning): no global-model test either
        return None
    if parse_eval_clients(cfg.eval_clients)[0] != "sample":
        return partial(data.pooled_test, range(data.num_participants)) if data.num_unseen else data.pooled_test
    # the participants' test splits (the clients that never train come after them)
    sample = Schedule(cfg.rounds, data.num_participants, seed=cfg.seed, eval_clients=cfg.eval_clients).evaluated(0, [])
    return partial(data.pooled_test, sample)


@contextmanager
def client_store(cfg: ExperimentConfig, run: RunStore) -> Iterator[StateStore | None]:
    """The run's on-disk client-state store (``state:`` set), closed when the run ends; else None."""
    if cfg.state is None:
        yield None
        return
    # durable=False: each checkpoint fsyncs the store (a killed process loses no committed put anyway)
    with StateStore(run.checkpoint_dir / CLIENT_STORE, cfg.state.cache_size, durable=False) as store:
        yield store


@contextmanager
def open_engine(
    cfg: ExperimentConfig,
    data: FederatedDataset | None,
    model: torch.nn.Module,
    device: torch.device,
    grid: Any,
    client_store: StateStore | None = None,
    federation: Any = None,
    workers: WorkerCount | None = None,
    pooled_test: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> Iterator[Engine]:
    """``workers``: the resolved ``workers`` setting of a local engine (``resolve_workers``); None: ``cfg.workers``,
    a number. ``pooled_test``: the global model's test set
    ([`pooled_test_of()`][fedmerge.run.engine_setup.pooled_test_of]; a deployed server has no data, only the
    pooled test file its operator gave, if any)."""
    if cfg.engine != "flower" and grid is None:
        with LocalEngine(
            data.clients,
            model,
            device,
            cfg.seed,
            pooled_test=pooled_test,
            eval_batch_size=cfg.eval_batch_size,
            workers=workers.count if workers is not None else cfg.workers if isinstance(cfg.workers, int) else 1,
            states=None if client_store is None else StoredStates(client_store, device),
            vectorize=cfg.vectorize,
            min_round_seconds=workers.min_round_seconds if workers is not None else 0.0,
        ) as engine:
            yield engine
        return
    from fedmerge.engines.flower.engine import FlowerEngine
    from fedmerge.engines.flower.federation import connect
    from fedmerge.engines.flower.job import client_job
    from fedmerge.engines.flower.protocol import DEPLOYMENT, SIMULATION
    from fedmerge.engines.flower.simulation import SimulationOptions, simulation

    fs = cfg.flower or FlowerSettings()
    options = flower_options(cfg)
    mode = DEPLOYMENT if federation is not None else SIMULATION
    num_clients = federation.num_clients if federation is not None else len(data.clients)
    unseen = data.num_unseen if data is not None else 0  # simulation: one node per client, trained or not
    # deployment: the job names no data; each node reads its own file
    job = client_job(cfg.model_dump(mode="json"), num_clients - unseen, with_data=mode == SIMULATION)
    if unseen:
        job["unseen_clients"] = unseen

    def engine_on(target: Any) -> FlowerEngine:
        fed = federation if federation is not None else connect(target, options, SIMULATION, num_clients)
        return FlowerEngine(
            target, fed, job, model, device, cfg.seed, options, pooled_test, cfg.eval_batch_size, mode=mode,
            run_key=new_run_key(cfg) if mode == DEPLOYMENT else "",
            secure_aggregation=cfg.privacy.secure_aggregation if cfg.privacy is not None else None,
        )  # fmt: skip

    if grid is not None:  # a ServerApp was handed a Grid by the SuperLink (or a test's fake one)
        yield engine_on(grid)
        return
    sim = SimulationOptions(fs.num_cpus, fs.client_cpus, fs.client_gpus, ray_address=fs.ray_address)
    with simulation(num_clients, sim) as relay:
        yield engine_on(relay)
