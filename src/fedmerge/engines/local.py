"""In-process engine: clients run one after another on one reused model object."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fedmerge.core.algorithm import Algorithm, ClientContext, ClientDataLike
from fedmerge.core.seeding import derive_seed
from fedmerge.core.training import predict_logits
from fedmerge.core.types import ClientState, Payload, ServerState, Update
from fedmerge.metrics import classification_metrics

from .evaluation import evaluate_client, seed_global_rng

Metrics = dict[str, float]


class LocalEngine:
    """Runs client updates sequentially in this process.

    Holds the client data (already on ``device``), one model object reused by every client,
    and the ClientState store keyed by client id.
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
    ) -> None:
        self.clients = clients
        self.model = model.to(device)
        self.device = device
        self.seed = seed
        self.pooled_test = pooled_test
        self.eval_batch_size = eval_batch_size
        self.on_client_done = on_client_done
        self._states: dict[int, ClientState] = {}

    # --- client state store --------------------------------------------------------------
    def client_states(self) -> dict[int, ClientState]:
        return self._states

    def load_client_states(self, states: dict[int, ClientState]) -> None:
        self._states = {cid: s.to(self.device) for cid, s in states.items()}

    def _state(self, algorithm: Algorithm, cid: int) -> ClientState:
        if cid not in self._states:
            self._states[cid] = algorithm.init_client_state(cid).to(self.device)
        return self._states[cid]

    def _context(self, rnd: int, cid: int, purpose: str) -> ClientContext:
        # Seed torch's global RNG per (round, client) too, so any module that draws from it
        # (e.g. dropout) is reproducible and independent of client order.
        seed_global_rng(derive_seed(self.seed, rnd, cid, f"global-rng/{purpose}"), self.device)
        return ClientContext(self.model, self.device, self.seed, rnd, cid)

    # --- rounds --------------------------------------------------------------------------
    def fit(self, algorithm: Algorithm, rnd: int, payloads: dict[int, Payload]) -> dict[int, Update]:
        updates: dict[int, Update] = {}
        for cid in sorted(payloads):
            ctx = self._context(rnd, cid, "fit")
            update, new_state = algorithm.client_update(
                payloads[cid].to(self.device), self.clients[cid], self._state(algorithm, cid), ctx
            )
            self._states[cid] = new_state
            updates[cid] = update
            if self.on_client_done is not None:
                self.on_client_done(cid)
        return updates

    def evaluate(self, algorithm: Algorithm, rnd: int, payloads: dict[int, Payload]) -> dict[int, Metrics]:
        results: dict[int, Metrics] = {}
        for cid in sorted(payloads):
            data = self.clients[cid]
            ctx = self._context(rnd, cid, "evaluate")
            payload = payloads[cid].to(self.device)
            state = self._state(algorithm, cid)
            results[cid] = evaluate_client(algorithm, payload, data, state, ctx, self.eval_batch_size)
        return results

    def evaluate_global(self, algorithm: Algorithm, state: ServerState) -> Metrics | None:
        weights = algorithm.global_model(state)
        if weights is None or self.pooled_test is None:
            return None
        x, y = self.pooled_test()
        self.model.load_state_dict({k: v.to(self.device) for k, v in weights.items()})
        logits = predict_logits(self.model, x, self.eval_batch_size)
        return {f"test_{k}": v for k, v in classification_metrics(logits, y).items()}
