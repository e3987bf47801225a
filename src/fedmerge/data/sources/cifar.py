"""CIFAR-10 / CIFAR-100 from the standard python pickle batches (the ``*-python.tar.gz`` releases).

The batches are pickles: only point ``path`` at files you trust.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field

from fedmerge.data.errors import DataUnavailable
from fedmerge.data.pool import DATASETS, DatasetConfig, Pool

CIFAR10_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
CIFAR100_FILES = ["train", "test"]


def batch_folder(path: str, files: list[str], subdir: str, release: str) -> Path:
    """Accept the extracted folder itself or its parent."""
    root = Path(path).expanduser()
    for folder in (root, root / subdir):
        if all((folder / f).is_file() for f in files):
            return folder
    raise DataUnavailable(
        f"{release} batches ({', '.join(files)}) not found in {root} or {root / subdir}; "
        f"download and extract the python version of {release} on a machine with access "
        "and set dataset.path to the folder"
    )


def unpickle(path: Path) -> dict:
    with open(path, "rb") as f:
        data = pickle.load(f, encoding="bytes")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in data.items()}


def read_batches(folder: Path, files: list[str], label_key: str) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = [], []
    for name in files:
        batch = unpickle(folder / name)
        xs.append(np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        ys.append(np.asarray(batch[label_key], dtype=np.int64))
    x = (np.concatenate(xs).astype(np.float32) / 255.0).astype(np.float32)
    return x, np.concatenate(ys)


def label_names(meta_path: Path, key: str, count: int) -> list[str]:
    if meta_path.is_file():
        names = unpickle(meta_path).get(key)
        if names is not None and len(names) == count:
            return [n.decode() if isinstance(n, bytes) else str(n) for n in names]
    return [str(i) for i in range(count)]


class Cifar10Config(DatasetConfig):
    name: Literal["cifar10"] = "cifar10"
    path: str = Field(description="folder holding data_batch_1..5 and test_batch (cifar-10-batches-py)")


@DATASETS.register("cifar10", config=Cifar10Config, description="CIFAR-10 python batches from dataset.path")
def load_cifar10(cfg: Cifar10Config) -> Pool:
    folder = batch_folder(cfg.path, CIFAR10_FILES, "cifar-10-batches-py", "CIFAR-10")
    x, y = read_batches(folder, CIFAR10_FILES, "labels")
    names = label_names(folder / "batches.meta", "label_names", 10)
    return Pool(x, y, 10, "cifar10", class_names=names)


class Cifar100Config(DatasetConfig):
    name: Literal["cifar100"] = "cifar100"
    path: str = Field(description="folder holding train and test (cifar-100-python)")
    labels: Literal["fine", "coarse"] = Field("fine", description="100 fine classes or 20 superclasses")


@DATASETS.register("cifar100", config=Cifar100Config, description="CIFAR-100 python batches from dataset.path")
def load_cifar100(cfg: Cifar100Config) -> Pool:
    folder = batch_folder(cfg.path, CIFAR100_FILES, "cifar-100-python", "CIFAR-100")
    x, y = read_batches(folder, CIFAR100_FILES, f"{cfg.labels}_labels")
    count = 100 if cfg.labels == "fine" else 20
    names = label_names(folder / "meta", f"{cfg.labels}_label_names", count)
    return Pool(x, y, count, "cifar100", class_names=names)
