"""Run an experiment end to end: data, model, algorithm, engine, round loop, results folder."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from fedmerge.algorithms.privacy import build_algorithm
from fedmerge.algorithms.privacy_settings import clients_per_round, privacy_problem
from fedmerge.config.schema import ConfigError, config_warnings, load_config
from fedmerge.config.tuned import load_tuned_config
from fedmerge.core.checkpoint import atomic_write_bytes
from fedmerge.core.loop import Newcomers, Schedule
from fedmerge.data import FederatedDataset
from fedmerge.engines.memory import keep_freed_memory
from fedmerge.engines.vectorized import vectorize_problem
from fedmerge.engines.workers import available_cores, resolve_workers, set_threads, workers_problem
from fedmerge.models import build_model
from fedmerge.run.engine_setup import (
    client_store,
    connect_nodes,
    deployed_config,
    federation_summary,
    open_engine,
    require_flower,
    server_test,
)
from fedmerge.run.folder_lock import writing_run_folder
from fedmerge.run.prepare import check_compatibility, data_warnings, load_data, resolve_device, without_test
from fedmerge.run.recorder import Notify, RunResult, Segment, record_rounds
from fedmerge.run.results import CONFIG_FILE, FEDERATION_FILE, RunStore, check_new_run_folder, new_run_dir
from fedmerge.run.resume import (
    RESUME_OVERRIDABLE,
    check_not_shortened,
    finished_summary,
    keep_rounds_in_config,
    resume_checkpoint,
    roll_back_to_records,
)
from fedmerge.run.summary import TIMING_KEYS
from fedmerge.run.tensorboard_log import require_tensorboard


def secure_simulation(cfg: Any, deployment: bool) -> bool:
    """A Flower simulation under secure aggregation (its client states never reach the server)."""
    privacy = getattr(cfg, "privacy", None)
    return cfg.engine == "flower" and not deployment and privacy is not None and privacy.secure_aggregation is not None


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
    invocation: dict[str, Any] | None = None,
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
    ``invocation``: what the user asked for (``command`` and details), recorded in ``provenance.jsonl``
    instead of this process's command line (a ServerApp's holds its token, which no file may hold).

    The run folder is this process's alone while it runs (``folder_lock``): from before a resume reads
    it, or from its creation, to the end; another writer is refused in one line.
    """
    with ExitStack() as held:
        return _run_experiment(
            held, cfg, run_dir, resume=resume, show_progress=show_progress, stop_after=stop_after, grid=grid,
            deployment=deployment, pooled_test=pooled_test, checkpoint=checkpoint, notify=notify,
            withhold_test=withhold_test, data=data, invocation=invocation,
        )  # fmt: skip


def _run_experiment(
    held: ExitStack,
    cfg: BaseModel,
    run_dir: str | Path | None,
    *,
    resume: bool,
    show_progress: bool,
    stop_after: int | None,
    grid: Any,
    deployment: bool,
    pooled_test: str | None,
    checkpoint: str | None,
    notify: Notify | None,
    withhold_test: bool,
    data: FederatedDataset | None,
    invocation: dict[str, Any] | None,
) -> RunResult:
    """[`run_experiment()`][fedmerge.run.runner.run_experiment], its run folder's lock entered on ``held``."""
    notify = notify or (lambda message: None)
    if cfg.engine == "flower":
        require_flower(simulation=grid is None)
    if deployment and grid is None:
        raise ValueError("deployment=True needs the Grid of a ServerApp")
    if pooled_test is not None and not deployment:
        raise ConfigError("pooled-test applies to a deployment; a simulation tests on its own data")
    if cfg.split.unseen_clients and deployment:
        raise ConfigError(
            "split.unseen_clients applies to engine=local and Flower simulations: deployed nodes hold their own "
            "data; set it to 0"
        )
    if getattr(cfg, "unseen", None) is not None and not cfg.split.unseen_clients:
        raise ConfigError("unseen: onboards the clients that never train; set split.unseen_clients too, or remove it")
    if cfg.state is not None and (cfg.engine != "local" or grid is not None):
        raise ConfigError("state (client states on disk) applies to engine=local; remove it for engine=flower")
    if not resume and run_dir is not None:
        check_new_run_folder(run_dir)  # refused before anything is loaded; again once the folder is ours
    for warning in config_warnings(cfg):
        notify(f"warning: {warning}")
    ckpt = None
    if resume:
        if run_dir is None:
            raise ValueError("resume=True needs the run folder")
        if secure_simulation(cfg, deployment):
            raise ConfigError(
                f"{run_dir}: a Flower simulation under privacy.secure_aggregation cannot resume: its clients' states "
                "stayed in the simulation's memory, which secure aggregation keeps from the server's checkpoints "
                "(a deployment keeps them on the nodes' disks and resumes); start it again"
            )
        held.enter_context(writing_run_folder(run_dir))  # before anything that another writer could change
        ckpt = resume_checkpoint(Path(run_dir), cfg, checkpoint)
        check_not_shortened(Path(run_dir), cfg, ckpt)
        ckpt, rolled_back = roll_back_to_records(Path(run_dir), cfg, ckpt, RunStore(run_dir).recorded_rounds())
        if rolled_back is not None:
            notify(rolled_back)
        elif checkpoint is None and (summary := finished_summary(Path(run_dir), cfg, ckpt)) is not None:
            notify(
                f"{run_dir} already finished its {cfg.rounds} rounds; nothing changed (to add rounds: rounds=N; "
                "to make rounds again: --checkpoint FILE)"
            )
            return RunResult(Path(run_dir), summary, ckpt.server_state)
    if cfg.log is not None and cfg.log.tensorboard:
        require_tensorboard()
    device = resolve_device(cfg.device)
    if (problem := workers_problem(cfg.workers, cfg.threads, device, cfg.engine)) is not None:
        raise ConfigError(problem)
    if cfg.workers != "auto" and cfg.workers > available_cores():  # allowed (the same numbers), but slower
        notify(f"warning: workers={cfg.workers} is more than the {available_cores()} cores; they slow each other")
    set_threads(cfg.threads)
    if cfg.keep_freed_memory:
        keep_freed_memory()  # forked workers inherit it
    # Everything that can be refused is checked before the run folder exists.
    federation = None
    if deployment:
        # The server holds no data: the nodes' handshake says the input shape and the classes.
        federation = connect_nodes(cfg, grid)
        described = deployed_config(cfg, federation)  # the federation's clients, its name
        if resume and described.partition.num_clients != cfg.partition.num_clients:
            raise ConfigError(
                f"{run_dir}: the run had {cfg.partition.num_clients} clients but {federation.num_clients} "
                "SuperNodes answered; resume it with the federation that ran it"
            )
        cfg = cfg if resume else described
        first = federation.first
        sample = torch.zeros(2, *first.input_shape, dtype=getattr(torch, first.input_dtype))
        data, num_classes, input_shape = None, first.num_classes, first.input_shape
        num_clients, groups = federation.num_clients, federation.groups
        pooled = server_test(pooled_test, federation, device) if pooled_test is not None else None
    else:
        # token datasets declare their input shape, so a model that cannot read tokens is refused
        # before the (slow) tokenization
        tokens = cfg.dataset.token_length()
        if tokens is not None:
            check_compatibility(cfg, torch.ones(2, tokens, dtype=torch.int64), 2, device)
        if data is None:
            with data_warnings(notify):
                data = load_data(cfg)
        data = data.to(device)
        if withhold_test:
            data = without_test(data)
        sample = next(c.x_train[:2] for c in data.clients if c.n_train)
        num_classes, input_shape = data.num_classes, data.input_shape
        # the clients that never train come last (split.unseen_clients): the method is built for the others
        num_clients, groups = data.num_participants, data.groups()[: data.num_participants]
    model = check_compatibility(cfg, sample, num_classes, device)

    def model_factory(generator: torch.Generator) -> torch.nn.Module:
        return build_model(cfg.model, input_shape, num_classes, generator=generator)

    privacy = getattr(cfg, "privacy", None)
    if privacy is not None:
        problem = privacy_problem(cfg.algorithm.name, privacy, model, sample.to(device))
        if problem is None and cfg.vectorize:
            problem = "vectorize: not with privacy (DP-SGD's per-sample step and the private aggregate run per client)"
        if problem is None and privacy.secure_aggregation is not None:
            problem = secure_aggregation_problem(cfg, num_clients)
        if (
            problem is None
            and privacy.central is not None
            and cfg.participation < 1
            and cfg.eval_clients == "participants"
        ):
            problem = (
                "privacy.central: not with eval_clients=participants, whose evaluation would publish which clients "
                "the secret Poisson sampling chose (use all or sample:K)"
            )
        if problem is not None:
            raise ConfigError(problem)
    try:
        algorithm = build_algorithm(
            cfg.algorithm, model_factory, num_clients, cfg.seed, privacy,
            rounds=cfg.rounds, participation=cfg.participation,
        )  # fmt: skip
    except ValueError as exc:  # settings that conflict with the model or the data (e.g. fedlora without LoRA)
        raise ConfigError(f"algorithm {cfg.algorithm.name!r}: {str(exc).splitlines()[0]}") from None
    if privacy is not None and privacy.differential:  # e.g. a target epsilon that no noise achieves
        sizes = [int(data.clients[c].y_train.shape[0]) for c in range(num_clients)] if data is not None else []
        problem = algorithm.noise_problem(sizes)
        if problem is not None:
            raise ConfigError(problem)
    local = cfg.engine == "local" and grid is None
    per_round = len(Schedule(cfg.rounds, num_clients, cfg.participation).sample(1))
    where = "local" if local else "flower"
    workers = resolve_workers(cfg.workers, cfg.threads, device, per_round, where, cfg.vectorize)
    if cfg.vectorize:
        problem = vectorize_problem(algorithm, model)
        if problem is None and (cfg.engine != "local" or workers.count != 1):
            problem = "vectorize: batched clients are an option of engine=local with workers=1"
        if problem is not None:
            raise ConfigError(problem)
    store = RunStore(run_dir if run_dir is not None else new_run_dir(cfg.output_dir, cfg.name))
    if not resume:
        held.enter_context(writing_run_folder(store.dir))
        check_new_run_folder(store.dir)  # a writer that got here first
    else:
        keep_rounds_in_config(store, cfg.rounds)  # an extended run's config.yaml says how long it is
    if federation is not None:
        summary = json.dumps(federation_summary(federation), indent=1) + "\n"
        atomic_write_bytes(store.dir / FEDERATION_FILE, summary.encode())
        federation.pooled_test = pooled
    try:
        with (
            client_store(cfg, store) as states,
            open_engine(cfg, data, model, device, grid, states, federation, workers if local else None) as engine,
        ):
            dataset = federation.first.dataset if federation is not None else None
            segment = Segment(
                resume, ckpt, show_progress, stop_after, notify, deployment, invocation, dataset,
                workers=workers if local else None,
            )  # fmt: skip
            newcomers = None if data is None or not data.num_unseen else newcomers_of(cfg, data)
            classes = None if hasattr(model, "task_loss") else num_classes  # a causal LM is not a classifier
            names = None if data is None else data.client_names  # natural clients the data names (cid order)
            return record_rounds(
                cfg, store, algorithm, model, engine, device, groups, segment, states, newcomers, classes,
                client_names=names,
            )  # fmt: skip
    except (KeyboardInterrupt, OSError) as exc:  # Ctrl-C, a full disk: the caller says how to continue this run
        exc.run_dir = store.dir  # type: ignore[union-attr]
        raise


def newcomers_of(cfg: BaseModel, data: FederatedDataset) -> Newcomers:
    """The clients that never train (after the participants) and their adaptation budget."""
    cids = tuple(range(data.num_participants, len(data.clients)))
    if cfg.unseen is None:
        return Newcomers(cids)
    return Newcomers(cids, cfg.unseen.adapt_epochs, tuple(cfg.unseen.also_adapt_epochs), cfg.unseen.adapt_lr)


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
    invocation: dict[str, Any] | None = None,
) -> RunResult:
    """``run_dir``: create the run in exactly this folder (``--out``; ``fedmerge sweep``); ``tuned``: a
    ``fedmerge tune`` file whose values for the config's algorithm apply under ``overrides``."""
    if checkpoint is not None and resume_dir is None:
        raise ConfigError("--checkpoint only applies with --resume RUN_DIR")
    if resume_dir is not None and (run_dir is not None or tuned is not None):
        raise ConfigError(f"{'--out' if run_dir is not None else '--tuned'} does not apply with --resume")
    if resume_dir is not None:
        if not Path(resume_dir).exists():
            raise ConfigError(f"--resume {resume_dir}: the folder does not exist")
        if not (Path(resume_dir) / CONFIG_FILE).is_file():
            raise ConfigError(f"--resume {resume_dir}: no {CONFIG_FILE} there; is it a run folder?")
        check_resume_place(Path(resume_dir), deployment)
        store = RunStore(resume_dir)
        bad = [o for o in overrides if o.partition("=")[0] not in RESUME_OVERRIDABLE]
        if bad or config_path is not None:
            raise ConfigError(
                f"cannot change {bad[0].partition('=')[0] if bad else 'the config file'} when resuming; "
                f"only {sorted(RESUME_OVERRIDABLE)} may be overridden"
            )
        cfg = load_config(store.read_config_path(), overrides, resolve_paths=False)  # as recorded
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
            invocation=invocation,
        )
    cfg = load_tuned_config(config_path, overrides, tuned) if tuned else load_config(config_path, overrides)
    if run_dir is not None:
        check_new_run_folder(run_dir, "--out")
    return run_experiment(
        cfg,
        run_dir,
        show_progress=show_progress,
        grid=grid,
        deployment=deployment,
        pooled_test=pooled_test,
        notify=notify,
        invocation=invocation,
    )


def check_resume_place(run_dir: Path, deployment: bool) -> None:
    """A deployed run (its folder has ``federation.json``) continues only on its SuperLink, with the nodes
    that hold its clients' data and states; any other run only where it started."""
    deployed = (run_dir / FEDERATION_FILE).is_file()
    if deployed and not deployment:
        raise ConfigError(
            f"{run_dir} is a deployed run: its clients' data and states are on its SuperNodes. Resume it through "
            f"its SuperLink: fedmerge deploy run SUPERLINK --resume {run_dir}  (or: flwr run APP SUPERLINK "
            f"--stream --run-config 'resume=\"{run_dir}\"')"
        )
    if deployment and not deployed:
        raise ConfigError(
            f"{run_dir} is not a deployed run (no {FEDERATION_FILE}); continue it with: fedmerge run --resume {run_dir}"
        )


__all__ = ["RunResult", "run_experiment", "run_from_files", "TIMING_KEYS", "RESUME_OVERRIDABLE"]
