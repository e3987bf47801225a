"""In-process engine: clients run one after another on one reused model object, or on one model
object in each of ``workers`` forked worker processes (`workers`), with the same numbers.

With workers, evaluation splits like this: clients whose personalised model is a payload they share
with other clients (a global-model method's) are evaluated here in one grouped pass
(`grouped_eval`), which is less work than one pass per client in any number of processes;
clients with personalised models are evaluated in the workers."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from fedmerge.core.algorithm import Algorithm, ClientContext, ClientDataLike, Predictor, StateDict, for_newcomer
from fedmerge.core.model_state import load_state
from fedmerge.core.params import clone_state
from fedmerge.core.seeding import derive_seed
from fedmerge.core.state_store import MemoryStates, StoredStates
from fedmerge.core.training import predict_logits
from fedmerge.core.types import ClientState, Payload, ServerState, Update
from fedmerge.metrics import classification_metrics

from .evaluation import evaluate_client, is_generative, seed_global_rng
from .grouped_eval import GroupedEvaluator, Prepare, even_batches, forward_batches, payload_weights
from .schedule import largest_first, split_rows
from .vectorized import fit_vectorized
from .workers import WorkerPool

Metrics = dict[str, float]


class LocalEngine:
    """Runs client updates sequentially in this process, or in ``workers`` worker processes.

    Holds the client data (already on ``device``), one model object reused by every client,
    and the ClientState store keyed by client id (a dict, or ``states``: an on-disk
    `StoredStates`). Worker processes are forked on the first call
    and inherit all of it; the states stay here and travel with each task. Use the engine as a
    context manager (or call `close()`) to stop the workers.

    ``min_round_seconds`` (``workers: auto``): clients are trained here, timed, until the clients of a
    round trained here have taken that long ([`round_work()`][fedmerge.engines.local.round_work]); the round's other
    clients and everything
    after go to the workers. 0: the workers from the first round.
    """

    def __init__(
        self,
        clients: list[ClientDataLike],
        model: nn.Module,
        device: torch.device,
        seed: int,
        pooled_test: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None,
        eval_batch_size: int = 1024,
        on_client_done: Callable[[int], None] | None = None,
        workers: int = 1,
        states: StoredStates | None = None,
        vectorize: bool = False,
        min_round_seconds: float = 0.0,
    ) -> None:
        self.clients = clients
        self.model = model.to(device)
        self.device = device
        self.seed = seed
        self.pooled_test = pooled_test
        self.eval_batch_size = eval_batch_size
        self.on_client_done = on_client_done
        self._states: MemoryStates | StoredStates = MemoryStates() if states is None else states
        self.workers = workers
        self.min_round_seconds = min_round_seconds
        self.parallel_from: int | None = None  # the first round whose clients ran in the workers
        self._parallel = workers > 1 and min_round_seconds <= 0
        self.vectorize = vectorize  # train the round's clients as one batched computation (vectorized.py)
        self._pool: WorkerPool | None = None
        self._pool_algorithm: Algorithm | None = None
        self._evaluator = GroupedEvaluator(clients, self.model, eval_batch_size, self._forward_in_workers)
        self._pooled: tuple[torch.Tensor, torch.Tensor] | None = None  # the pooled test, made once
        self._rows: list[tuple[int, int, int]] | None = None  # each client's split sizes, for the workers' order

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker processes, if any (a later call forks new ones)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = self._pool_algorithm = None

    # --- client state store --------------------------------------------------------------
    def client_states(self) -> MemoryStates | StoredStates:
        return self._states

    def load_client_states(self, states: dict[int, ClientState]) -> None:
        self._states = MemoryStates({cid: s.to(self.device) for cid, s in states.items()})

    # --- what a run asks besides the rounds (core.loop.Engine) ---------------------------
    def checkpoint_meta(self, keep: int) -> dict[str, Any]:
        return {}  # every client state is in this process: the checkpoint holds them itself

    def restore(self, meta: dict[str, Any]) -> None:
        pass

    def client_state_shapes(self) -> MemoryStates | StoredStates:
        return self._states

    def pop_failures(self) -> list[dict[str, Any]]:
        return []  # a client that raises here is a bug and stops the run; the round loop drops bad updates

    def _context(self, rnd: int, cid: int, purpose: str) -> ClientContext:
        # Seed torch's global RNG per (round, client) too, so any module that draws from it
        # (e.g. dropout) is reproducible and independent of client order.
        seed_global_rng(derive_seed(self.seed, rnd, cid, f"global-rng/{purpose}"), self.device)
        return ClientContext(self.model, self.device, self.seed, rnd, cid)

    # --- one client's work (here or in a worker process) ------------------------------------
    def _fit_one(
        self, algorithm: Algorithm, rnd: int, cid: int, payload: Payload, state: ClientState | None
    ) -> tuple[Update, ClientState]:
        ctx = self._context(rnd, cid, "fit")
        payload = payload.to(self.device)
        # A new client's state is made after seeding, as an initialiser drawing from torch's global RNG expects.
        if state is None:
            state = algorithm.init_client_state(cid).to(self.device)
        return algorithm.client_update(payload, self.clients[cid], state, ctx)

    def _evaluate_one(
        self, algorithm: Algorithm, rnd: int, cid: int, payload: Payload, state: ClientState | None
    ) -> tuple[Metrics, ClientState | None]:
        """The client's metrics, and its state when it had none yet (evaluation changes no state)."""
        ctx = self._context(rnd, cid, "evaluate")
        payload = payload.to(self.device)
        new = algorithm.init_client_state(cid).to(self.device) if state is None else None
        return evaluate_client(algorithm, payload, self.clients[cid], state or new, ctx, self.eval_batch_size), new

    def _onboard_one(
        self, algorithm: Algorithm, rnd: int, cid: int, payload: Payload, state: ClientState | None
    ) -> tuple[Metrics, None]:
        """A newcomer's metrics: its models come from ``algorithm.onboard_variants``; it has no state and keeps none."""
        return self.onboard_client(algorithm, rnd, cid, payload)[0], None

    def onboard_client(
        self, algorithm: Algorithm, rnd: int, cid: int, payload: Payload, keep: bool = False
    ) -> tuple[Metrics, dict[str, StateDict | Predictor]]:
        """Newcomer ``cid``'s metrics and, with ``keep``, the models they were measured on (state dicts copied
        before evaluation loads them into the shared model): what a deployed newcomer saves on its own disk."""
        ctx = self._context(rnd, cid, "onboard")
        payload = payload.to(self.device)
        data = self.clients[cid]
        variants = for_newcomer(algorithm, payload).onboard_variants(payload, data, ctx)
        kept = {name: w if callable(w) else clone_state(w) for name, w in variants.items()} if keep else {}
        return evaluate_client(algorithm, payload, data, ClientState(), ctx, self.eval_batch_size, variants), kept

    def _batches_one(
        self,
        algorithm: Algorithm,
        rnd: int,
        part: int,
        payload: Payload,
        rows: tuple[torch.Tensor, tuple[int, ...], list[int]],
    ) -> torch.Tensor:
        """Logits of the weights ``payload`` on the rows ``rows[0]``, laid out with the strides ``rows[1]`` (as in the
        sending process: a convolution takes another kernel for another layout, e.g. channels-last strides,
        which changes the last bits), in the batches that end at ``rows[2]``."""
        x, strides, ends = rows
        if x.stride() != strides:
            x = torch.empty_strided(x.shape, strides, dtype=x.dtype).copy_(x)
        load_state(self.model, payload.tensors)
        return forward_batches(self.model, x, ends)

    def _run_task(self, algorithm: Algorithm, kind: str, rnd: int, cid: int, payload: Payload, state: Any) -> Any:
        one = {
            "fit": self._fit_one,
            "evaluate": self._evaluate_one,
            "onboard": self._onboard_one,
            "forward": self._batches_one,
        }[kind]
        return one(algorithm, rnd, cid, payload, state)

    def _forward_in_workers(
        self, weights: dict[str, torch.Tensor], x: torch.Tensor, ends: list[int] | None
    ) -> torch.Tensor | None:
        """``forward_batches`` of the model with ``weights`` on ``x`` (batches ending at rows ``ends``), its batches
        shared out among the worker processes once they run, or None when they do not (the caller predicts here).

        Each worker predicts a run of whole batches, as this process would, with one thread as here: the logits
        are those of this process bit for bit (a global model's evaluation pass no longer runs on one core while
        the others wait). ``ends`` None: the rows may be cut into any batches (`even_batches`): each worker
        predicts an equal share of them."""
        if self._pool is None or not self._parallel or self.device.type != "cpu":
            return None
        if ends is None:
            runs = even_batches(int(x.shape[0]), self.workers, self.eval_batch_size)
            if runs is None:
                return None
            cuts = [0, *itertools.accumulate(r[-1] for r in runs)]
        else:
            if len(ends) < 2:
                return None
            parts = min(self.workers, len(ends))
            at = [len(ends) * i // parts for i in range(parts + 1)]  # batch indices: runs of about equal rows
            cuts = [0, *(ends[at[i + 1] - 1] for i in range(parts))]
            runs = [[e - cuts[i] for e in ends[at[i] : at[i + 1]]] for i in range(parts)]
        payload = Payload(weights)
        tasks = []
        for i, run in enumerate(runs):
            part = x[cuts[i] : cuts[i + 1]]  # sent contiguous: its strides travel with it
            tasks.append(("forward", 0, i, payload, (part, part.stride(), run)))
        out = self._pool.map(tasks)
        return torch.cat([out[i] for i in range(len(runs))])

    @property
    def workers_used(self) -> int:
        """Worker processes that ran clients so far (1: every client ran in this process)."""
        return self.workers if self.parallel_from is not None else 1

    def _workers_pay(self, seconds: list[float]) -> bool:
        """Whether the clients of a round timed here (``seconds``) took long enough to move to the workers."""
        return self.workers > 1 and len(seconds) >= 2 and round_work(seconds) >= self.min_round_seconds

    def _map(
        self,
        algorithm: Algorithm,
        kind: str,
        rnd: int,
        payloads: dict[int, Payload],
        on_result: Callable[[int, Any], None],
        timed: bool = False,
    ) -> None:
        """Run ``kind`` for each client, here in client-id order or in the workers largest first; ``on_result``
        receives each client's result (in the workers' case, in the order they finish). ``timed``: clients
        run here are timed, and once they took ``min_round_seconds`` the others go to the workers."""
        if not self._parallel:
            order, seconds = sorted(payloads), []
            while order and not (timed and self._workers_pay(seconds)):
                cid = order.pop(0)
                start = time.perf_counter()
                result = self._run_task(algorithm, kind, rnd, cid, payloads[cid], self._states.get(cid))
                seconds.append(time.perf_counter() - start)
                on_result(cid, result)
            if timed and self._workers_pay(seconds):
                self._parallel = True  # the round's other clients, if any, and every later call
            if not order:
                return
            payloads = {cid: payloads[cid] for cid in order}
        if self.parallel_from is None:
            self.parallel_from = rnd
        if self._pool_algorithm is not algorithm:
            self.close()
            self._pool = WorkerPool(self.workers, partial(self._run_task, algorithm))
            self._pool_algorithm = algorithm
        if self._rows is None:
            self._rows = split_rows(self.clients)
        # largest first: no large client left to run alone at the end (schedule.py); results are by client id
        order = largest_first(kind, payloads, self._rows)
        self._pool.map([(kind, rnd, cid, payloads[cid], self._states.get(cid)) for cid in order], on_result)

    # --- rounds --------------------------------------------------------------------------
    def fit(self, algorithm: Algorithm, rnd: int, payloads: dict[int, Payload]) -> dict[int, Update]:
        updates: dict[int, Update] = {}

        def done(cid: int, result: tuple[Update, ClientState]) -> None:
            updates[cid] = result[0]
            self._states.put(cid, result[1], rnd)
            if self.on_client_done is not None:
                self.on_client_done(cid)

        if self.vectorize:

            def prepare(cid: int) -> tuple[ClientContext, Payload, ClientState]:
                ctx = self._context(rnd, cid, "fit")  # seeded first, as _fit_one does
                state = self._states.get(cid)
                if state is None:
                    state = algorithm.init_client_state(cid).to(self.device)
                return ctx, payloads[cid].to(self.device), state

            for cid, result in fit_vectorized(algorithm, self.model, self.clients, sorted(payloads), prepare).items():
                done(cid, result)
        else:
            self._map(algorithm, "fit", rnd, payloads, done, timed=True)
        return {cid: updates[cid] for cid in sorted(updates)}

    def evaluate(
        self, algorithm: Algorithm, rnd: int, payloads: dict[int, Payload], *, newcomers: bool = False
    ) -> dict[int, Metrics]:
        if newcomers:  # one by one, here or in the workers; no state is read or written
            onboarded: dict[int, Metrics] = {}
            self._map(algorithm, "onboard", rnd, payloads, lambda cid, result: onboarded.__setitem__(cid, result[0]))
            return {cid: onboarded[cid] for cid in sorted(onboarded)}

        def prepare(cid: int) -> tuple[ClientContext, Payload, ClientState]:
            ctx = self._context(rnd, cid, "evaluate")
            payload = payloads[cid].to(self.device)
            state = self._states.get(cid)
            if state is None:  # a new client's state is kept, as on the per-client path
                state = algorithm.init_client_state(cid).to(self.device)
                self._states.put(cid, state, rnd)
            return ctx, payload, state

        results: dict[int, Metrics] = {}
        if self.device.type == "cpu":  # same numbers, less work: see grouped_eval
            if not self._parallel:
                return self._evaluator.evaluate(algorithm, payloads, prepare)
            here, results = self._evaluated_here(algorithm, payloads, prepare)
            if here:
                results.update(self._evaluator.evaluate(algorithm, {c: payloads[c] for c in here}, prepare))

        def done(cid: int, result: tuple[Metrics, ClientState | None]) -> None:
            results[cid], new_state = result
            if new_state is not None:
                self._states.put(cid, new_state, rnd)

        rest = {cid: p for cid, p in payloads.items() if cid not in results}
        if rest:
            self._map(algorithm, "evaluate", rnd, rest, done)
        return {cid: results[cid] for cid in sorted(results)}

    def _evaluated_here(
        self, algorithm: Algorithm, payloads: dict[int, Payload], prepare: Prepare
    ) -> tuple[list[int], dict[int, Metrics]]:
        """With workers: (the clients to evaluate here in a grouped pass, metrics already made here).

        Clients that share one payload are grouped here when the personalised model of the first of them
        is that payload (a global-model method); when it is not, that client, whose personalised model is
        made, is evaluated here too, and the others go to the workers."""
        shared: dict[tuple[int, ...], list[int]] = {}
        for cid in sorted(payloads):
            shared.setdefault(tuple(id(t) for t in payloads[cid].tensors.values()), []).append(cid)
        here: list[int] = []
        done: dict[int, Metrics] = {}
        for cids in shared.values():
            if len(cids) < 2 or not self._evaluator.grouping:
                continue
            ctx, payload, state = prepare(cids[0])
            variants = algorithm.personalize_variants(payload, self.clients[cids[0]], state, ctx)
            if payload_weights(variants, payload) is not None:
                here += cids
            else:
                data = self.clients[cids[0]]
                done[cids[0]] = evaluate_client(algorithm, payload, data, state, ctx, self.eval_batch_size, variants)
        return here, done

    def evaluate_global(self, algorithm: Algorithm, state: ServerState) -> Metrics | None:
        weights = algorithm.global_model(state)
        if weights is None or self.pooled_test is None or is_generative(self.model):
            return None  # a generative model's clients' figures are the global model's on their splits
        if self._pooled is None:  # the data never change: concatenate once
            self._pooled = self.pooled_test()
        x, y = self._pooled
        logits = self._evaluator.pooled_test_logits(weights, x, y)
        if logits is None and x.shape[0]:
            n, bs = int(x.shape[0]), self.eval_batch_size
            logits = self._forward_in_workers(weights, x, [*range(bs, n, bs), n])  # predict_logits's batches
        if logits is None:
            self.model.load_state_dict({k: v.to(self.device) for k, v in weights.items()})
            logits = predict_logits(self.model, x, self.eval_batch_size)
        return {f"test_{k}": v for k, v in classification_metrics(logits, y).items()}


def round_work(seconds: list[float]) -> float:
    """The work of the clients timed here: the first is left out (in a fresh process it carries one-time
    costs, e.g. torch's optimizer importing its compiler: seconds) and the others' mean stands for it."""
    if len(seconds) < 2:
        return sum(seconds)
    return sum(seconds[1:]) * len(seconds) / (len(seconds) - 1)
