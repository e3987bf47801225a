"""The static types of a validated config: [`RunSettings`][fedmerge.config.experiment_config.RunSettings], the
settings that are not components (the schedule, engine, outputs and the optional sections), and
[`ExperimentConfig`][fedmerge.config.experiment_config.ExperimentConfig], which adds the component sections typed
by their base classes. The schema that validates ([`fedmerge.config.schema`][fedmerge.config.schema]) derives
from it."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from fedmerge.algorithms.privacy_settings import PrivacySettings
from fedmerge.config.sections import FlowerSettings, LogSettings, StateSettings, UnseenSettings
from fedmerge.core.algorithm import AlgorithmConfig
from fedmerge.core.loop import EVAL_CLIENTS_HELP, parse_eval_clients
from fedmerge.core.registry import ComponentConfig
from fedmerge.data import NoiseConfig, SplitConfig

RUN_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")
MODULE_NAME = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"


class RunSettings(BaseModel):
    """Fields that are not components: the schedule, engine and outputs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # empty: omitted from config.yaml so that existing run folders stay unchanged
    plugins: tuple[Annotated[str, StringConstraints(pattern=MODULE_NAME)], ...] = Field(
        (),
        description="modules imported before the config is read, registering components of other packages "
        "(docs/extending.md); saved in config.yaml, so resumes, sweeps and Flower nodes import them too",
    )
    name: str = Field(
        "experiment",
        min_length=1,
        pattern=RUN_NAME.pattern,
        description="run folder prefix; default ALGORITHM-DATASET (e.g. fedprox-npz)",
    )
    seed: int = Field(0, ge=0, description="seeds the partition, splits, noise, initialisation and training")
    rounds: int = Field(20, ge=1, description="communication rounds")
    participation: float = Field(1.0, gt=0, le=1, description="fraction of clients sampled per round")
    eval_every: int = Field(1, ge=1, description="evaluate every this many rounds (and always the last)")
    # "all" is omitted from config.yaml and the config digest so that existing run folders stay unchanged
    eval_clients: str = Field("all", description=f"whose personalised models are evaluated: {EVAL_CLIENTS_HELP}")
    checkpoint_every: int = Field(1, ge=1, description="checkpoint every this many rounds (and always the last)")
    keep_checkpoints: int = Field(2, ge=1, description="checkpoint files kept in RUN_DIR/checkpoints")
    engine: Literal["local", "flower"] = Field("local", description="local: in-process; flower: Flower (simulation)")
    # None: defaults; omitted from config.yaml so local runs are unchanged
    flower: FlowerSettings | None = Field(None, description="Flower settings (fedmerge list flower)")
    # None: states in memory; omitted from config.yaml so that existing run folders stay unchanged
    state: StateSettings | None = Field(
        None, description="keep client states on disk with incremental checkpoints (fedmerge list state); null: in RAM"
    )
    # None: defaults; omitted from config.yaml so that existing run folders stay unchanged
    log: LogSettings | None = Field(None, description="extra outputs (fedmerge list log)")
    # None: defaults (no adaptation); omitted from config.yaml so that existing run folders stay unchanged
    unseen: UnseenSettings | None = Field(
        None, description="onboarding of the clients that never train, split.unseen_clients (fedmerge list unseen)"
    )
    # None: no differential privacy; omitted from config.yaml so that existing run folders stay unchanged
    privacy: PrivacySettings | None = Field(
        None, description="differential privacy and secure aggregation (fedmerge list privacy)"
    )
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?|mps|auto)$", description="cpu, cuda, cuda:N, mps or auto")
    output_dir: str = Field("runs", description="where run folders are created")
    eval_batch_size: int = Field(1024, ge=1, description="batch size of evaluation (memory only, not results)")
    threads: int | None = Field(
        1,
        ge=1,
        description="torch intra-op CPU threads for client and server work, the same in every engine and worker: "
        "the thread count changes the numbers (reduction order); null: the machine's default, not portable",
    )
    # "auto" is written to config.yaml as such and resolved by each process that runs or resumes the run
    workers: int | Literal["auto"] = Field(
        "auto",
        description="engine=local: processes running clients in parallel (threads=1 each), the same numbers for "
        "any count; auto: one per core available, at most the clients per round, 1 where forking cannot help "
        "(device not cpu, threads not 1, vectorize) and while a round's client work is under 0.5 s",
    )
    vectorize: bool = Field(
        False,
        description="engine=local: train the round's clients as one batched computation (vmap; for GPUs); plain "
        "local SGD methods only (fedavg, fedavg_ft, fedprox, local, fedmerge); equal to the default within float "
        "tolerance, not bit for bit",
    )
    keep_freed_memory: bool = Field(
        True,
        description="Linux (glibc): freed memory stays in the process for reuse instead of going back to the OS, "
        "so that each round's updates do not page-fault fresh memory (less system time per round); "
        "the process keeps its peak memory until it exits. Changes no number",
    )

    @field_validator("workers", mode="before")
    @classmethod
    def _valid_workers(cls, value: Any) -> int | str:
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int | str) or not str(value).isdigit() or int(value) < 1:
            raise ValueError("a number of processes (1 or more) or auto")
        return int(value)

    @field_validator("eval_clients")
    @classmethod
    def _valid_eval_clients(cls, value: str) -> str:
        parse_eval_clients(value)
        return value


class ExperimentConfig(RunSettings):
    """The static type of a validated config (what [`load_config()`][fedmerge.config.schema.load_config]
    returns): each component section typed by its base class. The schema validated at run time
    ([`experiment_model()`][fedmerge.config.schema.experiment_model]) derives from it, narrowing each component
    section to the union of the registered components' configs."""

    dataset: ComponentConfig
    partition: ComponentConfig
    split: SplitConfig = SplitConfig()
    noise: NoiseConfig = NoiseConfig()
    model: ComponentConfig
    algorithm: AlgorithmConfig
