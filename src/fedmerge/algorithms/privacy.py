"""Differential privacy around any method that admits it: the ``privacy:`` section (docs/deployment.md, "Privacy").

[`PrivateAlgorithm`][fedmerge.algorithms.privacy.PrivateAlgorithm] wraps a method and adds, without changing it:

- ``dp_sgd`` (sample-level DP on each client): the client's local training runs DP-SGD
  ([`PrivateGradients`][fedmerge.core.privacy.PrivateGradients] through ``ctx.private``) on Poisson batches; the client
  keeps its own RDP ledger in its state (``meta["privacy"]``) and reports its epsilon with its update.
- ``central`` (user-level DP on the server): clients take part by Poisson sampling at rate ``participation``
  (drawn from the server's secret), each update's change to the server's tensors is clipped to a norm (fixed,
  or adapted towards a quantile of the norms as in Andrew et al. 2021), the clipped changes are summed, divided
  by the *expected* number of clients ``participation * N``, and Gaussian noise is added; the server's RDP
  ledger (in its state's meta) composes the rounds. ``clip_on_client``: each client clips its own change before
  sending it (as Flower's client-side DP mod); the server still clips (a no-op for honest clients).

Under either mechanism an update carries no metadata computed on raw data (`PUBLIC_META` only).

The noise (and the private samples) come from a secret that only the party adding the noise holds: each
client's in its own state (on a deployed node, its own disk), the server's in the server state. Both are
drawn from the operating system's random source, so the same command twice gives different noise, and a
resumed run continues from the secrets in its checkpointed states. ``reproducible_noise: true`` derives them
from the seed instead (the same numbers on every engine and worker count, for tests and studies); such a
run is not private, and its summary and reports say so.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from functools import cached_property
from typing import Any

import torch

from fedmerge.algorithms.privacy_report import book_client, round_figures, run_guarantees
from fedmerge.algorithms.privacy_report import redact_participants as redact_participants
from fedmerge.algorithms.privacy_settings import (
    BIT_KEY,
    CLIP_KEY,
    KEY,
    PUBLIC_META,
    SECRET_KEY,
    PrivacySettings,
    adaptive_noise_multiplier,
)
from fedmerge.core.algorithm import (
    ALGORITHMS,
    Algorithm,
    AlgorithmConfig,
    ClientContext,
    ClientDataLike,
    ModelFactory,
    StateDict,
)
from fedmerge.core.privacy import (
    Ledger,
    NoiseSource,
    PrivateGradients,
    clip_to_norm,
    new_secret,
    noise_for_epsilon,
    reproducible_secret,
    sample_rate,
)
from fedmerge.core.secure_sum import SummedUpdates
from fedmerge.core.seeding import NO_CLIENT
from fedmerge.core.training import planned_steps
from fedmerge.core.types import ClientState, Payload, ServerState, Update


class PrivateAlgorithm(Algorithm):
    """``inner`` with the mechanisms of ``settings``; every other call goes to ``inner`` unchanged.

    ``participation``: the fraction of clients a round samples (central DP's Poisson rate)."""

    vectorizable = False

    def __init__(
        self, inner: Algorithm, settings: PrivacySettings, rounds: int, participation: float = 1.0
    ) -> None:  # fmt: skip
        super().__init__(inner.config, inner.model_factory, inner.num_clients, inner.seed)
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        self.settings = settings
        self.rounds = rounds
        self.participation = float(participation)
        self._sigma_by_n: dict[int, float] = {}

    def __getattr__(self, item: str) -> Any:  # attributes of the method itself (e.g. FedMerge's layout)
        if item == "inner":
            raise AttributeError(item)
        return getattr(self.inner, item)

    @property
    def private(self) -> bool:
        """Whether the noise is secret (False only with ``reproducible_noise``)."""
        return not self.settings.reproducible_noise

    def _secret(self, owner: str) -> str:
        return reproducible_secret(self.seed, owner) if self.settings.reproducible_noise else new_secret()

    # --- the inner method's records, without what this wrapper adds ---------------------------
    @staticmethod
    def _without(record: Any) -> Any:
        if KEY not in record.meta and SECRET_KEY not in record.meta:
            return record
        return type(record)(record.tensors, {k: v for k, v in record.meta.items() if k not in (KEY, SECRET_KEY)})

    @staticmethod
    def _book(state: ServerState) -> dict[str, Any]:
        return copy.deepcopy(state.meta.get(KEY, {}))

    # --- server side ---------------------------------------------------------------------------
    def init_server_state(self) -> ServerState:
        state = self.inner.init_server_state()
        book: dict[str, Any] = {}
        meta = {**state.meta}
        if self.settings.central is not None:
            book["central"] = {"clip": self.settings.central.clip, "history": []}
            meta[SECRET_KEY] = self._secret("server")  # checkpointed with the state; never reported
        if self.settings.dp_sgd is not None:
            book["dp_sgd"] = {"epsilon": {}, "clients": []}
        return ServerState(state.tensors, {**meta, KEY: book})

    @property
    def poisson_clients(self) -> bool:
        """Central DP samples the clients itself (Poisson at rate ``participation``) when not all take part."""
        return self.settings.central is not None and self.participation < 1.0

    def select_clients(self, state: ServerState, rnd: int, scheduled: list[int]) -> list[int]:
        if not self.poisson_clients:
            return self.inner.select_clients(self._without(state), rnd, scheduled)
        noise = NoiseSource(str(state.meta[SECRET_KEY]), rnd, NO_CLIENT, "central-sample")
        return [int(c) for c in noise.poisson_sample(self.num_clients, self.participation).tolist()]

    def configure(self, state: ServerState, rnd: int, selected: list[int]) -> dict[int, Payload]:
        payloads = self.inner.configure(self._without(state), rnd, selected)
        central = self.settings.central
        if central is None or not central.clip_on_client:
            return payloads
        clip = self._book(state)["central"]["clip"]
        return {cid: Payload(p.tensors, {**p.meta, CLIP_KEY: clip}) for cid, p in payloads.items()}

    def configure_evaluate(self, state: ServerState, rnd: int, cids: list[int]) -> dict[int, Payload]:
        return self.inner.configure_evaluate(self._without(state), rnd, cids)

    def global_model(self, state: ServerState) -> StateDict | None:
        return self.inner.global_model(self._without(state))

    def client_optimized_parameters(self, model_parameters: int, client_states: Any) -> float:
        return self.inner.client_optimized_parameters(model_parameters, client_states)

    # --- secure aggregation (with DP-SGD; central DP is refused): the inner method's rule ----------
    def secure_weight(self, meta: dict[str, Any]) -> float:
        return self.inner.secure_weight(meta)

    def secure_summed(self, key: str) -> bool:
        return self.inner.secure_summed(key)

    def aggregate_summed(self, state: ServerState, rnd: int, summed: SummedUpdates) -> ServerState:
        assert self.settings.central is None, "central DP clips each update: refused with secure aggregation"
        book = self._book(state)
        if self.settings.dp_sgd is not None:  # each client's epsilon travels in the clear with its metadata
            ledger = book["dp_sgd"]
            for cid in summed.clients:
                book_client(ledger, cid, summed.metas[cid][KEY])
            ledger["clients"] = summed.clients
        new = self.inner.aggregate_summed(self._without(state), rnd, summed)
        return ServerState(new.tensors, {**new.meta, **self._kept_meta(state), KEY: book})

    @staticmethod
    def _kept_meta(state: ServerState) -> dict[str, Any]:
        return {SECRET_KEY: state.meta[SECRET_KEY]} if SECRET_KEY in state.meta else {}

    def aggregate(self, state: ServerState, rnd: int, updates: dict[int, Update]) -> ServerState:
        book = self._book(state)
        inner_state = self._without(state)
        if self.settings.dp_sgd is not None:
            ledger = book["dp_sgd"]
            for cid in sorted(updates):
                book_client(ledger, cid, updates[cid].meta[KEY])
            ledger["clients"] = sorted(updates)
        if self.settings.central is None:
            new = self.inner.aggregate(inner_state, rnd, updates)
        else:
            noise = NoiseSource(str(state.meta[SECRET_KEY]), rnd, NO_CLIENT, "central-dp")
            new = self._central_aggregate(inner_state, rnd, updates, book["central"], noise)
        return ServerState(new.tensors, {**new.meta, **self._kept_meta(state), KEY: book})

    @cached_property
    def central_noise_multiplier(self) -> float:
        """The noise multiplier of the server's whole mechanism (updates and, adaptive, the clip count)."""
        c = self.settings.central
        assert c is not None
        if c.noise_multiplier is not None:
            return c.noise_multiplier
        return noise_for_epsilon(c.target_epsilon, c.delta, self.client_rate, self.rounds)

    @property
    def client_rate(self) -> float:
        """Central DP's sampling rate: each client takes part in a round with this probability."""
        return self.participation

    @property
    def expected_clients(self) -> float:
        """Central DP's divisor: the expected number of clients of a round (a constant, so that adding or
        removing one client's data moves the noised mean by at most ``clip / expected_clients``)."""
        return self.participation * self.num_clients

    def count_stddev(self) -> float:
        c = self.settings.central
        assert c is not None
        return c.clip_count_stddev if c.clip_count_stddev is not None else self.expected_clients / 20

    def update_noise_multiplier(self) -> float:
        c = self.settings.central
        assert c is not None
        z = self.central_noise_multiplier
        if not c.adaptive or z == 0:
            return z
        return adaptive_noise_multiplier(z, self.count_stddev())

    def _sent_keys(self, state: ServerState, rnd: int, updates: dict[int, Update]) -> list[str]:
        """The float tensors the clients send (and the noise covers): from an update, or, in a round that
        sampled no client, from what the method would send."""
        sample = updates[min(updates)].tensors if updates else self.inner.configure(state, rnd, [0])[0].tensors
        return sorted(k for k, v in sample.items() if v.is_floating_point())

    def _central_aggregate(
        self, state: ServerState, rnd: int, updates: dict[int, Update], book: dict[str, Any], noise: NoiseSource
    ) -> ServerState:
        c = self.settings.central
        assert c is not None
        bound = float(book["clip"])
        old = state.tensors
        clipped: dict[int, Update] = {}
        unclipped = 0
        for cid in sorted(updates):
            update = updates[cid]
            change = {k: v - old[k] for k, v in update.tensors.items() if v.is_floating_point()}
            if any(k not in old for k in update.tensors):
                raise RuntimeError(f"{self.name}: central DP needs each update's tensors to be server-state tensors")
            change, norm = clip_to_norm(change, bound)
            within = bool(update.meta.get(BIT_KEY, False)) if c.clip_on_client else norm <= bound
            unclipped += int(within)
            tensors = {**update.tensors, **{k: old[k] + v for k, v in change.items()}}
            clipped[cid] = Update(tensors, {**update.meta, "num_examples": 1})  # a uniform mean
        keys = self._sent_keys(state, rnd, updates)
        m, expected = len(updates), self.expected_clients
        if m:  # the method's mean of the m clipped updates, turned into their sum over the expected count
            new = self.inner.aggregate(state, rnd, clipped)
            scale = m / expected
            tensors = dict(new.tensors)
            for k in keys:
                tensors[k] = old[k] + (tensors[k] - old[k]) * scale
            meta = dict(new.meta)
        else:  # no client sampled: the release is the old state plus noise
            tensors, meta = dict(old), dict(state.meta)
        std = self.update_noise_multiplier() * bound / expected
        for k in keys:
            tensors[k] = tensors[k] + noise.normal(tensors[k].shape, std, tensors[k].dtype).to(tensors[k].device)
        ledger = Ledger(book["history"])
        ledger.add(self.central_noise_multiplier, self.client_rate, 1)
        book["last"] = {
            "round": rnd,
            "clip": bound,
            "noise_std": std,
            "noise_multiplier": self.central_noise_multiplier,
            "epsilon": ledger.epsilon(c.delta),
        }
        if c.adaptive:
            count = unclipped + float(noise.normal((1,), self.count_stddev(), torch.float64)[0])
            fraction = count / expected
            book["clip"] = bound * math.exp(-c.clip_lr * (fraction - c.target_quantile))
            book["last"]["unclipped_fraction"] = fraction  # noised: safe to publish
        return ServerState(tensors, meta)

    def server_report(self, state: ServerState, rnd: int) -> dict[str, Any]:
        report = dict(self.inner.server_report(self._without(state), rnd))
        report[KEY] = round_figures(self._book(state), self.settings, self.private, self.poisson_clients)
        return report

    def privacy_summary(self, state: ServerState) -> dict[str, Any]:
        """The run's guarantees at its end (``summary.json``'s ``privacy``; ``privacy_report.run_guarantees``)."""
        book = self._book(state)
        z = self.central_noise_multiplier if "central" in book else None
        return run_guarantees(book, self.settings, self.private, z, self.client_rate)

    def noise_problem(self, train_sizes: list[int]) -> str | None:
        """Why the noise cannot be set as configured (one line), or None. ``train_sizes``: the clients'
        training-set sizes where the server knows them (the smallest needs the most noise for a target)."""
        dp, sizes = self.settings.dp_sgd, [n for n in train_sizes if n > 0]
        checks = {
            "central": self.update_noise_multiplier if self.settings.central is not None else None,
            "dp_sgd": (lambda: self.dp_sgd_noise_multiplier(min(sizes)))
            if dp is not None and dp.target_epsilon is not None and sizes
            else None,
        }
        for section, check in checks.items():
            if check is None:
                continue
            try:
                check()
            except ValueError as exc:  # Opacus: "The privacy budget is too low."
                text = str(exc).splitlines()[0]
                return text if text.startswith("privacy.") else f"privacy.{section}: {text}"
        return None

    # --- client side ---------------------------------------------------------------------------
    def init_client_state(self, cid: int) -> ClientState:
        return self.inner.init_client_state(cid)

    def dp_sgd_noise_multiplier(self, n: int) -> float:
        """The client's DP-SGD noise multiplier: the configured one, or the one that spends
        ``target_epsilon`` in ``rounds`` rounds of plain local SGD on its ``n`` samples."""
        dp = self.settings.dp_sgd
        assert dp is not None
        if dp.noise_multiplier is not None:
            return dp.noise_multiplier
        if n not in self._sigma_by_n:
            steps = self.rounds * planned_steps(n, self.config)
            self._sigma_by_n[n] = noise_for_epsilon(dp.target_epsilon, dp.delta, self.sample_rate(n), steps)
        return self._sigma_by_n[n]

    def sample_rate(self, n: int) -> float:
        return sample_rate(n, self.config.batch_size)

    def client_update(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> tuple[Update, ClientState]:
        dp = self.settings.dp_sgd
        history = state.meta.get(KEY, {}).get("dp_sgd", [])
        n = int(data.y_train.shape[0])
        private = None
        secret = None
        if dp is not None:  # the client's own secret: made on first use, kept in its state, never sent
            secret = str(state.meta.get(SECRET_KEY) or self._secret(f"client-{ctx.cid}"))
            sigma = self.dp_sgd_noise_multiplier(n)
            private = PrivateGradients(dp.clip, sigma, NoiseSource(secret, ctx.round, ctx.cid, "dp-sgd"))
            ctx = replace(ctx, private=private)
        update, new_state = self.inner.client_update(payload, data, self._without(state), ctx)
        meta = {k: v for k, v in update.meta.items() if k in PUBLIC_META}  # nothing computed on raw data
        state_meta = dict(new_state.meta)
        if private is not None:
            steps = update.meta.get("steps")
            if isinstance(steps, int) and steps != private.steps:
                raise RuntimeError(f"{self.name}: {steps} local steps but {private.steps} of them privatised")
            ledger = Ledger(copy.deepcopy(history))
            ledger.add(private.noise_multiplier, self.sample_rate(n), private.steps)
            meta[KEY] = {
                "epsilon": ledger.epsilon(dp.delta),
                "noise_multiplier": private.noise_multiplier,
                "sample_rate": self.sample_rate(n),  # batch_size / n: follows from num_examples, sent anyway
                "steps": ledger.steps,
            }
            state_meta[KEY] = {"dp_sgd": ledger.history}
            state_meta[SECRET_KEY] = secret
        central = self.settings.central
        tensors = update.tensors
        if central is not None and central.clip_on_client:
            bound = float(payload.meta[CLIP_KEY])
            change = {k: v - payload.tensors[k] for k, v in tensors.items() if v.is_floating_point()}
            change, norm = clip_to_norm(change, bound)
            tensors = {**tensors, **{k: payload.tensors[k] + v for k, v in change.items()}}
            meta[BIT_KEY] = norm <= bound
        return Update(tensors, meta), ClientState(new_state.tensors, state_meta)

    def personalize(self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext) -> StateDict:
        return self.inner.personalize(payload, data, self._without(state), ctx)

    def personalize_variants(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> dict[str, Any]:
        return self.inner.personalize_variants(payload, data, self._without(state), ctx)

    # a newcomer's adaptation stays on it and nothing it computes is released: the inner method's rule, unchanged
    def configure_onboard(self, state: ServerState, rnd: int, cids: list[int]) -> dict[int, Payload]:
        return self.inner.configure_onboard(self._without(state), rnd, cids)

    def onboard(self, payload: Payload, data: ClientDataLike, ctx: ClientContext) -> Any:
        return self.inner.onboard(payload, data, ctx)

    def onboard_variants(self, payload: Payload, data: ClientDataLike, ctx: ClientContext) -> dict[str, Any]:
        return self.inner.onboard_variants(payload, data, ctx)

    def initial_weights(self, purpose: str = "init", cid: int = -1) -> StateDict:
        return self.inner.initial_weights(purpose, cid)


def build_algorithm(
    config: AlgorithmConfig,
    model_factory: ModelFactory,
    num_clients: int,
    seed: int,
    privacy: PrivacySettings | None = None,
    *,
    rounds: int = 1,
    participation: float = 1.0,
) -> Algorithm:
    """The configured method, wrapped in [`PrivateAlgorithm`][fedmerge.algorithms.privacy.PrivateAlgorithm] when
    ``privacy`` is set (runner and
    Flower's ClientApp build it the same way)."""
    algorithm = ALGORITHMS.get(config.name).obj(config, model_factory, num_clients, seed)
    if privacy is None or not privacy.differential:  # secure aggregation alone changes no client or server math
        return algorithm
    return PrivateAlgorithm(algorithm, privacy, rounds, participation)
