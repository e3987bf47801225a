"""The Algorithm protocol: four pure functions between plain-data records.

    payloads = algorithm.configure(server_state, round, selected)          # server
    update, client_state = algorithm.client_update(payload, data, client_state, ctx)   # client
    server_state = algorithm.aggregate(server_state, round, updates)       # server
    weights = algorithm.personalize(eval_payload, data, client_state, ctx)  # client, for evaluation
    payloads = algorithm.configure_onboard(server_state, round, newcomers)  # server, clients that never trained
    weights = algorithm.onboard(onboard_payload, data, ctx)  # newcomer: no state before, none kept after

Evaluation is split the same way as training (``configure_evaluate`` on the server,
``personalize`` on the client) because a personalised model may need the client's data (e.g.
fine-tuning) and, on a distributed engine, only the client has it.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from .method_hooks import NO_HOOKS, MethodHooks
from .privacy import PrivateGradients
from .registry import ComponentConfig, Registry
from .secure_sum import SummedUpdates
from .seeding import torch_generator
from .training import LocalTraining
from .types import ClientState, Payload, ServerState, Update

StateDict = dict[str, torch.Tensor]
ModelFactory = Callable[[torch.Generator], nn.Module]
# A personalised model that is not one state dict of the experiment's model (e.g. FedEM's mixture
# of M networks): maps inputs to logits (log-probabilities are fine: metrics apply softmax).
Predictor = Callable[[torch.Tensor], torch.Tensor]


class ClientDataLike(Protocol):
    """What an algorithm may read of a client's data (``fedmerge.data.ClientData`` fits)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor


class ClientRows(Sequence):
    """One row per client, made when asked for: a server report's per-client matrix whose log keeps
    only some clients' rows (``eval_clients``) costs those rows, not one per client of the population."""

    def __init__(self, num_clients: int, row: Callable[[int], list[float]]) -> None:
        self.num_clients = num_clients
        self.row = row

    def __len__(self) -> int:
        return self.num_clients

    def __getitem__(self, cid: int) -> list[float]:  # type: ignore[override]
        if not 0 <= cid < self.num_clients:
            raise IndexError(cid)
        return self.row(cid)


class AlgorithmConfig(ComponentConfig, LocalTraining):
    """Base of algorithm configs: the component name plus local-training hyper-parameters."""

    def warnings(self, rounds: int) -> list[str]:
        """Valid but most likely unintended settings of this method in a run of ``rounds`` rounds, one line
        each (printed before the run starts); a method overrides it to say what only it knows."""
        return []


# Validation context key (``model_validate(data, context={BUILTIN_DEFAULTS: keys})``): the algorithm keys
# whose value is one of the command line's built-in defaults rather than a value the user wrote. A
# config validator that fills options (a preset) may replace those; a value the user wrote it must not.
BUILTIN_DEFAULTS = "builtin_algorithm_defaults"


def keys_set_by_user(data: dict[str, Any], context: dict[str, Any] | None) -> set[str]:
    """The keys of a raw algorithm section that the user wrote (see ``BUILTIN_DEFAULTS``)."""
    builtin = (context or {}).get(BUILTIN_DEFAULTS, ())
    return {key for key in data if key not in builtin}


@dataclass
class ClientContext:
    """What the engine gives a client update besides its data and state."""

    model: nn.Module  # one reused model object; load weights into it, never keep it
    device: torch.device
    seed: int
    round: int
    cid: int
    # DP-SGD for this client's local training (``privacy.dp_sgd``); methods admitting it pass it to local_sgd
    private: PrivateGradients | None = None

    def generator(self, purpose: str) -> torch.Generator:
        return torch_generator(self.seed, self.round, self.cid, purpose)


@dataclass(frozen=True)
class PlainSGD:
    """A client step that is `local_sgd()` on the algorithm's config from ``start``, with
    the loss term ``prox_mu / 2 * ||w - start||^2`` over the trainable parameters when ``prox_mu`` > 0."""

    start: StateDict
    prox_mu: float = 0.0


ADAPT_EPOCHS = "adapt_epochs"  # onboarding payload meta: the newcomer's adaptation budget (unseen.adapt_epochs)


def adapt_epochs(payload: Payload) -> int:
    """The adaptation budget an onboarding payload carries (epochs over the newcomer's training split)."""
    return int(payload.meta.get(ADAPT_EPOCHS, 0))


ADAPT_LR = "adapt_lr"  # onboarding payload meta: the newcomer's learning rate (unseen.adapt_lr), absent: the method's


def onboard_meta(epochs: int, lr: float | None = None) -> dict[str, Any]:
    """What the round loop and deployed onboarding add to a newcomer's payload meta: its budget and, where
    ``unseen.adapt_lr`` is set, its learning rate."""
    return {ADAPT_EPOCHS: epochs} | ({ADAPT_LR: lr} if lr else {})


def for_newcomer(algorithm: Algorithm, payload: Payload) -> Algorithm:
    """The algorithm a newcomer adapts with: itself, or with ``unseen.adapt_lr`` as its learning rate (and as
    its fine-tuning rate where it has one); a shallow copy, the objects it built at its start shared."""
    lr = payload.meta.get(ADAPT_LR)
    if lr is None:
        return algorithm
    clone = copy.copy(algorithm)
    update = {key: float(lr) for key in ("lr", "finetune_lr") if key in type(algorithm.config).model_fields}
    clone.config = algorithm.config.model_copy(update=update)
    return clone


def with_epochs(cfg: LocalTraining, epochs: int) -> LocalTraining:
    """``cfg`` training for ``epochs`` epochs (``local_steps`` unset): a newcomer's adaptation budget."""
    return cfg.model_copy(update={"local_epochs": epochs, "local_steps": None})


class Algorithm(ABC):
    """A federated method. Subclasses are registered in ``ALGORITHMS`` with a typed config."""

    name: ClassVar[str]
    # Privacy mechanisms the method admits (docs/deployment.md, "Privacy"): None when it does, else why not
    # (one line, completing "{name} ..."). DP-SGD needs every training step that shapes what the client
    # sends to be local_sgd's task-loss step with ``ctx.private``; central DP an aggregate that is a
    # (weighted) mean of the updates' tensors, each the client's new value of a server-state tensor.
    dp_sgd_refusal: ClassVar[str | None] = "has not been checked for DP-SGD"
    central_dp_refusal: ClassVar[str | None] = "has not been checked for central DP"
    # Secure aggregation (``privacy.secure_aggregation``, Flower's SecAgg+): None when the method's aggregate
    # needs only the round's weighted mean of each update tensor (or its sum, ``secure_summed``), so that
    # ``aggregate_summed`` equals ``aggregate``; else why not (one line, completing "{name} ...").
    secure_aggregation_refusal: ClassVar[str | None] = "has not been checked for secure aggregation"

    def __init__(self, config: AlgorithmConfig, model_factory: ModelFactory, num_clients: int, seed: int) -> None:
        self.config = config
        self.model_factory = model_factory
        self.num_clients = num_clients
        self.seed = seed

    # --- server side -------------------------------------------------------------------
    @abstractmethod
    def init_server_state(self) -> ServerState: ...

    def select_clients(self, state: ServerState, rnd: int, scheduled: list[int]) -> list[int]:
        """The clients of round ``rnd``: the schedule's sample (central DP samples its own, in secret; it may
        be empty)."""
        return scheduled

    @abstractmethod
    def configure(self, state: ServerState, rnd: int, selected: list[int]) -> dict[int, Payload]: ...

    @abstractmethod
    def aggregate(self, state: ServerState, rnd: int, updates: dict[int, Update]) -> ServerState: ...

    def configure_evaluate(self, state: ServerState, rnd: int, cids: list[int]) -> dict[int, Payload]:
        return self.configure(state, rnd, cids)

    def global_model(self, state: ServerState) -> StateDict | None:
        """Weights of a single global model, if the method has one (for the pooled test)."""
        return None

    def server_report(self, state: ServerState, rnd: int) -> dict[str, Any]:
        """Small JSON-able server-side figures logged every round (e.g. merge weights: a list, or a
        [`ClientRows`][fedmerge.core.algorithm.ClientRows] whose rows are made only for the clients logged)."""
        return {}

    # --- secure aggregation (admitted methods only) --------------------------------------------
    def secure_weight(self, meta: dict[str, Any]) -> float:
        """A client's weight in the round's mean, from its update's metadata (sent in the clear)."""
        return float(meta["num_examples"])

    def secure_summed(self, key: str) -> bool:
        """Whether the server needs the sum of the update tensor ``key`` over the round, not its mean."""
        return False

    def aggregate_summed(self, state: ServerState, rnd: int, summed: SummedUpdates) -> ServerState:
        """The aggregate from the round's combination alone: an admitted method's aggregate of one update
        holding the weighted mean of every mean tensor and the sum of every summed one equals its aggregate
        of the round's updates (tests/test_secure_aggregation.py checks this for every admitted method)."""
        return self.aggregate(state, rnd, {summed.clients[0]: summed.combined})

    def client_optimized_parameters(self, model_parameters: int, client_states: Iterable[ClientState]) -> float:
        """Parameters one client optimises per round (budget accounting); default: one model."""
        return float(model_parameters)

    # --- client side -------------------------------------------------------------------
    def init_client_state(self, cid: int) -> ClientState:
        return ClientState()

    @abstractmethod
    def client_update(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> tuple[Update, ClientState]: ...

    @abstractmethod
    def personalize(self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext) -> StateDict:
        """The weights client ``ctx.cid`` is evaluated with. Must not change ``state``."""

    def personalize_variants(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> dict[str, StateDict | Predictor]:
        """Named models to evaluate for this client. ``""`` is the personalised model; methods
        with a family of models (e.g. SuPerFed's interpolation line) add entries such as
        ``"lambda=0.3"``, whose metrics are logged as ``lambda=0.3/test_acc``. A value is either
        weights for the experiment's model or a `Predictor` (called in no-grad mode; put
        your own modules in eval mode)."""
        return {"": self.personalize(payload, data, state, ctx)}

    # --- clients that never trained (``split.unseen_clients``) ----------------------------------
    # A newcomer joins after (or during) training: the server sends it what the method would send a new
    # client (``configure_onboard``), the newcomer builds its personalised model from that and its own data
    # within the budget ``adapt_epochs(payload)`` (``onboard``), and nothing comes back but its metrics.
    # It has no client state before and keeps none: it never changes what the federation trains.
    def configure_onboard(self, state: ServerState, rnd: int, cids: list[int]) -> dict[int, Payload]:
        """What the server sends newcomers ``cids`` (ids the method was not built for)."""
        raise NotImplementedError(f"{self.name} has no onboarding rule for clients that never trained")

    def onboard(self, payload: Payload, data: ClientDataLike, ctx: ClientContext) -> StateDict | Predictor:
        """The personalised model of a newcomer, from its onboarding payload and its own data."""
        raise NotImplementedError(f"{self.name} has no onboarding rule for clients that never trained")

    def onboard_variants(
        self, payload: Payload, data: ClientDataLike, ctx: ClientContext
    ) -> dict[str, StateDict | Predictor]:
        """Named models to evaluate for a newcomer, as `personalize_variants()` (``""``: `onboard()`)."""
        return {"": self.onboard(payload, data, ctx)}

    def adapted(self, epochs: int) -> Algorithm:
        """This method with its local training cut to ``epochs`` epochs: a newcomer that adapts by the method's
        own client objective runs ``adapted(adapt_epochs(payload)).client_update`` (a shallow copy: the
        objects the method built at its start are shared)."""
        clone = copy.copy(self)
        clone.config = with_epochs(self.config, epochs)
        return clone

    # --- many clients at once (engine option ``vectorize``) --------------------------------
    # Methods whose client step is plain local SGD on one model set ``vectorizable`` and say where
    # the client starts (and its proximal anchor); an engine may then train many clients in one
    # batched computation and hand each client's trained weights back to ``plain_sgd_result``.
    vectorizable: ClassVar[bool] = False

    def plain_sgd(self, payload: Payload, state: ClientState) -> PlainSGD:
        """Where this client's plain local SGD starts (only for ``vectorizable`` methods)."""
        raise NotImplementedError(f"{self.name} does not train clients by plain local SGD")

    def plain_sgd_result(
        self, payload: Payload, state: ClientState, trained: StateDict, meta: dict[str, Any]
    ) -> tuple[Update, ClientState]:
        """``client_update``'s return value, given the weights that plain local SGD ended with."""
        raise NotImplementedError(f"{self.name} does not train clients by plain local SGD")

    # --- helpers ---------------------------------------------------------------------
    def initial_weights(self, purpose: str = "init", cid: int = -1) -> StateDict:
        model = self.model_factory(torch_generator(self.seed, -1, cid, purpose))
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


class AlgorithmRegistry(Registry[type[Algorithm]]):
    """The methods' registry: a method's entry may also carry its
    [`MethodHooks`][fedmerge.core.method_hooks.MethodHooks] (summary fields, summary lines, report figures), which
    the run, report and CLI floors look up by the method's name."""

    def __init__(self) -> None:
        super().__init__("algorithm")
        self._hooks: dict[str, MethodHooks] = {}

    def register(
        self, name: str, *, config: type[ComponentConfig], description: str, hooks: MethodHooks | None = None
    ) -> Callable[[type[Algorithm]], type[Algorithm]]:
        add = super().register(name, config=config, description=description)

        def decorator(obj: type[Algorithm]) -> type[Algorithm]:
            add(obj)  # refuses a second registration before any hook is kept
            if hooks is not None:
                self._hooks[name] = hooks
            return obj

        return decorator

    def hooks(self, name: str | None) -> MethodHooks:
        """The hooks of method ``name``; none for a method without them or one not registered in this process
        (a run folder of a plugin's method read without the plugin)."""
        return self._hooks.get(name or "", NO_HOOKS)


ALGORITHMS = AlgorithmRegistry()
