"""Datasets from the user's own files: ``.npz`` arrays, a CSV table, an ImageFolder tree."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field

from fedmerge.data.errors import DataUnavailable
from fedmerge.data.pool import DATASETS, DatasetConfig, Pool, encode_labels, standardize
from fedmerge.data.sources.images import to_unit_float

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


def require_file(path: str | Path, what: str) -> Path:
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataUnavailable(f"{what} not found: {path} (check dataset.path)")
    return path


def encode_ids(values: np.ndarray) -> np.ndarray:
    """Client ids of any type -> 0..K-1 in sorted order (so client k is the k-th smallest id)."""
    return encode_labels(values)[0]


class NpzConfig(DatasetConfig):
    name: Literal["npz"] = "npz"
    path: str = Field(description="a .npz file with arrays x, y and optionally client_id")


@DATASETS.register("npz", config=NpzConfig, description="your .npz with x, y (and client_id for natural clients)")
def load_npz(cfg: NpzConfig) -> Pool:
    path = require_file(cfg.path, "npz file")
    with np.load(path, allow_pickle=False) as f:
        missing = {"x", "y"} - set(f.files)
        if missing:
            raise ValueError(f"{path}: missing array(s) {sorted(missing)}; found {sorted(f.files)}")
        x, y = f["x"], f["y"]
        client_id = f["client_id"] if "client_id" in f.files else None
    if y.ndim != 1 or len(y) != len(x):
        raise ValueError(f"{path}: y must be 1-D with one label per row of x; got x {x.shape}, y {y.shape}")
    if x.ndim == 2:
        x = standardize(x)
    elif x.ndim in (3, 4):
        # (N, H, W) gains a channel axis; 4-D arrays must already be N x C x H x W.
        x = to_unit_float(x if x.ndim == 4 else x[:, None])
    else:
        raise ValueError(f"{path}: x must be 2-D (tabular) or 3/4-D (images), got shape {x.shape}")
    labels, class_names = encode_labels(y)
    natural_id = None
    if client_id is not None:
        if client_id.shape != y.shape:
            raise ValueError(f"{path}: client_id must have shape {y.shape}, got {client_id.shape}")
        natural_id = encode_ids(client_id)
    return Pool(x, labels, len(class_names), Path(path).stem, natural_id=natural_id, class_names=class_names)


class CsvConfig(DatasetConfig):
    name: Literal["csv"] = "csv"
    path: str = Field(description="a CSV file with a header row")
    label_column: str = "label"
    client_column: str | None = Field(None, description="column of client ids, for natural partitions")
    delimiter: str = Field(",", min_length=1, max_length=1)


def sorted_codes(values: list[str]) -> tuple[np.ndarray, list[str]]:
    """Encode string values, sorting numerically when every value is a number ('2' before '10')."""
    try:
        numbers = np.array([float(v) for v in values])
    except ValueError:
        return encode_labels(np.array(values))
    codes, _ = encode_labels(numbers)
    names: dict[int, str] = {}
    for code, value in zip(codes.tolist(), values, strict=True):
        names.setdefault(code, value)
    return codes, [names[c] for c in range(len(names))]


@DATASETS.register("csv", config=CsvConfig, description="your CSV table: numeric features and a label column")
def load_csv(cfg: CsvConfig) -> Pool:
    path = require_file(cfg.path, "CSV file")
    with open(path, newline="") as f:
        rows = list(csv.reader(f, delimiter=cfg.delimiter))
    if len(rows) < 2:
        raise ValueError(f"{path}: needs a header row and at least one data row")
    header, body = [h.strip() for h in rows[0]], rows[1:]
    for column in (cfg.label_column, cfg.client_column):
        if column is not None and column not in header:
            raise ValueError(f"{path}: no column {column!r} (dataset.label_column/client_column); have {header}")
    for line, row in enumerate(body, start=2):
        if len(row) != len(header):
            raise ValueError(f"{path}, line {line}: {len(row)} fields, header has {len(header)}")
    columns = {name: [row[i].strip() for row in body] for i, name in enumerate(header)}
    features = [h for h in header if h not in (cfg.label_column, cfg.client_column)]
    if not features:
        raise ValueError(f"{path}: no feature columns besides the label/client columns")
    x = np.empty((len(body), len(features)), dtype=np.float64)
    for j, name in enumerate(features):
        for i, value in enumerate(columns[name]):
            try:
                x[i, j] = float(value)
            except ValueError:
                raise ValueError(
                    f"{path}: feature column {name!r} is not numeric (line {i + 2}: {value!r}); "
                    "encode it as numbers or drop it"
                ) from None
    if not np.isfinite(x).all():
        raise ValueError(f"{path}: feature values must be finite (found nan/inf)")
    labels, class_names = sorted_codes(columns[cfg.label_column])
    natural_id = sorted_codes(columns[cfg.client_column])[0] if cfg.client_column else None
    return Pool(standardize(x), labels, len(class_names), path.stem, natural_id=natural_id, class_names=class_names)


class ImageFolderConfig(DatasetConfig):
    name: Literal["image_folder"] = "image_folder"
    path: str = Field(description="root folder with one sub-folder of images per class")
    image_size: int = Field(32, ge=1, le=1024)
    channels: Literal[1, 3] = 3


@DATASETS.register(
    "image_folder", config=ImageFolderConfig, description="your ImageFolder tree: path/<class>/*.png|jpg"
)
def load_image_folder(cfg: ImageFolderConfig) -> Pool:
    from PIL import Image

    root = Path(cfg.path).expanduser()
    if not root.is_dir():
        raise DataUnavailable(f"image folder not found: {root} (check dataset.path)")
    class_dirs = sorted(d for d in root.iterdir() if d.is_dir())
    files = [
        (f, c) for c, d in enumerate(class_dirs) for f in sorted(d.iterdir()) if f.suffix.lower() in IMAGE_SUFFIXES
    ]
    if not files:
        raise DataUnavailable(f"{root}: no images found; expected {root}/<class_name>/<image>.png|jpg")
    mode = "L" if cfg.channels == 1 else "RGB"
    size = (cfg.image_size, cfg.image_size)
    x = np.empty((len(files), size[1], size[0], cfg.channels), dtype=np.uint8)
    for i, (file, _) in enumerate(files):
        with Image.open(file) as im:
            x[i] = np.asarray(im.convert(mode).resize(size, Image.BILINEAR)).reshape(size[1], size[0], -1)
    y = np.array([c for _, c in files], dtype=np.int64)
    return Pool(
        to_unit_float(x.transpose(0, 3, 1, 2)),
        y,
        len(class_dirs),
        root.name,
        class_names=[d.name for d in class_dirs],
    )
