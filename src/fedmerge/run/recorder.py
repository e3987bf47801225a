"""The rounds of one run segment: the round loop with the callback that records metrics, checkpoints,
progress and TensorBoard, then the summary."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedmerge.algorithms import Algorithm
from fedmerge.algorithms.privacy_report import redact_participants
from fedmerge.config.schema import dataset_label
from fedmerge.core.checkpoint import save_checkpoint
from fedmerge.core.loop import UNSEEN_EVAL, Engine, Schedule, run_rounds
from fedmerge.core.state_store import StateStore, StoredStates
from fedmerge.core.types import ServerState
from fedmerge.engines.device import peak_memory_mib
from fedmerge.models import count_parameters
from fedmerge.run.plan import Notify, RunPlan, silent
from fedmerge.run.progress import RoundProgress
from fedmerge.run.provenance import record_segment
from fedmerge.run.results import RunStore
from fedmerge.run.resume import config_digest
from fedmerge.run.run_records import RoundRecord
from fedmerge.run.setup import Start
from fedmerge.run.summary import build_summary, summarize_eval, summary_markdown
from fedmerge.run.tensorboard_log import ScalarLog


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]
    server_state: ServerState


@dataclass(frozen=True)
class Segment:
    """How this process's part of a run shows itself and ends."""

    show_progress: bool = True
    stop_after: int | None = None  # end after this round, as a crash would (tests)
    notify: Notify = silent
    # one notice per round (a deployed ServerApp's log, where no progress display runs)
    round_notices: bool = False
    # what the user asked for, recorded instead of this process's command line (``record_segment``)
    invocation: dict[str, Any] | None = None


class Stopped(Exception):
    pass


def record_rounds(
    plan: RunPlan,
    store: RunStore,
    engine: Engine,
    start: Start,
    segment: Segment,
    client_store: StateStore | None = None,
) -> RunResult:
    """The round loop from ``start``, each round recorded (metrics row, checkpoint, progress, TensorBoard) by its
    callback, then the summary. ``client_store``: the run's on-disk client states (``state:``), checkpointed
    with the server state."""
    cfg, algorithm, model, device = plan.cfg, plan.algorithm, plan.model, plan.device
    newcomers, groups = plan.newcomers, plan.groups
    num_clients = len(groups)
    schedule = Schedule(cfg.rounds, num_clients, cfg.participation, cfg.eval_every, cfg.seed, cfg.eval_clients)
    state, start_round = start.state, start.round
    workers = plan.workers  # a local engine's worker processes, recorded in provenance.jsonl

    extra = {"workers": workers.count} if workers is not None else {}
    # workers: auto says when it starts the workers (once a round's client work is worth it)
    announce = workers is not None and workers.auto and workers.count > 1
    record_segment(store.dir, start_round, start.resumed, {**(segment.invocation or {}), **extra} or None)
    digest = config_digest(cfg)
    peak_memory_mib(device)  # the first round's peak starts here
    t_start = time.perf_counter() - start.earlier_seconds

    def checkpoint(rnd: int, server_state: ServerState) -> None:
        save_checkpoint(
            store.checkpoint_dir,
            rnd,
            server_state,
            engine.client_states() if client_store is None else client_store,
            {"config_digest": digest, **engine.checkpoint_meta(cfg.keep_checkpoints)},
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
            nonlocal announce
            # clients dropped from this round: by the engine (Flower: no reply) or by the round loop
            # (an update that is not finite or not shaped like the others); absent when none
            failures = engine.pop_failures()
            failures += record.pop("failed_clients", [])
            if failures:
                record["failed_clients"] = failures
            if "eval" in record:
                record["summary"] = summarize_eval(record["eval"]["clients"])
            for key in [k for k in record if k.startswith(UNSEEN_EVAL)]:  # eval_unseen -> summary_unseen, ...
                record["summary" + key.removeprefix("eval")] = summarize_eval(record[key]["clients"])
            if getattr(algorithm, "poisson_clients", False):  # central DP: who took part stays secret
                record = redact_participants(record)
            record["elapsed_seconds"] = time.perf_counter() - t_start
            peak = peak_memory_mib(device)  # on CUDA: this round's peak, so growth over rounds shows
            if peak is not None:
                record["gpu_peak_mib"] = peak
            typed = RoundRecord.from_dict(record)
            store.append_metrics(typed)
            if tensorboard is not None:
                tensorboard.round(rnd, typed)
            if rnd % cfg.checkpoint_every == 0 or rnd == cfg.rounds:
                checkpoint(rnd, server_state)
            progress.round_done(rnd, progress_text(typed))
            if announce and (first := getattr(engine, "parallel_from", None)) is not None:
                segment.notify(workers.started(first))
                announce = False
            if segment.round_notices:
                failed = sorted({f["cid"] for f in failures})
                dropped = f"  dropped clients {failed}" if failed else ""
                segment.notify(f"round {rnd}/{cfg.rounds}: {progress_text(typed)}{dropped}")
            if stop_after is not None and rnd >= stop_after:
                raise Stopped

        try:
            state = run_rounds(algorithm, engine, schedule, state, start_round, on_round_end, newcomers)
        except Stopped:
            return RunResult(store.dir, {}, state)

    for line in getattr(algorithm, "run_warnings", lambda s, r: [])(state, cfg.rounds):  # e.g. FedMerge's
        segment.notify(f"warning: {line}")
    rows = store.read_metrics()
    info = {
        "name": cfg.name,
        "algorithm": cfg.algorithm.name,
        "dataset": plan.dataset or dataset_label(cfg.dataset),  # deployed: what the nodes said
        "partition": cfg.partition.name,
        "model": cfg.model.name,
        "num_clients": num_clients,
        "seed": cfg.seed,
        "parameters": parameter_counts(algorithm, model, state, engine),
        # ground-truth groups (cluster/domain partitions): the summary scores cluster recovery
        "client_groups": groups if all(g is not None for g in groups) else None,
        "wall_seconds": time.perf_counter() - t_start,
    }
    if isinstance(used := getattr(engine, "workers_used", None), int):  # the local engine: where clients ran
        info["workers"] = {"processes": used, "from_round": engine.parallel_from} if used > 1 else {"processes": 1}
    if newcomers is not None:
        info["unseen_clients"] = {"count": len(newcomers.cids), "adapt_epochs": newcomers.adapt_epochs}
        if newcomers.also:
            info["unseen_clients"]["also_adapt_epochs"] = list(newcomers.also)
    if plan.num_classes is not None:
        info["num_classes"] = plan.num_classes
    if plan.client_names is not None:  # only data that names its clients: other summaries are unchanged
        info["client_names"] = list(plan.client_names)
    if hasattr(algorithm, "privacy_summary"):  # privacy: the guarantees spent (per client for DP-SGD)
        info["privacy"] = algorithm.privacy_summary(state)
    summary = build_summary(rows, info)
    if "diverged" in summary:
        segment.notify(f"warning: {summary['diverged']}")
    store.write_summary(summary, summary_markdown(summary))
    return RunResult(store.dir, summary, state)


def parameter_counts(
    algorithm: Algorithm, model: torch.nn.Module, state: ServerState, engine: Engine
) -> dict[str, float]:
    held = engine.client_state_shapes()
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


def progress_text(record: RoundRecord) -> str:
    parts = [f"loss {record.train_loss:.3f}"]
    if (acc := record.mean("test_acc")) is not None:
        parts.append(f"acc {acc:.3f}")
    if (val_nll := record.mean("val_nll")) is not None:
        parts.append(f"val_nll {val_nll:.3f}")
    return "  ".join(parts)
