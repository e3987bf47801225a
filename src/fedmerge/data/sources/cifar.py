"""CIFAR-10 / CIFAR-100 from the standard python pickle batches (the ``*-python.tar.gz`` releases).

Either ``path`` (an extracted folder) or the archive that `fedmerge data fetch cifar10|cifar100` verified
(read in place). The batches are pickles: only point ``path`` at files you trust; a fetched archive
matched its published checksum.
"""

from __future__ import annotations

import io
import pickle
import tarfile
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field

from fedmerge.data.errors import DataUnavailable
from fedmerge.data.pool import DATASETS, Pool
from fedmerge.data.sources.fetched import FetchedConfig, cached_arrays, unit_float

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


def extracted_in(data_dir: str | None, files: list[str], subdir: str) -> str | None:
    """The data root when it holds extracted batches (itself or in ``subdir``, torchvision's layout), the root
    found as everywhere else: ``--data-dir`` / ``dataset.data_dir``, else ``$FEDMERGE_DATA_DIR``, else the
    default."""
    from fedmerge.data.download import resolve_data_dir

    root = resolve_data_dir(data_dir)
    return str(root) if any(all((f / n).is_file() for n in files) for f in (root, root / subdir)) else None


def unpickle(path: Path) -> dict:
    with open(path, "rb") as f:
        data = pickle.load(f, encoding="bytes")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in data.items()}


def unpickle_bytes(data: bytes) -> dict:
    batch = pickle.load(io.BytesIO(data), encoding="bytes")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()}


def read_batches(folder: Path, files: list[str], label_key: str) -> tuple[np.ndarray, np.ndarray]:
    x, y = stack_batches([unpickle(folder / name) for name in files], label_key)
    return unit_float(x), y


def stack_batches(batches: list[dict], label_key: str) -> tuple[np.ndarray, np.ndarray]:
    xs = [np.asarray(b["data"], dtype=np.uint8).reshape(-1, 3, 32, 32) for b in batches]
    return np.concatenate(xs), np.concatenate([np.asarray(b[label_key], dtype=np.int64) for b in batches])


def read_archive(path: Path, files: list[str], meta: str, label_key: str, names_key: str) -> dict[str, np.ndarray]:
    """The batches (and class names) straight from the fetched ``*-python.tar.gz``."""
    found: dict[str, dict] = {}
    with tarfile.open(path, "r:gz") as tf:
        for member in tf:
            base = member.name.rsplit("/", 1)[-1]
            if member.isfile() and base in (*files, meta):
                found[base] = unpickle_bytes(tf.extractfile(member).read())
    missing = [f for f in files if f not in found]
    if missing:
        raise DataUnavailable(f"{path}: batches {missing} missing (not the python version of CIFAR); fetch it again")
    x, y = stack_batches([found[f] for f in files], label_key)
    names = [n.decode() if isinstance(n, bytes) else str(n) for n in found.get(meta, {}).get(names_key, [])]
    return {"x": x, "y": y, "class_names": np.array(names, dtype=str)}


def load_fetched(
    cfg: FetchedConfig, archive: str, files: list[str], meta: str, label_key: str, names_key: str, count: int
) -> Pool:
    arrays, ref = cached_arrays(
        cfg.name, cfg, {"labels": label_key}, lambda f: read_archive(f[archive], files, meta, label_key, names_key)
    )
    names = [str(n) for n in arrays["class_names"]]
    names = names if len(names) == count else [str(i) for i in range(count)]
    return Pool(unit_float(arrays["x"]), arrays["y"], count, cfg.name, class_names=names, cache=ref)


def label_names(meta_path: Path, key: str, count: int) -> list[str]:
    if meta_path.is_file():
        names = unpickle(meta_path).get(key)
        if names is not None and len(names) == count:
            return [n.decode() if isinstance(n, bytes) else str(n) for n in names]
    return [str(i) for i in range(count)]


class Cifar10Config(FetchedConfig):
    name: Literal["cifar10"] = "cifar10"
    path: str | None = Field(
        None,
        description="folder holding data_batch_1..5 and test_batch (cifar-10-batches-py); default: the fetched archive",
    )


@DATASETS.register(
    "cifar10",
    config=Cifar10Config,
    description="CIFAR-10 python batches: dataset.path or `fedmerge data fetch cifar10`",
)
def load_cifar10(cfg: Cifar10Config) -> Pool:
    path = cfg.path or extracted_in(cfg.data_dir, CIFAR10_FILES, "cifar-10-batches-py")
    if path is None:
        return load_fetched(cfg, "cifar-10-python.tar.gz", CIFAR10_FILES, "batches.meta", "labels", "label_names", 10)
    folder = batch_folder(path, CIFAR10_FILES, "cifar-10-batches-py", "CIFAR-10")
    x, y = read_batches(folder, CIFAR10_FILES, "labels")
    names = label_names(folder / "batches.meta", "label_names", 10)
    return Pool(x, y, 10, "cifar10", class_names=names)


class Cifar100Config(FetchedConfig):
    name: Literal["cifar100"] = "cifar100"
    path: str | None = Field(
        None, description="folder holding train and test (cifar-100-python); default: the fetched archive"
    )
    labels: Literal["fine", "coarse"] = Field("fine", description="100 fine classes or 20 superclasses")


@DATASETS.register(
    "cifar100",
    config=Cifar100Config,
    description="CIFAR-100 python batches: dataset.path or `fedmerge data fetch cifar100`",
)
def load_cifar100(cfg: Cifar100Config) -> Pool:
    count = 100 if cfg.labels == "fine" else 20
    path = cfg.path or extracted_in(cfg.data_dir, CIFAR100_FILES, "cifar-100-python")
    if path is None:
        return load_fetched(
            cfg, "cifar-100-python.tar.gz", CIFAR100_FILES, "meta", f"{cfg.labels}_labels", f"{cfg.labels}_label_names",
            count,
        )  # fmt: skip
    folder = batch_folder(path, CIFAR100_FILES, "cifar-100-python", "CIFAR-100")
    x, y = read_batches(folder, CIFAR100_FILES, f"{cfg.labels}_labels")
    names = label_names(folder / "meta", f"{cfg.labels}_label_names", count)
    return Pool(x, y, count, "cifar100", class_names=names)
