"""Fashion-MNIST from the Debian package's IDX files (train and test pooled: 70,000 28x28)."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field

from fedmerge.data.errors import DataUnavailable
from fedmerge.data.pool import DATASETS, DatasetConfig, Pool

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]  # fmt: skip
FILES = [
    ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
]


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (gzip or plain) of unsigned bytes."""
    raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    if raw[2] != 0x08:
        raise ValueError(f"{path}: only unsigned-byte IDX files are supported")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def find_idx(folder: Path, stem: str) -> Path:
    for candidate in (folder / f"{stem}.gz", folder / stem):
        if candidate.is_file():
            return candidate
    raise DataUnavailable(
        f"Fashion-MNIST file {stem}.gz not found in {folder}; install it with "
        "`apt-get install -y dataset-fashion-mnist` or set dataset.data_dir to a folder holding the IDX files"
    )


class FashionMnistConfig(DatasetConfig):
    name: Literal["fashion_mnist"] = "fashion_mnist"
    data_dir: str = Field(FASHION_MNIST_DIR, description="folder with the four *-idx?-ubyte(.gz) files")


@DATASETS.register(
    "fashion_mnist",
    config=FashionMnistConfig,
    description="Fashion-MNIST, 70,000 28x28 (dataset-fashion-mnist)",
)
def load_fashion_mnist(cfg: FashionMnistConfig) -> Pool:
    folder = Path(cfg.data_dir)
    paths = [(find_idx(folder, img), find_idx(folder, lab)) for img, lab in FILES]
    images = np.concatenate([read_idx(img) for img, _ in paths])
    labels = np.concatenate([read_idx(lab) for _, lab in paths]).astype(np.int64)
    x = (images.astype(np.float32) / 255.0)[:, None]
    return Pool(x=x, y=labels, num_classes=10, name="fashion_mnist", class_names=list(FASHION_CLASSES))
