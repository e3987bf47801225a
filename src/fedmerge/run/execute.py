"""Run a plan: open its engine (and client-state store), start or resume, then the recorded round loop."""

from __future__ import annotations

from fedmerge.engines.memory import keep_freed_memory
from fedmerge.run.engine_setup import client_store, open_engine
from fedmerge.run.plan import RunPlan
from fedmerge.run.recorder import RunResult, Segment, record_rounds
from fedmerge.run.results import RunStore
from fedmerge.run.setup import ResumePoint, start_segment


def execute(plan: RunPlan, store: RunStore, point: ResumePoint | None, segment: Segment) -> RunResult:
    """Run ``plan``'s rounds in ``store`` (a resume from ``point``). A Ctrl-C or an OS error (a full disk) leaves
    with the run folder on the exception (``run_dir``), so that the caller can say how to continue it."""
    cfg = plan.cfg
    if cfg.keep_freed_memory:
        keep_freed_memory()  # before the engine forks its workers: they inherit it
    try:
        with (
            client_store(cfg, store) as states,
            open_engine(
                cfg, plan.data, plan.model, plan.device, plan.source.grid, states, plan.federation, plan.workers,
                plan.pooled_test,
            ) as engine,
        ):  # fmt: skip
            start = start_segment(plan, store, engine, states, point, segment.notify)
            return record_rounds(plan, store, engine, start, segment, states)
    except (KeyboardInterrupt, OSError) as exc:
        exc.run_dir = store.dir  # type: ignore[union-attr]
        raise
