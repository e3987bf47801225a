"""Onboarding deployed SuperNodes that join after training (``fedmerge deploy onboard``, issue #36).

The ServerApp reads a finished (or stopped) run folder READ-ONLY: its ``config.yaml``, one checkpoint's server
state, and ``summary.json`` to find the best-validation round. It writes nothing there. Each newcomer's node (a
client id the run never trained, reading its own client file) gets what the method sends a newcomer
(``Algorithm.configure_onboard``, with ``unseen.adapt_epochs`` in its meta), builds its model by the method's
rule (``onboard_variants``), saves it in its own ``state-dir`` (``engines/flower/newcomer.py``) and answers
with its metrics and the file's path: no weight leaves it. With the same client, round and budget, the model
and metrics are those the simulation's onboarding (``split.unseen_clients``) gives, bit for bit.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedmerge.config.schema import CONFIG_FILE, ConfigError, ExperimentConfig, load_config
from fedmerge.core.algorithm import Algorithm, onboard_meta
from fedmerge.core.checkpoint import LATEST, Checkpoint, CheckpointError, load_checkpoint, parse_checkpoint
from fedmerge.core.types import Payload
from fedmerge.data.unseen import unseen_count
from fedmerge.engines.device import resolve_device
from fedmerge.run.engine_setup import flower_options, require_flower
from fedmerge.run.results import CHECKPOINT_DIR, FEDERATION_FILE, SUMMARY_FILE
from fedmerge.run.resume import config_digest
from fedmerge.run.run_records import RunSummary, read_summary

ROUNDS = ("last", "best")  # --round: the checkpoint of the last round (default), of the best-validation round


@dataclass(frozen=True)
class OnboardRequest:
    run_dir: Path
    round: str = "last"  # "last", "best" or a round number whose checkpoint the run kept
    adapt_epochs: int | None = None  # None: the run's unseen.adapt_epochs (0 without an unseen section)
    partition_ids: tuple[int, ...] | None = None  # None: every newcomer online


@dataclass
class Newcomer:
    cid: int
    metrics: dict[str, float]
    saved: str  # the model's file on the node's own disk
    not_saved: list[str] = field(default_factory=list)  # variants that are predictors, not weights


@dataclass
class OnboardResult:
    round: int
    adapt_epochs: int
    run_key: str
    newcomers: list[Newcomer]
    failures: list[dict[str, Any]]


@dataclass
class TrainedRun:
    """What onboarding reads of a run folder: its config, the chosen checkpoint, its participants and run key."""

    cfg: ExperimentConfig
    checkpoint: Checkpoint
    participants: int
    run_key: str
    federation: dict[str, Any] | None  # a deployed run's federation.json


def parse_round(text: str) -> str:
    """``--round``: last, best or a round number (one line when it is none of these)."""
    value = str(text).strip().lower()
    if value in ROUNDS or value.isdigit():
        return value
    raise ConfigError(f"--round {text!r}: give last, best or a round number")


def _summary(run_dir: Path) -> RunSummary | None:
    """The run's ``summary.json``; None before the run finished, one line when it cannot be read."""
    path = run_dir / SUMMARY_FILE
    if not path.is_file():
        return None
    try:
        return read_summary(path)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        raise ConfigError(f"{path} is not readable JSON") from None


def _checkpoint(run_dir: Path, which: str) -> Checkpoint:
    """The checkpoint of round ``which`` (last / best / N), read without writing (checksum verified for the one
    ``latest.json`` names); client states stay where they are (onboarding needs none)."""
    folder = run_dir / CHECKPOINT_DIR
    if not (folder / LATEST).is_file():
        raise CheckpointError(f"{run_dir}: no checkpoint to onboard from ({folder / LATEST} is missing)")
    if which == "last":
        return load_checkpoint(folder, with_clients=False)
    if which == "best":
        summary = _summary(run_dir)
        if summary is None or summary.best_val is None:
            raise ConfigError(
                f"{run_dir}: no best-validation round in {SUMMARY_FILE} (did the run finish, with a validation "
                "split?); use --round last"
            )
        rnd = int(summary.best_val.round)
    else:
        rnd = int(which)
    if json.loads((folder / LATEST).read_text()).get("round") == rnd:
        return load_checkpoint(folder, with_clients=False)
    path = folder / f"round-{rnd:06d}.safetensors"
    if not path.is_file():
        kept = sorted(int(p.stem.removeprefix("round-")) for p in folder.glob("round-*.safetensors"))
        raise CheckpointError(
            f"{run_dir}: the checkpoint of round {rnd} was not kept (kept: rounds {kept}); onboard from one of "
            "those, or keep more with keep_checkpoints"
        )
    return parse_checkpoint(path, with_clients=False)


def read_run(run_dir: str | Path, which: str = "last") -> TrainedRun:
    """The run folder's config, checkpoint and participants; one line for a folder that is not a run's."""
    run_dir = Path(run_dir).expanduser()
    if not (run_dir / CONFIG_FILE).is_file():
        raise ConfigError(f"{run_dir}: no {CONFIG_FILE} there; is it a run folder?")
    cfg = load_config(run_dir / CONFIG_FILE, [])
    checkpoint = _checkpoint(run_dir, parse_round(which))
    digest = config_digest(cfg)
    if checkpoint.meta.get("config_digest") not in (None, digest):
        raise ConfigError(f"{run_dir}: config.yaml no longer matches its checkpoints; refusing to onboard from it")
    summary, federation = _summary(run_dir), _json(run_dir / FEDERATION_FILE)
    if summary is not None and summary.num_clients is not None:  # the clients the method was built for
        participants = int(summary.num_clients)
    elif federation is not None:
        participants = int(federation["num_clients"])
    else:
        total = int(cfg.partition.num_clients)
        participants = total - unseen_count(total, cfg.split.unseen_clients)
    # the nodes' name of this run: a deployed run's own key; else the config digest and this folder
    key = checkpoint.meta.get("node_run_key") or (
        f"{digest[:12]}-{hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]}"
    )
    return TrainedRun(cfg, checkpoint, participants, str(key), federation)


def _check_fits(run: TrainedRun, algorithm: Algorithm, federation: Any) -> None:
    """The newcomers' data fit the run's model: the classes and input shape its federation reported (a deployed
    run), and a server state shaped as one built for the newcomers' data."""
    first = federation.first
    if run.federation is not None:
        said = (int(run.federation["num_classes"]), tuple(run.federation["input_shape"]))
        if said != (first.num_classes, tuple(first.input_shape)):
            raise ConfigError(
                f"the newcomers' data ({first.num_classes} classes, input {list(first.input_shape)}) differ from "
                f"the run's federation ({said[0]} classes, input {list(said[1])})"
            )
    fresh = algorithm.init_server_state().tensors
    for key, tensor in run.checkpoint.server_state.tensors.items():
        if key in fresh and tuple(fresh[key].shape) != tuple(tensor.shape):
            raise ConfigError(
                f"the run's model does not fit the newcomers' data ({first.num_classes} classes, input "
                f"{list(first.input_shape)}): its {key} is {list(tensor.shape)}, they need {list(fresh[key].shape)}"
            )


def onboard_run(request: OnboardRequest, grid: Any, notify: Any = None) -> OnboardResult:
    """Onboard the newcomers' SuperNodes on ``grid`` from ``request.run_dir`` (read, never written)."""
    from fedmerge.algorithms.privacy import build_algorithm
    from fedmerge.engines.flower.engine import FlowerEngine
    from fedmerge.engines.flower.federation import connect_newcomers
    from fedmerge.engines.flower.job import client_job
    from fedmerge.engines.flower.protocol import DEPLOYMENT
    from fedmerge.models import build_model

    require_flower(simulation=False)
    run = read_run(request.run_dir, request.round)
    cfg, rnd = run.cfg, run.checkpoint.round
    unseen = cfg.unseen
    epochs = request.adapt_epochs if request.adapt_epochs is not None else (unseen.adapt_epochs if unseen else 0)
    if epochs < 0:
        raise ConfigError(f"--adapt-epochs {epochs}: give 0 or more epochs")
    options = flower_options(cfg)
    wanted = list(request.partition_ids) if request.partition_ids is not None else None
    federation = connect_newcomers(grid, options, run.participants, wanted)
    first, device = federation.first, resolve_device(cfg.device)

    def model_factory(generator: torch.Generator) -> torch.nn.Module:
        return build_model(cfg.model, first.input_shape, first.num_classes, generator=generator)

    algorithm = build_algorithm(
        cfg.algorithm, model_factory, run.participants, cfg.seed, cfg.privacy,
        rounds=cfg.rounds, participation=cfg.participation,
    )  # fmt: skip
    _check_fits(run, algorithm, federation)
    cids = sorted(federation.node_of)
    try:
        sent = algorithm.configure_onboard(run.checkpoint.server_state, rnd, cids)
    except NotImplementedError as exc:
        raise ConfigError(f"{str(exc).splitlines()[0]}: its run cannot onboard newcomers") from None
    meta = onboard_meta(epochs, unseen.adapt_lr if unseen is not None else None)  # the run's unseen.adapt_lr
    payloads = {c: Payload(p.tensors, {**p.meta, **meta}) for c, p in sent.items()}
    job = client_job(cfg.model_dump(mode="json"), run.participants, with_data=False)
    model = model_factory(torch.Generator().manual_seed(0))
    engine = FlowerEngine(
        grid, federation, job, model, device, cfg.seed, options, eval_batch_size=cfg.eval_batch_size,
        mode=DEPLOYMENT, run_key=run.run_key,
    )  # fmt: skip
    if notify is not None:
        notify(f"onboarding clients {cids} from round {rnd} of {request.run_dir} (adapt_epochs {epochs})")
    replies = engine.onboard(algorithm, rnd, payloads)
    newcomers = [
        Newcomer(cid, metrics, notes.get("saved", ""), [v for v in notes.get("not_saved", "").split(",") if v])
        for cid, (metrics, notes) in sorted(replies.items())
    ]
    return OnboardResult(rnd, epochs, run.run_key, newcomers, engine.pop_failures())


def newcomer_line(newcomer: Newcomer) -> str:
    """One line for the operator: the newcomer's test metrics (its personalised model) and where it is saved."""
    tests = {k: v for k, v in newcomer.metrics.items() if k.startswith("test_")}
    shown = " ".join(f"{k}={v:.4f}" if k != "test_n" else f"{k}={v:g}" for k, v in sorted(tests.items()))
    extra = f" ({', '.join(newcomer.not_saved)}: a predictor, not saved)" if newcomer.not_saved else ""
    return f"client {newcomer.cid}: {shown or 'no test split'}; its model is on its node in {newcomer.saved}{extra}"
