"""The single round loop. Engines run client work; algorithms do the math; observers do IO."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Protocol

import numpy as np
import torch

from .algorithm import Algorithm, ClientRows, onboard_meta
from .secure_sum import SummedUpdates
from .seeding import numpy_rng
from .types import ClientState, Payload, ServerState, Update

Metrics = dict[str, float]


class RoundFailed(RuntimeError):
    """An engine could not complete a round (e.g. too few clients answered, even after retries)."""


class Engine(Protocol):
    """Where client work runs. The engine holds client data and client states."""

    def fit(self, algorithm: Algorithm, rnd: int, payloads: dict[int, Payload]) -> dict[int, Update] | SummedUpdates:
        """Each client's update; under secure aggregation, only the round's combination (`SummedUpdates`)."""
        ...

    def evaluate(
        self, algorithm: Algorithm, rnd: int, payloads: dict[int, Payload], *, newcomers: bool = False
    ) -> dict[int, Metrics]:
        """Each client's metrics; with ``newcomers`` the clients never trained: ``algorithm.onboard_variants``
        builds their models from the onboarding payloads, with no client state read, made or kept."""
        ...

    def evaluate_global(self, algorithm: Algorithm, state: ServerState) -> Metrics | None: ...

    def client_states(self) -> dict[int, ClientState]: ...

    def load_client_states(self, states: dict[int, ClientState]) -> None: ...

    # What a run asks of an engine besides the rounds (``fedmerge.run``): one protocol, no probing.
    on_client_done: Callable[[int], None] | None
    """Called with a client id as each client's work in a round finishes (progress display)."""

    def checkpoint_meta(self, keep: int) -> dict[str, Any]:
        """What a checkpoint must hold of this engine (a deployed Flower server: its nodes' state rounds);
        ``keep``: how many checkpoints the run keeps."""
        ...

    def restore(self, meta: dict[str, Any]) -> None:
        """Take back what `checkpoint_meta()` gave, when a run resumes from that checkpoint."""
        ...

    def pop_failures(self) -> list[dict[str, Any]]:
        """The clients dropped since the last call (``{"round", "cid", "reason"}``), then forget them."""
        ...

    def client_state_shapes(self) -> Mapping[int, ClientState]:
        """The client states as a run's summary sizes them: `client_states()` where this process holds
        them; where they stay on their nodes (deployed Flower), stand-ins with their shapes and no values."""
        ...


EVAL_CLIENTS_HELP = "all, participants (that round's) or sample:K (K clients, the same in every round and method)"


def parse_eval_clients(text: str) -> tuple[str, int]:
    """``all`` -> ("all", 0), ``participants`` -> ("participants", 0), ``sample:K`` -> ("sample", K).

    Raises ValueError with a one-line message for anything else (e.g. ``sample:0``, ``sample:x``)."""
    if text in ("all", "participants"):
        return text, 0
    kind, sep, count = text.partition(":")
    if kind == "sample" and sep and count.isdigit() and int(count) > 0:
        return "sample", int(count)
    if kind == "sample" and sep and count.strip().lstrip("+-").isdigit():
        raise ValueError("sample:K needs K >= 1 clients (all: every client)")
    raise ValueError(f"expected {EVAL_CLIENTS_HELP}")


@dataclass(frozen=True)
class Schedule:
    rounds: int
    num_clients: int
    participation: float = 1.0
    eval_every: int = 1
    seed: int = 0
    eval_clients: str = "all"

    def __post_init__(self) -> None:
        parse_eval_clients(self.eval_clients)  # fail at construction, not at the first evaluation

    def sample(self, rnd: int) -> list[int]:
        """Clients selected in round ``rnd``: a seeded stream, independent of earlier rounds."""
        m = max(1, int(round(self.participation * self.num_clients)))
        if m >= self.num_clients:
            return list(range(self.num_clients))
        chosen = numpy_rng(self.seed, rnd, purpose="sample").choice(self.num_clients, size=m, replace=False)
        return sorted(int(c) for c in chosen)

    def is_eval_round(self, rnd: int) -> bool:
        return rnd % self.eval_every == 0 or rnd == self.rounds

    def evaluated(self, rnd: int, selected: list[int]) -> list[int]:
        """Clients whose personalised models are evaluated in round ``rnd`` (``selected``: its participants)."""
        kind, _ = parse_eval_clients(self.eval_clients)
        if kind == "participants":
            return sorted(selected)
        if kind == "sample":
            return list(self._eval_sample)
        return list(range(self.num_clients))

    @cached_property
    def _eval_sample(self) -> tuple[int, ...]:
        # keyed by the seed and a purpose only (no round, no method): every round and every method
        # of an experiment evaluates the same clients, so comparisons stay paired
        _, k = parse_eval_clients(self.eval_clients)
        if k >= self.num_clients:
            return tuple(range(self.num_clients))
        rng = numpy_rng(self.seed, purpose="eval-clients")
        return tuple(sorted(int(c) for c in rng.choice(self.num_clients, size=k, replace=False)))


UNSEEN_EVAL = "eval_unseen"  # a round record's newcomer metrics; eval_unseen_adaptN: the budget N of also_adapt_epochs


@dataclass(frozen=True)
class Newcomers:
    """Clients that never train (``split.unseen_clients``), onboarded at every evaluation round: their engine
    ids (after the ``Schedule``'s participants), their adaptation budget (``unseen.adapt_epochs``) and more
    budgets onboarded from the same server state (``unseen.also_adapt_epochs``)."""

    cids: tuple[int, ...]
    adapt_epochs: int = 0
    also: tuple[int, ...] = ()
    adapt_lr: float | None = None  # unseen.adapt_lr; None: the method's own


RoundCallback = Callable[[int, ServerState, dict[str, Any]], None]


def evaluated_rows(report: dict[str, Any], schedule: Schedule, rnd: int, selected: list[int]) -> dict[str, Any]:
    """The server report as logged: unless every client is evaluated, the per-client matrix
    ``merge_weights`` (one row per client) is logged for the evaluated clients only, as
    ``merge_weights_clients`` ({client id: row}), so that no log row grows with the population."""
    weights = report.get("merge_weights")
    if not isinstance(weights, ClientRows | list) or len(weights) != schedule.num_clients:
        return report
    if schedule.eval_clients == "all":
        return {**report, "merge_weights": list(weights)}
    rows = {str(c): weights[c] for c in schedule.evaluated(rnd, selected)}
    return {**{k: v for k, v in report.items() if k != "merge_weights"}, "merge_weights_clients": rows}


def evaluate_clients(algorithm: Algorithm, engine: Engine, state: ServerState, rnd: int, cids: list[int]) -> dict:
    """Per-client personalised metrics for the clients ``cids``, plus the global model's pooled test."""
    payloads = algorithm.configure_evaluate(state, rnd, cids)
    per_client = engine.evaluate(algorithm, rnd, payloads)
    return {
        "clients": {int(c): m for c, m in sorted(per_client.items())},
        "global": engine.evaluate_global(algorithm, state),
        # the evaluation payloads cross the wire too (the metrics that come back are a few scalars)
        "comm_down": float(np.mean([p.num_values() for p in payloads.values()])) if payloads else 0.0,
    }


def onboard_clients(algorithm: Algorithm, engine: Engine, state: ServerState, rnd: int, newcomers: Newcomers) -> dict:
    """Metrics of the newcomers' models, onboarded from the server state of round ``rnd`` (which they leave as
    it is), and the values each newcomer downloads."""
    sent = algorithm.configure_onboard(state, rnd, list(newcomers.cids))
    meta = onboard_meta(newcomers.adapt_epochs, newcomers.adapt_lr)
    payloads = {c: Payload(p.tensors, {**p.meta, **meta}) for c, p in sent.items()}
    per_client = engine.evaluate(algorithm, rnd, payloads, newcomers=True)
    return {
        "clients": {int(c): m for c, m in sorted(per_client.items())},
        "comm_down": float(np.mean([p.num_values() for p in payloads.values()])) if payloads else 0.0,
    }


def run_rounds(
    algorithm: Algorithm,
    engine: Engine,
    schedule: Schedule,
    state: ServerState,
    start_round: int = 0,
    on_round_end: RoundCallback | None = None,
    newcomers: Newcomers | None = None,
) -> ServerState:
    """Run rounds ``start_round+1 .. schedule.rounds``; ``on_round_end`` logs and checkpoints. ``newcomers``:
    clients outside the schedule, never sampled, onboarded and evaluated (``eval_unseen``) at evaluation rounds."""
    for rnd in range(start_round + 1, schedule.rounds + 1):
        t0 = time.perf_counter()
        selected = algorithm.select_clients(state, rnd, schedule.sample(rnd))
        payloads = algorithm.configure(state, rnd, selected) if selected else {}
        # a round may sample no client (central DP's Poisson sampling): the server still releases its step
        received = engine.fit(algorithm, rnd, payloads) if selected else {}
        if not received and selected:
            raise RoundFailed(f"round {rnd}: no client returned an update")
        secure = isinstance(received, SummedUpdates)
        if secure:  # secure aggregation: the round's combination, each client's metadata, no update
            updates, dropped = secure_view(rnd, received), []
            state = algorithm.aggregate_summed(state, rnd, received)
            values_up = dict(received.values_up)
        else:
            updates, dropped = screen_updates(rnd, received) if received else ({}, [])
            if not updates and selected:
                raise RoundFailed(_all_dropped_message(rnd, algorithm, dropped))
            state = algorithm.aggregate(state, rnd, updates)
            values_up = {cid: u.num_values() for cid, u in received.items()}
        record: dict[str, Any] = {
            "round": rnd,
            "selected": selected,
            "train_loss": _weighted_train_loss(updates),
            # values crossing the wire per client: every tensor value of each payload sent and each
            # update received (mean over the clients); client states never count, they stay put
            "comm_down": _mean([p.num_values() for p in payloads.values()]),
            "comm_up": _mean(list(values_up.values())),
            # the same per client of the round: "up" only for those that replied
            "comm_clients": comm_per_client(payloads, values_up),
            "fit_seconds": time.perf_counter() - t0,
        }
        if secure:
            record["secure_aggregation"] = {"clients": received.clients, "error_bound": received.error_bound}
        if dropped:  # same form as the clients an engine drops (merged with them by the runner)
            record["failed_clients"] = dropped
        gap = local_gap(updates)
        if gap is not None:
            record["local_gap"] = gap
        # every round, not only at evaluations: the server's figures (merge weights) are small and a
        # plot of their trajectory needs them all
        report = algorithm.server_report(state, rnd)
        if report:
            record["server"] = evaluated_rows(report, schedule, rnd, selected)
        if schedule.is_eval_round(rnd):
            t1 = time.perf_counter()
            evaluated = schedule.evaluated(rnd, selected)
            record["eval"] = evaluate_clients(algorithm, engine, state, rnd, evaluated)
            if newcomers is not None and newcomers.cids:
                record[UNSEEN_EVAL] = onboard_clients(algorithm, engine, state, rnd, newcomers)
                for budget in newcomers.also:  # the same state: the budgets differ only in the adaptation
                    other = replace(newcomers, adapt_epochs=budget)
                    record[f"{UNSEEN_EVAL}_adapt{budget}"] = onboard_clients(algorithm, engine, state, rnd, other)
            record["eval_seconds"] = time.perf_counter() - t1
        if on_round_end is not None:
            on_round_end(rnd, state, record)
    return state


def _mean(values: list[int]) -> float:
    return float(np.mean(values)) if values else 0.0


def comm_per_client(payloads: dict[int, Payload], values_up: Mapping[int, int]) -> dict[str, dict[str, int]]:
    """Tensor values sent to (``down``) and received from (``up``) each client of a round, by client id."""
    out: dict[str, dict[str, int]] = {}
    for cid in sorted(payloads):
        out[str(cid)] = {"down": payloads[cid].num_values()}
        if cid in values_up:
            out[str(cid)]["up"] = int(values_up[cid])
    return out


def secure_view(rnd: int, summed: SummedUpdates) -> dict[int, Update]:
    """What the round loop may read per client under secure aggregation: each update's metadata, no tensor.
    The combination is screened instead of the updates (a client screens its own before masking it)."""
    problem = update_problem(summed.combined, None)
    if problem is not None:
        raise RoundFailed(f"round {rnd}: the securely aggregated update is unusable: {problem}")
    return {cid: Update({}, meta) for cid, meta in sorted(summed.metas.items())}


Signature = tuple[tuple[str, tuple[int, ...], torch.dtype], ...]


def _signature(update: Update) -> Signature:
    return tuple(sorted((k, tuple(v.shape), v.dtype) for k, v in update.tensors.items()))


def update_problem(update: Update, expected: Signature | None) -> str | None:
    """Why the server must not aggregate ``update`` (None when it may): a non-finite value, a bad
    sample count, or tensors other than ``expected`` (keys, shapes, dtypes)."""
    n = update.meta.get("num_examples")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        return f"num_examples is {n!r}, not a count"
    floats = {k: v for k, v in update.tensors.items() if v.is_floating_point() or v.is_complex()}
    # A tensor's sum is finite only when every value is (an infinity or a NaN carries through a sum): one
    # read per tensor, 25x faster than an isfinite mask on the CPU, and one device sync per update (per
    # device its tensors are on) when all is well. A non-finite sum is checked value by value: a finite
    # update whose sum overflows (values near the dtype's largest) is not refused.
    checks: dict[torch.device, list[torch.Tensor]] = {}
    for v in floats.values():
        checks.setdefault(v.device, []).append(torch.isfinite(v.sum()))
    if not all(bool(torch.stack(flags).all()) for flags in checks.values()):
        found = next(((k, v) for k, v in floats.items() if not bool(torch.isfinite(v).all())), None)
        if found is not None:
            key, value = found
            bad = int(value.numel() - torch.isfinite(value).sum())
            return f"{bad} non-finite value(s) in {key!r} (local training diverged?)"
    if expected is None:
        return None
    got = _signature(update)
    if got == expected:
        return None
    want, have = {k: (s, d) for k, s, d in expected}, {k: (s, d) for k, s, d in got}
    missing, extra = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
    if missing or extra:
        return f"tensors differ from the other clients' (missing {missing[:3]}, unexpected {extra[:3]})"
    key = next(k for k in sorted(want) if want[k] != have[k])
    return f"tensor {key!r} is {have[key][0]} {have[key][1]}, the other clients' are {want[key][0]} {want[key][1]}"


def screen_updates(rnd: int, updates: dict[int, Update]) -> tuple[dict[int, Update], list[dict[str, Any]]]:
    """Split a round's updates into those the server may aggregate and the dropped ones, recorded as
    ``{"round", "cid", "phase": "update", "reason"}``. Every client of a round runs the same method, so
    the tensors (keys, shapes, dtypes) that more than half of the updates share are the expected ones."""
    signatures = {cid: _signature(u) for cid, u in updates.items()}
    counts: dict[Signature, int] = {}
    for sig in signatures.values():
        counts[sig] = counts.get(sig, 0) + 1
    majority = max(counts, key=counts.__getitem__)
    expected = majority if 2 * counts[majority] > len(updates) else None
    good: dict[int, Update] = {}
    dropped: list[dict[str, Any]] = []
    for cid in sorted(updates):
        problem = update_problem(updates[cid], expected)
        if problem is None:
            good[cid] = updates[cid]
        else:
            dropped.append({"round": rnd, "cid": cid, "phase": "update", "reason": problem})
    return good, dropped


def _all_dropped_message(rnd: int, algorithm: Algorithm, dropped: list[dict[str, Any]]) -> str:
    lr = getattr(getattr(algorithm, "config", None), "lr", None)
    lower = f"a smaller algorithm.lr (now {lr:g})" if isinstance(lr, float) else "a smaller algorithm.lr"
    first = dropped[0]
    return (
        f"round {rnd}: the updates of all {len(dropped)} clients were dropped (client {first['cid']}: "
        f"{first['reason']}); try {lower}"
    )


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
