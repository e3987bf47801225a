"""The run config's own sections beside the components: ``flower:``, ``log:``, ``state:`` and ``unseen:``
(each a frozen pydantic model, validated with the rest of the config by
[`fedmerge.config.schema`][fedmerge.config.schema])."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

RAY_ADDRESS = re.compile(r"^[^\s:/]+:[0-9]{1,5}$")  # HOST:PORT, as `ray start --address` takes it


class FlowerSettings(BaseModel):
    """``flower:`` section, read only with ``engine: flower`` (docs/deployment.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replies: int = Field(1, ge=1, description="fewest training replies a round needs (capped at those selected)")
    max_retries: int = Field(1, ge=0, description="resends to the failed clients when a round has too few replies")
    round_timeout: float = Field(600.0, gt=0, description="seconds to wait for the replies to one round's messages")
    connect_timeout: float = Field(120.0, gt=0, description="seconds to wait for a SuperNode for every partition")
    num_cpus: int | None = Field(None, ge=1, description="simulation: CPUs a private Ray may use (None: all)")
    client_cpus: float = Field(1.0, gt=0, description="simulation: CPUs reserved per ClientApp")
    client_gpus: float = Field(0.0, ge=0, description="simulation: GPUs reserved per ClientApp")
    ray_address: str | None = Field(
        None,
        description="simulation: join this running Ray cluster and run the ClientApps on its nodes (auto: the one "
        "RAY_ADDRESS names, else the one `ray start` made on this machine; HOST:PORT: its head); null: a private "
        "Ray on this machine, whatever cluster runs or RAY_ADDRESS names",
    )

    @field_validator("ray_address")
    @classmethod
    def _valid_ray_address(cls, value: str | None) -> str | None:
        if value is not None and value != "auto" and not RAY_ADDRESS.match(value):
            raise ValueError("auto, or HOST:PORT of a Ray cluster's head (ray start --head --port PORT)")
        return value

    @model_validator(mode="after")
    def _cpus_of_a_private_ray(self) -> FlowerSettings:
        if self.ray_address is not None and self.num_cpus is not None:
            raise ValueError("num_cpus sizes a private Ray; a joined cluster (ray_address) has its own CPUs")
        return self


class LogSettings(BaseModel):
    """``log:`` section: extra outputs of a run (they do not change its numbers)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tensorboard: bool = Field(
        False,
        description="also write TensorBoard scalars to RUN_DIR/tensorboard (pip install -e '.[tensorboard]')",
    )


class StateSettings(BaseModel):
    """``state:`` section: client states on disk (engine=local), for populations whose states do not fit in RAM.

    States live in an LMDB store in RUN_DIR/checkpoints/clients; each checkpoint then writes the server
    state plus only the client states its round changed. Results are the same as with states in memory."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cache_size: int = Field(256, ge=0, description="client states kept decoded in memory (least recently used go)")


class UnseenSettings(BaseModel):
    """``unseen:`` section: how clients that never trained (``split.unseen_clients``) are onboarded.

    At every evaluation round each such client receives what the method sends a newcomer, builds its model
    from it and its own training split by the method's rule (docs/guide/unseen-clients.md) and is
    tested on its test split; its metrics are logged as ``eval_unseen`` and never select a round."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    adapt_epochs: int = Field(
        0, ge=0, description="epochs of adaptation on the newcomer's training split (0: the method's model as sent)"
    )
    adapt_lr: float | None = Field(
        None,
        gt=0,
        description="the newcomers' learning rate when they adapt (and fine-tune); null: the method's own lr, "
        "which was tuned for federated rounds, not for one client alone",
    )
    also_adapt_epochs: tuple[Annotated[int, Field(ge=0)], ...] = Field(
        (),
        description="more budgets onboarded from the same server state at the same rounds, each logged as "
        "eval_unseen_adaptN: one training compares several budgets (empty: only adapt_epochs)",
    )

    @field_validator("also_adapt_epochs")
    @classmethod
    def _distinct_budgets(cls, value: tuple[int, ...], info: ValidationInfo) -> tuple[int, ...]:
        if len(set(value)) != len(value) or info.data.get("adapt_epochs") in value:
            raise ValueError("each budget once, and not adapt_epochs again")
        return value
