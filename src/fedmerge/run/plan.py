"""A run's plan: everything a run needs, resolved and checked before its folder exists.

[`plan_run()`][fedmerge.run.plan.plan_run] turns a config and a source (this process's data, or a deployment's
SuperNodes) into a frozen [`RunPlan`][fedmerge.run.plan.RunPlan]: the device, the data (or the nodes' handshake),
the model, the algorithm, the engine's place and workers, the newcomers. Every refusal is a ``*_problem()`` check
that returns one line or None; the first problem found is raised as a `ConfigError`. The checks that read only the
config come first (nothing loaded), then those that need the data and the model. Planning writes nothing: no
folder is created and no file is touched (``run/setup.py`` does that, then ``run/execute.py`` runs the plan).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedmerge.algorithms import Algorithm
from fedmerge.algorithms.privacy import build_algorithm
from fedmerge.algorithms.privacy_settings import clients_per_round, privacy_problem
from fedmerge.config.schema import ConfigError, ExperimentConfig, config_warnings
from fedmerge.core.loop import Newcomers, Schedule
from fedmerge.data import FederatedDataset
from fedmerge.engines.vectorized import vectorize_problem
from fedmerge.engines.workers import WorkerCount, available_cores, resolve_workers, set_threads, workers_problem
from fedmerge.models import build_model
from fedmerge.run.data_plan import plan_data
from fedmerge.run.engine_setup import connect_nodes, deployed_config, flower_problem, pooled_test_of, server_test
from fedmerge.run.prepare import check_compatibility, resolve_device
from fedmerge.run.results import new_run_folder_problem
from fedmerge.run.source import RunSource as RunSource
from fedmerge.run.tensorboard_log import tensorboard_problem

Notify = Callable[[str], None]
PooledTest = Callable[[], tuple[torch.Tensor, torch.Tensor]]


def silent(message: str) -> None:
    """A `Notify` that drops every notice."""


@dataclass(frozen=True)
class RunPlan:
    """A run, resolved: what [`execute()`][fedmerge.run.execute.execute] needs and nothing it must look up again."""

    cfg: ExperimentConfig  # as the run records it (a new deployed run: the federation's clients and name)
    source: RunSource
    device: torch.device
    data: FederatedDataset | None  # None: a deployment (the nodes hold the data)
    federation: Any  # a deployment: the nodes' handshake; else None
    model: torch.nn.Module  # the engine's one reusable instance
    algorithm: Algorithm
    local: bool  # engine=local in this process; else Flower (a simulation or the ServerApp's Grid)
    workers: WorkerCount | None  # the local engine's worker processes; None on Flower
    groups: list[int | None]  # the participants' ground-truth groups (their count is the sampled population)
    newcomers: Newcomers | None  # the clients that never train (split.unseen_clients)
    num_classes: int | None  # a classifier's class count for the summary; None: not a classifier (a causal LM)
    pooled_test: PooledTest | None  # the global model's test set
    client_names: list[str] | None  # natural clients' names by id, when the data names them
    dataset: str | None  # a deployment: the dataset the nodes' files hold

    @property
    def num_clients(self) -> int:
        return len(self.groups)


def refuse(problems: Iterable[str | None]) -> None:
    """Raise the first problem (one line) as a `ConfigError`; ``problems`` is read lazily, in order."""
    for problem in problems:
        if problem is not None:
            raise ConfigError(problem)


# --- refusals that read only the config and the source -------------------------------------------------------


def pooled_test_problem(source: RunSource) -> str | None:
    if source.pooled_test is not None and not source.deployment:
        return "pooled-test applies to a deployment; a simulation tests on its own data"
    return None


def unseen_problem(cfg: ExperimentConfig, source: RunSource) -> str | None:
    if cfg.split.unseen_clients and source.deployment:
        return (
            "split.unseen_clients applies to engine=local and Flower simulations: deployed nodes hold their own "
            "data; set it to 0"
        )
    if cfg.unseen is not None and not cfg.split.unseen_clients:
        return "unseen: onboards the clients that never train; set split.unseen_clients too, or remove it"
    return None


def state_problem(cfg: ExperimentConfig, source: RunSource) -> str | None:
    if cfg.state is not None and (cfg.engine != "local" or not source.local):
        return "state (client states on disk) applies to engine=local; remove it for engine=flower"
    return None


def config_problems(
    cfg: ExperimentConfig, source: RunSource, run_dir: str | Path | None = None, resume: bool = False
) -> Iterable[str | None]:
    """The refusals that need nothing loaded (the config, the source, the folder, the libraries the config names),
    in the order they are reported (lazily)."""
    yield flower_problem(cfg, source.local)
    yield pooled_test_problem(source)
    yield unseen_problem(cfg, source)
    yield state_problem(cfg, source)
    if not resume and run_dir is not None:  # again once the folder is ours (run/setup.py)
        yield new_run_folder_problem(run_dir)
    yield tensorboard_problem(cfg)


# --- refusals that need the data, the model or the algorithm ----------------------------------------------------


def deployed_clients_problem(
    cfg: ExperimentConfig, described: ExperimentConfig, resume: bool, run_dir: str | Path | None
) -> str | None:
    """A resumed deployment must find the federation that ran it."""
    if resume and described.partition.num_clients != cfg.partition.num_clients:
        return (
            f"{run_dir}: the run had {cfg.partition.num_clients} clients but {described.partition.num_clients} "
            "SuperNodes answered; resume it with the federation that ran it"
        )
    return None


def secure_aggregation_problem(cfg: Any, num_clients: int) -> str | None:
    """Why ``privacy.secure_aggregation`` cannot run as configured (one line), or None."""
    if cfg.engine != "flower":
        return (
            "privacy.secure_aggregation: needs engine=flower (Flower's SecAgg+ protocol between the nodes); "
            "the local engine runs every client in this process"
        )
    if clients_per_round(num_clients, cfg.participation) < 2:
        return "privacy.secure_aggregation: needs at least 2 clients per round (the sum of one is its update)"
    return None


def vectorize_privacy_problem(cfg: ExperimentConfig) -> str | None:
    if cfg.vectorize:
        return "vectorize: not with privacy (DP-SGD's per-sample step and the private aggregate run per client)"
    return None


def central_privacy_problem(cfg: ExperimentConfig) -> str | None:
    central = cfg.privacy is not None and cfg.privacy.central is not None
    if central and cfg.participation < 1 and cfg.eval_clients == "participants":
        return (
            "privacy.central: not with eval_clients=participants, whose evaluation would publish which clients "
            "the secret Poisson sampling chose (use all or sample:K)"
        )
    return None


def privacy_problems(
    cfg: ExperimentConfig, model: torch.nn.Module, sample: torch.Tensor, num_clients: int
) -> Iterable[str | None]:
    """The ``privacy:`` section against the method, the model and the population (none without the section)."""
    privacy = cfg.privacy
    if privacy is None:
        return
    yield privacy_problem(cfg.algorithm.name, privacy, model, sample)
    yield vectorize_privacy_problem(cfg)
    if privacy.secure_aggregation is not None:
        yield secure_aggregation_problem(cfg, num_clients)
    yield central_privacy_problem(cfg)


def noise_problem(
    cfg: ExperimentConfig, algorithm: Algorithm, data: FederatedDataset | None, num_clients: int
) -> str | None:
    """A DP mechanism that no noise can satisfy (e.g. a target epsilon), given the clients' training sizes."""
    if cfg.privacy is None or not cfg.privacy.differential:
        return None
    sizes = [int(data.clients[c].y_train.shape[0]) for c in range(num_clients)] if data is not None else []
    return algorithm.noise_problem(sizes)


def vectorize_engine_problem(cfg: ExperimentConfig, workers: WorkerCount) -> str | None:
    if cfg.vectorize and (cfg.engine != "local" or workers.count != 1):
        return "vectorize: batched clients are an option of engine=local with workers=1"
    return None


# --- the plan ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Inputs:
    """What the data (or the deployed nodes) say: enough to build the model and the method."""

    cfg: ExperimentConfig
    data: FederatedDataset | None
    federation: Any
    sample: torch.Tensor  # two training inputs, on the device
    num_classes: int
    input_shape: tuple[int, ...]
    groups: list[int | None]
    pooled_test: PooledTest | None


def plan_run(
    cfg: ExperimentConfig,
    source: RunSource | None = None,
    *,
    run_dir: str | Path | None = None,
    resume: bool = False,
    notify: Notify | None = None,
) -> RunPlan:
    """Resolve and check everything ``cfg`` needs on ``source`` (default: this process's data), writing nothing.

    ``run_dir``: the run's folder (a new run's is refused when it holds a run's file); ``resume``: the plan
    continues a run (a deployment then keeps the recorded config instead of the federation's). ``notify``
    receives one-line warnings. Sets torch's thread count (``threads``) before the data is built, since the
    count is part of the numbers."""
    source = source or RunSource()
    notify = notify or silent
    refuse(config_problems(cfg, source, run_dir, resume))
    for warning in config_warnings(cfg):
        notify(f"warning: {warning}")
    device = resolve_device(cfg.device)
    refuse([workers_problem(cfg.workers, cfg.threads, device, cfg.engine)])  # what this machine cannot run
    if cfg.workers != "auto" and cfg.workers > available_cores():  # allowed (the same numbers), but slower
        notify(f"warning: workers={cfg.workers} is more than the {available_cores()} cores; they slow each other")
    set_threads(cfg.threads)
    got = _deployed(cfg, source, device, resume, run_dir) if source.deployment else _local(cfg, source, device, notify)
    cfg, data = got.cfg, got.data
    model = check_compatibility(cfg, got.sample, got.num_classes, device)
    num_clients = len(got.groups)
    refuse(privacy_problems(cfg, model, got.sample, num_clients))

    def model_factory(generator: torch.Generator) -> torch.nn.Module:
        return build_model(cfg.model, got.input_shape, got.num_classes, generator=generator)

    try:
        algorithm = build_algorithm(
            cfg.algorithm, model_factory, num_clients, cfg.seed, cfg.privacy,
            rounds=cfg.rounds, participation=cfg.participation,
        )  # fmt: skip
    except ValueError as exc:  # settings that conflict with the model or the data (e.g. fedlora without LoRA)
        raise ConfigError(f"algorithm {cfg.algorithm.name!r}: {str(exc).splitlines()[0]}") from None
    refuse([noise_problem(cfg, algorithm, data, num_clients)])
    local = cfg.engine == "local" and source.local
    per_round = len(Schedule(cfg.rounds, num_clients, cfg.participation).sample(1))
    where = "local" if local else "flower"
    workers = resolve_workers(cfg.workers, cfg.threads, device, per_round, where, cfg.vectorize)
    if cfg.vectorize:
        refuse([vectorize_problem(algorithm, model), vectorize_engine_problem(cfg, workers)])
    return RunPlan(
        cfg=cfg,
        source=source,
        device=device,
        data=data,
        federation=got.federation,
        model=model,
        algorithm=algorithm,
        local=local,
        workers=workers if local else None,
        groups=got.groups,
        newcomers=None if data is None or not data.num_unseen else newcomers_of(cfg, data),
        num_classes=None if hasattr(model, "task_loss") else got.num_classes,  # a causal LM is not a classifier
        pooled_test=got.pooled_test,
        client_names=None if data is None else data.client_names,
        dataset=got.federation.first.dataset if got.federation is not None else None,
    )


def _deployed(
    cfg: ExperimentConfig, source: RunSource, device: torch.device, resume: bool, run_dir: str | Path | None
) -> _Inputs:
    """The server holds no data: the nodes' handshake says the input shape and the classes."""
    federation = connect_nodes(cfg, source.grid)
    described = deployed_config(cfg, federation)  # the federation's clients, its name
    refuse([deployed_clients_problem(cfg, described, resume, run_dir)])
    first = federation.first
    sample = torch.zeros(2, *first.input_shape, dtype=getattr(torch, first.input_dtype))
    pooled = server_test(source.pooled_test, federation, device) if source.pooled_test is not None else None
    return _Inputs(
        cfg if resume else described, None, federation, sample.to(device), first.num_classes,
        tuple(first.input_shape), list(federation.groups), pooled,
    )  # fmt: skip


def _local(cfg: ExperimentConfig, source: RunSource, device: torch.device, notify: Notify) -> _Inputs:
    # token datasets declare their input shape, so a model that cannot read tokens is refused before the (slow)
    # tokenization
    tokens = cfg.dataset.token_length()
    if tokens is not None:
        check_compatibility(cfg, torch.ones(2, tokens, dtype=torch.int64), 2, device)
    planned = plan_data(cfg, source, device=device, notify=notify)
    data = planned.data
    return _Inputs(
        cfg, data, None, planned.sample, data.num_classes, data.input_shape, planned.groups, pooled_test_of(cfg, data)
    )


def newcomers_of(cfg: ExperimentConfig, data: FederatedDataset) -> Newcomers:
    """The clients that never train (after the participants) and their adaptation budget."""
    cids = tuple(range(data.num_participants, len(data.clients)))
    if cfg.unseen is None:
        return Newcomers(cids)
    return Newcomers(cids, cfg.unseen.adapt_epochs, tuple(cfg.unseen.also_adapt_epochs), cfg.unseen.adapt_lr)
