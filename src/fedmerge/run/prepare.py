"""Before a run exists: its device, its data, and the checks that refuse a model that cannot read the data."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from fedmerge.config.schema import ConfigError, ExperimentConfig, dataset_label
from fedmerge.core.training import LocalTraining
from fedmerge.data import DataUnavailable, FederatedDataset, build_federated_dataset
from fedmerge.data.errors import DataWarning
from fedmerge.engines.device import DeviceUnavailable
from fedmerge.engines.device import resolve_device as engine_device
from fedmerge.models import build_model


def resolve_device(name: str) -> torch.device:
    try:
        return engine_device(name)
    except DeviceUnavailable as exc:
        raise ConfigError(str(exc)) from None


def load_data(cfg: ExperimentConfig) -> FederatedDataset:
    """The partitioned data of ``cfg``. Data that loads but is most likely not meant (a loader's flags, a
    single class) raises a `DataWarning`: [`data_warnings()`][fedmerge.run.prepare.data_warnings] turns it into one
    line."""
    try:
        data = build_federated_dataset(cfg.dataset, cfg.partition, cfg.split, cfg.noise, cfg.seed)
    except DataUnavailable:
        raise
    except ValueError as exc:  # impossible values only known once the data is loaded
        raise ConfigError(str(exc).splitlines()[0]) from None
    if data.num_classes == 1:
        name = f" ({data.class_names[0]!r})" if data.class_names else ""
        warnings.warn(
            f"dataset {data.name!r} has a single class{name}: every prediction is right, so accuracy is 1.0 by "
            "construction; check the labels (dataset.label_column for a CSV)",
            DataWarning,
            stacklevel=2,
        )
    return data


@contextmanager
def data_warnings(notify: Callable[[str], None]) -> Iterator[None]:
    """Each `DataWarning` raised inside goes to ``notify`` as one ``warning:`` line; other warnings
    are shown as they would have been."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DataWarning)
        yield
    for w in caught:
        if issubclass(w.category, DataWarning):
            notify(f"warning: {w.message}")
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def describe_inputs(x: torch.Tensor) -> str:
    shape = tuple(x.shape[1:])
    kind = "token ids" if not x.is_floating_point() else "images" if len(shape) == 3 else "features"
    return f"{kind} of shape {shape}, {str(x.dtype).removeprefix('torch.')}"


def check_compatibility(
    cfg: ExperimentConfig, sample: torch.Tensor, num_classes: int, device: torch.device
) -> torch.nn.Module:
    """Build the model for inputs like ``sample`` (a batch) and run it on them, so that a model that
    cannot read the dataset's inputs (e.g. ``mlp`` on token ids) is refused in one line before
    anything is written. Returns the model (the engine's reusable instance)."""
    where = f"model {cfg.model.name!r} does not fit dataset {dataset_label(cfg.dataset)!r} ({describe_inputs(sample)})"
    hint = "; token data needs model.name=minilm_lora or lstm" if not sample.is_floating_point() else ""
    try:
        model = build_model(cfg.model, tuple(sample.shape[1:]), num_classes, torch.Generator().manual_seed(0))
        model = model.to(device)
    except (ValueError, TypeError, RuntimeError) as exc:  # includes a missing optional dependency (LoRA)
        raise ConfigError(f"{where}: {first_line(exc)}{hint}") from None
    if sample.is_floating_point() and getattr(model, "reads_tokens", False):  # else torch's "index out of range"
        kind = "images" if sample.dim() == 4 else "tabular features"
        fit = "a CNN (fedmerge list model)" if sample.dim() == 4 else "model.name=mlp"
        raise ConfigError(f"{where}: it reads int64 token ids, not {kind}; use {fit}")
    was_training = model.training
    try:
        # eval mode + forked RNG: the probe changes no weight, buffer or random stream of the run
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            model.eval()
            logits = model(sample.to(device))
    except (ValueError, TypeError, RuntimeError, IndexError) as exc:
        raise ConfigError(f"{where}: {first_line(exc)}{hint}") from None
    finally:
        model.train(was_training)
    # a model with its own task loss (a causal LM) is not a classifier: its outputs are its business
    if not hasattr(model, "task_loss") and tuple(logits.shape) != (len(sample), num_classes):
        raise ConfigError(f"{where}: it returns shape {tuple(logits.shape)}, expected (N, {num_classes})")
    # the registry takes any ComponentConfig: a plugin's method config may have no local training
    trains_in_batches = isinstance(cfg.algorithm, LocalTraining)
    if trains_in_batches and cfg.algorithm.batch_size == 1 and any(isinstance(m, _BatchNorm) for m in model.modules()):
        raise ConfigError(
            f"algorithm.batch_size: 1 cannot train model {cfg.model.name!r}: its BatchNorm layers need 2 or more "
            "samples per batch"
        )
    return model


def without_test(data: FederatedDataset) -> FederatedDataset:
    """The same clients with empty test splits (evaluation skips an empty split)."""
    empty = [replace(c, x_test=c.x_test[:0], y_test=c.y_test[:0]) for c in data.clients]
    return replace(data, clients=empty)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
