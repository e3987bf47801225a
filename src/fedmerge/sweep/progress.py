"""Live display of a sweep: runs done, running and failed, one bar per running run, and an ETA."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn

from fedmerge.run.results import DONE, FAILED
from fedmerge.sweep.runner import INTERRUPTED, Outcome, SweepRunner


def eta_seconds(elapsed: float, done_work: float, remaining_work: float) -> float | None:
    """Remaining time at the rate observed so far (work in rounds; None before any round ended)."""
    if done_work <= 0:
        return None
    return elapsed * remaining_work / done_work


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "ETA --"
    minutes, sec = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"ETA {hours}:{minutes:02d}:{sec:02d}" if hours else f"ETA {minutes}:{sec:02d}"


class SweepProgress:
    """rich bars when ``live``; otherwise one line per finished run (logs, CI)."""

    def __init__(self, runner: SweepRunner, live: bool = True, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.live = live
        self.runner = runner
        self.todo = runner.todo()
        self.total = len(runner.points)
        self.skipped = self.total - len(self.todo)
        self.start_rounds = {p.key: runner.rounds_done(p) for p in self.todo}
        self.t0 = time.perf_counter()
        self.reported = 0
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            console=self.console,
            disable=not live,
        )
        self.overall = self.progress.add_task("[bold]runs", total=self.total, completed=self.skipped, info="")
        self.bars: dict[str, TaskID] = {}

    def __enter__(self) -> SweepProgress:
        self.progress.start()
        if self.skipped:
            self._print(f"{self.skipped} of {self.total} runs already finished; {len(self.todo)} to run")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.stop()

    def _print(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)

    def update(self, runner: SweepRunner, outcomes: list[Outcome]) -> None:
        counts = {s: sum(o.status == s for o in outcomes) for s in (DONE, FAILED, INTERRUPTED)}
        by_key = {p.key: p for p in self.todo}
        finished = {o.key for o in outcomes}
        done_work = remaining = 0.0
        for p in self.todo:
            total, start = p.config.rounds, self.start_rounds[p.key]
            now = total if p.key in finished else runner.rounds_done(p)
            done_work += max(now - start, 0)
            remaining += max(total - now, 0)
        eta = eta_seconds(time.perf_counter() - self.t0, done_work, remaining)
        info = (
            f"done {self.skipped + counts[DONE]}  running {len(runner.running)}  failed {counts[FAILED]}  "
            f"{format_duration(eta)}"
        )
        self.progress.update(self.overall, completed=self.skipped + len(outcomes), info=info)
        for key in list(self.bars):
            if key not in runner.running:
                self.progress.remove_task(self.bars.pop(key))
        for key in sorted(runner.running):
            p = by_key[key]
            if key not in self.bars:
                self.bars[key] = self.progress.add_task(f"  {key}", total=p.config.rounds, info="rounds")
            self.progress.update(self.bars[key], completed=runner.rounds_done(p))
        for o in outcomes[self.reported :]:
            n = self.skipped + outcomes.index(o) + 1
            tail = f": {o.error}" if o.error else ""
            self._print(f"[{n}/{self.total}] {o.key}: {o.status} ({o.seconds:.0f} s){tail}")
        self.reported = len(outcomes)
