"""The single round loop. Engines run client work; algorithms do the math; observers do IO."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .algorithm import Algorithm
from .seeding import numpy_rng
from .types import ClientState, Payload, ServerState, Update

Metrics = dict[str, float]


class RoundFailed(RuntimeError):
    """An engine could not complete a round (e.g. too few clients answered, even after retries)."""


class Engine(Protocol):
    """Where client work runs. The engine holds client data and client states."""

    def fit(self, algorithm: Algorithm, rnd: int, payloads: dict[int, Payload]) -> dict[int, Update]: ...

    def evaluate(self, algorithm: Algorithm, rnd: int, payloads: dict[int, Payload]) -> dict[int, Metrics]: ...

    def evaluate_global(self, algorithm: Algorithm, state: ServerState) -> Metrics | None: ...

    def client_states(self) -> dict[int, ClientState]: ...

    def load_client_states(self, states: dict[int, ClientState]) -> None: ...


@dataclass(frozen=True)
class Schedule:
    rounds: int
    num_clients: int
    participation: float = 1.0
    eval_every: int = 1
    seed: int = 0

    def sample(self, rnd: int) -> list[int]:
        """Clients selected in round ``rnd``: a seeded stream, independent of earlier rounds."""
        m = max(1, int(round(self.participation * self.num_clients)))
        if m >= self.num_clients:
            return list(range(self.num_clients))
        chosen = numpy_rng(self.seed, rnd, purpose="sample").choice(self.num_clients, size=m, replace=False)
        return sorted(int(c) for c in chosen)

    def is_eval_round(self, rnd: int) -> bool:
        return rnd % self.eval_every == 0 or rnd == self.rounds


RoundCallback = Callable[[int, ServerState, dict[str, Any]], None]


def evaluate_all(algorithm: Algorithm, engine: Engine, state: ServerState, rnd: int, num_clients: int) -> dict:
    """Per-client personalised metrics for every client, plus the global model's pooled test."""
    cids = list(range(num_clients))
    per_client = engine.evaluate(algorithm, rnd, algorithm.configure_evaluate(state, rnd, cids))
    return {
        "clients": {int(c): m for c, m in sorted(per_client.items())},
        "global": engine.evaluate_global(algorithm, state),
    }


def run_rounds(
    algorithm: Algorithm,
    engine: Engine,
    schedule: Schedule,
    state: ServerState,
    start_round: int = 0,
    on_round_end: RoundCallback | None = None,
) -> ServerState:
    """Run rounds ``start_round+1 .. schedule.rounds``; ``on_round_end`` logs and checkpoints."""
    for rnd in range(start_round + 1, schedule.rounds + 1):
        t0 = time.perf_counter()
        selected = schedule.sample(rnd)
        payloads = algorithm.configure(state, rnd, selected)
        updates = engine.fit(algorithm, rnd, payloads)
        if not updates:
            raise RuntimeError(f"round {rnd}: no client returned an update")
        state = algorithm.aggregate(state, rnd, updates)
        record: dict[str, Any] = {
            "round": rnd,
            "selected": selected,
            "train_loss": _weighted_train_loss(updates),
            "comm_down": float(np.mean([p.num_parameters() for p in payloads.values()])),
            "comm_up": float(np.mean([u.num_parameters() for u in updates.values()])),
            "fit_seconds": time.perf_counter() - t0,
        }
        gap = local_gap(updates)
        if gap is not None:
            record["local_gap"] = gap
        if schedule.is_eval_round(rnd):
            t1 = time.perf_counter()
            record["eval"] = evaluate_all(algorithm, engine, state, rnd, schedule.num_clients)
            report = algorithm.server_report(state, rnd)
            if report:
                record["server"] = report
            record["eval_seconds"] = time.perf_counter() - t1
        if on_round_end is not None:
            on_round_end(rnd, state, record)
    return state


def _weighted_train_loss(updates: dict[int, Update]) -> float:
    pairs = [(u.meta.get("train_loss"), u.num_examples) for u in updates.values()]
    pairs = [(loss, n) for loss, n in pairs if loss is not None and np.isfinite(loss)]
    if not pairs:
        return float("nan")
    total = sum(n for _, n in pairs)
    return float(sum(loss * n for loss, n in pairs) / max(total, 1))


def local_gap(updates: dict[int, Update]) -> dict[str, float] | None:
    """Mean over the round's clients of the training loss on the model received vs. after local
    training (``loss_received``/``loss_trained`` in Update.meta), and of their difference."""
    pairs = [(u.meta.get("loss_received"), u.meta.get("loss_trained")) for u in updates.values()]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None and np.isfinite(a) and np.isfinite(b)]
    if not pairs:
        return None
    received, trained = (float(np.mean(v)) for v in zip(*pairs))
    return {"received": received, "trained": trained, "gap": float(np.mean([a - b for a, b in pairs]))}
