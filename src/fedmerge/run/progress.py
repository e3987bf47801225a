"""Live progress display: round, elapsed time, latest metrics."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class RoundProgress:
    """A rich progress bar advanced per client; the text column shows the latest metrics."""

    def __init__(self, total_rounds: int, start_round: int, clients_per_round: int, enabled: bool = True) -> None:
        self.clients_per_round = max(clients_per_round, 1)
        self.progress = Progress(
            TextColumn("[bold]round {task.fields[round]}/{task.fields[of]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[metrics]}"),
            console=Console(stderr=True),
            disable=not enabled,
        )
        self.task = self.progress.add_task(
            "rounds",
            total=total_rounds,
            completed=start_round,
            round=start_round,
            of=total_rounds,
            metrics="",
        )

    def __enter__(self) -> RoundProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.stop()

    def client_done(self, cid: int) -> None:
        self.progress.advance(self.task, 1.0 / self.clients_per_round * 0.999)

    def round_done(self, rnd: int, text: str) -> None:
        self.progress.update(self.task, completed=rnd, round=rnd, metrics=text)
