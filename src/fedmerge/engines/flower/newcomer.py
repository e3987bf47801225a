"""A deployed newcomer's model on its own disk: what ``fedmerge deploy onboard`` leaves on the node.

A SuperNode of a client that never trained builds its personalised model from the onboarding payload and its
own data (``Algorithm.onboard_variants``, through the one-client ``LocalEngine``) and saves it here, in its
``state-dir`` under the run's key, next to where a participant keeps its state store::

    STATE_DIR/run-KEY/onboarded-round-000012.safetensors

Keys: the personalised model's own keys (it loads into the experiment's model as it is), and each named
variant's (e.g. SuPerFed's ``lambda=0.3``, FedEM's ``dominant``) as ``VARIANT/KEY``. A variant that is a
predictor rather than weights (FedEM's mixture, pFedMoE's gated network) is listed in the metadata's
``not_saved``. Only the file's path and the metrics go back to the server, never a tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedmerge.core.algorithm import Predictor, StateDict
from fedmerge.core.checkpoint import atomic_write_bytes
from fedmerge.core.types import Record

from .node import NodeSettings

SAVED = "saved"  # reply key (JOB record): where the node saved its model
NOT_SAVED = "not_saved"  # reply key: the variants that are predictors, a JSON list ("": the personalised model)


def onboarded_path(settings: NodeSettings, cid: int, run_key: str, rnd: int) -> Path:
    """Where client ``cid`` keeps its model onboarded from round ``rnd`` of run ``run_key``."""
    return settings.run_store(cid, run_key, 0) / f"onboarded-round-{rnd:06d}.safetensors"


def save_onboarded(
    settings: NodeSettings,
    cid: int,
    run_key: str,
    rnd: int,
    models: dict[str, StateDict | Predictor],
    meta: dict[str, Any],
) -> tuple[Path, list[str]]:
    """Write the newcomer's models (atomically: a crash leaves the old file or the new one); the path and the
    names of the variants that are predictors, which have no weights of the experiment's model to save."""
    tensors: dict[str, Any] = {}
    predictors = sorted(name for name, w in models.items() if callable(w))
    for name, weights in models.items():
        if not callable(weights):
            tensors.update({(f"{name}/{k}" if name else k): v for k, v in weights.items()})
    path = onboarded_path(settings, cid, run_key, rnd)
    path.parent.mkdir(parents=True, exist_ok=True)
    info = {
        **meta,
        "client_id": cid,
        "run_key": run_key,
        "round": rnd,
        "variants": sorted(models),
        NOT_SAVED: predictors,
    }
    atomic_write_bytes(path, Record(tensors, info).to_bytes())
    return path, predictors


def load_onboarded(path: str | Path) -> tuple[dict[str, StateDict], dict[str, Any]]:
    """A saved newcomer's models by variant (``""``: the personalised model) and the file's metadata."""
    record = Record.from_bytes(Path(path).read_bytes())
    models: dict[str, StateDict] = {}
    for key, value in record.tensors.items():
        variant, _, name = key.rpartition("/")
        models.setdefault(variant, {})[name] = value
    return models, record.meta
