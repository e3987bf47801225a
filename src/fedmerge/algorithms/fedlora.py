"""FedLoRA (Yi et al., 2023, arXiv 2310.13283), on a frozen pretrained backbone with LoRA (``minilm_lora``).

Each client runs the frozen backbone with two adapters added together: a *shared* LoRA adapter,
averaged by the server (FedAvg by n_i), and a *personal* one that never leaves the client, together with
the classification head (the paper's personal "local model" is the client's own network; here it is
the personal adapter + head on the common backbone). Training alternates as in the paper: first the
personal part trains with the shared adapter frozen (``personal_epochs``), then the shared adapter
trains with the personal part frozen (``local_epochs``/``local_steps``). Only the shared adapter
travels; the personal adapter and head are the client state, so a resumed run continues exactly.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedmerge.core.algorithm import (
    ALGORITHMS,
    Algorithm,
    AlgorithmConfig,
    ClientContext,
    ClientDataLike,
    ModelFactory,
    Predictor,
    StateDict,
    adapt_epochs,
)
from fedmerge.core.params import weighted_average
from fedmerge.core.training import local_sgd
from fedmerge.core.types import ClientState, Payload, ServerState, Update

from ._personal import GapProbe, detached, leaves


class FedLoRAConfig(AlgorithmConfig):
    name: Literal["fedlora"] = "fedlora"
    personal_epochs: int = Field(1, ge=1, description="epochs on the personal adapter + head (shared frozen)")


@ALGORITHMS.register(
    "fedlora",
    config=FedLoRAConfig,
    description="FedLoRA: personal LoRA adapter + head on the client, shared adapter averaged; trained alternately",
)
class FedLoRA(Algorithm):
    name = "fedlora"
    dp_sgd_refusal = (
        "trains through a LoRA forward (forward=...), whose per-sample gradients local_sgd's DP step does not form"
    )
    central_dp_refusal = None
    secure_aggregation_refusal = None
    config: FedLoRAConfig

    def __init__(self, config: FedLoRAConfig, model_factory: ModelFactory, num_clients: int, seed: int) -> None:
        super().__init__(config, model_factory, num_clients, seed)
        probe = model_factory(torch.Generator().manual_seed(0))
        if not hasattr(probe, "adapter_keys"):
            raise ValueError("fedlora needs a LoRA model (model.name=minilm_lora, vit_lora or causal_lm_lora)")
        self.shared_keys: list[str] = probe.adapter_keys()

    # --- server ------------------------------------------------------------------------
    def init_server_state(self) -> ServerState:
        init = self.initial_weights()
        return ServerState({k: init[k] for k in self.shared_keys})

    def configure(self, state: ServerState, rnd: int, selected: list[int]) -> dict[int, Payload]:
        return {cid: Payload(state.tensors, {"round": rnd}) for cid in selected}

    def aggregate(self, state: ServerState, rnd: int, updates: dict[int, Update]) -> ServerState:
        cids = sorted(updates)
        avg = weighted_average([updates[c].tensors for c in cids], [updates[c].num_examples for c in cids])
        return ServerState(avg, dict(state.meta))

    def client_optimized_parameters(self, model_parameters: int, client_states) -> float:
        # shared adapter + head (the model) plus the personal adapter, which has the adapter's size
        per_adapter = sum(v.numel() for k, v in self.initial_weights().items() if k in self.shared_keys)
        return float(model_parameters + per_adapter)

    # --- client ------------------------------------------------------------------------
    def init_client_state(self, cid: int) -> ClientState:
        # The personal adapter starts as a no-op (B = 0) with its own seeded A; the head is the common init.
        personal = self.initial_weights("fedlora/personal", cid)
        head = {k: v for k, v in self.initial_weights().items() if k not in self.shared_keys}
        return ClientState({**{f"personal.{k}": personal[k] for k in self.shared_keys}, **head})

    def _split(self, state: ClientState) -> tuple[StateDict, StateDict]:
        personal = {k.removeprefix("personal."): v for k, v in state.tensors.items() if k.startswith("personal.")}
        head = {k: v for k, v in state.tensors.items() if not k.startswith("personal.")}
        return personal, head

    def client_update(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> tuple[Update, ClientState]:
        cfg, model = self.config, ctx.model
        personal_state, head = self._split(state)
        model.load_state_dict({**payload.tensors, **head}, strict=True)
        personal = leaves(personal_state, self.shared_keys, ctx.device)

        def forward(x: torch.Tensor) -> torch.Tensor:
            return model(x, personal=personal)

        probe = GapProbe(data, ctx, cfg.gap_samples)  # received: shared adapter + stored head, no personal
        head_params = list(model.classifier.parameters())
        phase1 = cfg.model_copy(update={"local_epochs": cfg.personal_epochs, "local_steps": None})
        local_sgd(
            model, data.x_train, data.y_train, phase1, ctx.generator("train/personal"),
            params=[*personal.values(), *head_params], forward=forward,
        )  # fmt: skip
        for p in personal.values():
            p.requires_grad_(False)
        stats = local_sgd(
            model, data.x_train, data.y_train, cfg, ctx.generator("train"),
            params=list(model.lora.parameters()), forward=forward,
        )  # fmt: skip
        weights = model.state_dict()
        shared = {k: weights[k].detach().clone() for k in self.shared_keys}
        new_head = {k: weights[k].detach().clone() for k in head}
        new_state = ClientState({**{f"personal.{k}": v for k, v in detached(personal).items()}, **new_head})
        return Update(shared, probe.meta(ctx, data, stats)), new_state

    def personalize(self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext) -> StateDict:
        """Shared adapter + personal head (without the personal adapter; see personalize_variants)."""
        return {**payload.tensors, **self._split(state)[1]}

    def personalize_variants(
        self, payload: Payload, data: ClientDataLike, state: ClientState, ctx: ClientContext
    ) -> dict[str, StateDict | Predictor]:
        personal_state, head = self._split(state)
        weights = {k: v.to(ctx.device) for k, v in {**payload.tensors, **head}.items()}
        personal = {k: v.to(ctx.device) for k, v in personal_state.items()}
        model = ctx.model

        def predict(x: torch.Tensor) -> torch.Tensor:
            model.eval()
            return torch.func.functional_call(model, weights, (x,), {"personal": personal})

        return {"": predict}

    # --- a newcomer: its personal adapter and head trained on the frozen shared adapter (the paper's first phase)
    def configure_onboard(self, state: ServerState, rnd: int, cids: list[int]) -> dict[int, Payload]:
        return self.configure(state, rnd, cids)

    def onboard_variants(
        self, payload: Payload, data: ClientDataLike, ctx: ClientContext
    ) -> dict[str, StateDict | Predictor]:
        """The personal adapter (a no-op at first) and the common initial head, trained for ``adapt_epochs``
        epochs with the shared adapter frozen, as FedLoRA's personal phase; evaluated as participants are."""
        state = self.init_client_state(ctx.cid)
        epochs = adapt_epochs(payload)
        if epochs > 0:
            personal_state, head = self._split(state)
            model = ctx.model
            model.load_state_dict({**payload.tensors, **head}, strict=True)
            personal = leaves(personal_state, self.shared_keys, ctx.device)

            def forward(x: torch.Tensor) -> torch.Tensor:
                return model(x, personal=personal)

            cfg = self.config.model_copy(update={"local_epochs": epochs, "local_steps": None})
            local_sgd(
                model, data.x_train, data.y_train, cfg, ctx.generator("onboard"),
                params=[*personal.values(), *model.classifier.parameters()], forward=forward,
            )  # fmt: skip
            weights = model.state_dict()
            new_head = {k: weights[k].detach().clone() for k in head}
            state = ClientState({**{f"personal.{k}": v for k, v in detached(personal).items()}, **new_head})
        return self.personalize_variants(payload, data, state, ctx)

    def onboard(self, payload: Payload, data: ClientDataLike, ctx: ClientContext) -> StateDict | Predictor:
        return self.onboard_variants(payload, data, ctx)[""]
