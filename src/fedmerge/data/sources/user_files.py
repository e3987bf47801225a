"""Datasets from the user's own files: ``.npz`` arrays, a CSV table, an ImageFolder tree."""

from __future__ import annotations

import csv
import warnings
import zipfile
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, field_validator

from fedmerge.data.errors import DataUnavailable, DataWarning
from fedmerge.data.pool import DATASETS, DatasetConfig, Pool, encode_labels, require_finite, to_float32
from fedmerge.data.sources.images import to_unit_float

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


def require_file(path: str | Path, what: str) -> Path:
    path = Path(path).expanduser()
    if path.is_dir():
        raise DataUnavailable(
            f"{what} expected, {path} is a folder (check dataset.path; a folder of class folders "
            "of images is dataset.name=image_folder)"
        )
    if not path.is_file():
        raise DataUnavailable(f"{what} not found: {path} (check dataset.path)")
    return path


def class_labels(values: np.ndarray, where: str, fix: str) -> tuple[np.ndarray, list[str]]:
    """Label values -> 0..C-1 and the class names, refusing values that are measurements rather than classes
    (a regression target would silently become one class per sample) and flagging fractional ones."""
    codes, names = encode_labels(values)
    numeric = values.dtype.kind in "biuf"
    fractional = values[values != np.round(values)] if values.dtype.kind == "f" else values[:0]
    if len(values) >= 20 and len(names) > len(values) // 2:  # a handful of rows says too little to judge
        example = f"e.g. {fractional[0]:g}, not a whole number" if fractional.size else f"e.g. {names[0]!r}"
        raise ValueError(
            f"{where}: {len(names)} distinct labels for {len(values)} samples ({example}): fewer than 2 samples per "
            f"class, so these look like {'measurements' if numeric else 'ids'}, not classes; fedmerge trains "
            f"classifiers: {fix}"
        )
    if fractional.size:
        warnings.warn(
            f"{where}: labels {', '.join(names[:4])}{', ...' if len(names) > 4 else ''} are not whole numbers; "
            f"they are taken as {len(names)} class names",
            DataWarning,
            stacklevel=2,
        )
    return codes, names


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def encode_ids(values: np.ndarray) -> np.ndarray:
    """Client ids of any type -> 0..K-1 in sorted order (so client k is the k-th smallest id)."""
    return encode_labels(values)[0]


class TabularOptions(DatasetConfig):
    """Options of the loaders that can yield tabular (N x F) features."""

    standardize: bool = Field(
        True,
        description="tabular x: zero mean, unit variance per feature, with statistics of the training samples "
        "only; images and tokens are never standardized",
    )


class NpzConfig(TabularOptions):
    name: Literal["npz"] = "npz"
    path: str = Field(description="a .npz file with arrays x, y and optionally client_id")


@DATASETS.register("npz", config=NpzConfig, description="your .npz with x, y (and client_id for natural clients)")
def load_npz(cfg: NpzConfig) -> Pool:
    path = require_file(cfg.path, "npz file")
    if not zipfile.is_zipfile(path):  # else np.load reads a .npy as one array, and anything else as a pickle
        raise ValueError(f"{path}: not a .npz archive (numpy.savez writes one: np.savez(path, x=x, y=y))")
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = {"x", "y"} - set(f.files)
            if missing:
                raise ValueError(f"{path}: missing array(s) {sorted(missing)}; found {sorted(f.files)}")
            x, y = f["x"], f["y"]
            client_id = f["client_id"] if "client_id" in f.files else None
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        raise ValueError(f"{path}: not a readable .npz file ({str(exc).splitlines()[0]})") from None
    except ValueError as exc:
        if str(exc).startswith(str(path)):
            raise
        raise ValueError(f"{path}: not a readable .npz file ({str(exc).splitlines()[0]})") from None
    if y.ndim != 1 or len(y) != len(x):
        raise ValueError(f"{path}: y must be 1-D with one label per row of x; got x {x.shape}, y {y.shape}")
    if x.dtype.kind not in "biuf":
        raise ValueError(f"{path}: x must be numeric, got dtype {x.dtype}")
    if y.dtype.kind == "f":
        require_finite(y, f"{path}: y")
    if x.ndim == 2:
        x = require_finite(to_float32(x), f"{path}: x")
    elif x.ndim in (3, 4):
        # (N, H, W) gains a channel axis; 4-D arrays are N x C x H x W, or N x H x W x C (below)
        x = require_finite(to_unit_float(channels_first(x, path) if x.ndim == 4 else x[:, None]), f"{path}: x")
    else:
        raise ValueError(f"{path}: x must be 2-D (tabular) or 3/4-D (images), got shape {x.shape}")
    labels, class_names = class_labels(y, f"{path}: y", "store class ids or names in y")
    natural_id = None
    if client_id is not None:
        if client_id.shape != y.shape:
            raise ValueError(f"{path}: client_id must have shape {y.shape}, got {client_id.shape}")
        natural_id = encode_ids(client_id)
    return Pool(
        x, labels, len(class_names), Path(path).stem, natural_id=natural_id, class_names=class_names,
        standardize=cfg.standardize and x.ndim == 2,
    )  # fmt: skip


def channels_first(x: np.ndarray, path: Path) -> np.ndarray:
    """``N x C x H x W`` images; ``N x H x W x C`` (numpy's and PIL's order, C of 1, 3 or 4, H more than 4) is
    transposed, with a warning, instead of being read as H channels of W x C pixels."""
    if x.shape[3] in (1, 3, 4) and x.shape[1] > 4:
        warnings.warn(
            f"{path}: x of shape {x.shape} is read as N x H x W x C ({x.shape[3]} channel(s) of "
            f"{x.shape[1]} x {x.shape[2]}); store it as N x C x H x W to silence this",
            DataWarning,
            stacklevel=2,
        )
        return x.transpose(0, 3, 1, 2)
    return x


class CsvConfig(TabularOptions):
    name: Literal["csv"] = "csv"
    path: str = Field(description="a CSV file: numeric feature columns and a label column")
    header: bool | None = Field(
        None,
        description="true: the first row names the columns; false: it is data and the columns are named "
        "col0..colK; default: a header, refused when its names are all numbers (then it is most likely data)",
    )
    label_column: str | int = Field("label", description="the label column's name, or its index (0-based, -1 last)")
    client_column: str | int | None = Field(
        None, description="column of client ids (name or index), for natural partitions"
    )
    delimiter: str = Field(",", min_length=1, max_length=1, description="one character; '\\t' for tab-separated")

    @field_validator("delimiter", mode="before")
    @classmethod
    def _escaped_tab(cls, value: object) -> object:
        return "\t" if value == "\\t" else value  # dataset.delimiter='\t' from a shell arrives as backslash, t


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


def csv_labels(values: list[str], where: str) -> tuple[np.ndarray, list[str]]:
    """The label column's classes ([`sorted_codes()`][fedmerge.data.sources.user_files.sorted_codes]), refused or
    flagged as [`class_labels()`][fedmerge.data.sources.user_files.class_labels] does."""
    try:
        numbers = np.array([float(v) for v in values])
    except ValueError:
        numbers = np.array(values)
    class_labels(numbers, where, "set dataset.label_column to the column of classes")
    return sorted_codes(values)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def csv_columns(path: Path, cfg: CsvConfig) -> list[str]:
    """Column names from the first row (or col0..colK when ``header`` is false), refusing duplicate
    names and a first row that looks like data."""
    try:
        # utf-8-sig: a byte-order mark (Excel's "CSV UTF-8") is not part of the first column's name
        with open(path, newline="", encoding="utf-8-sig") as f:
            first = next(csv.reader(f, delimiter=cfg.delimiter), None)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start} is not UTF-8); save the CSV as UTF-8") from None
    if not first:
        raise ValueError(f"{path}: empty file")
    if cfg.header is False:
        return [f"col{i}" for i in range(len(first))]
    names = [h.strip() for h in first]
    no_header = (
        "if the file has no header row, set dataset.header=false (columns are then col0..colK; name the label "
        f"by index, e.g. dataset.label_column={len(names) - 1} for the last column)"
    )
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{path}: duplicate column names {repeated[:5]} in the first row; rename them, or {no_header}")
    if cfg.header is None:
        named = [c for c in (cfg.label_column, cfg.client_column) if c is not None]
        special = {names[c] if isinstance(c, int) and -len(names) <= c < len(names) else c for c in named}
        features = [n for n in names if n not in special]
        if features and all(_is_number(n) for n in features):
            raise ValueError(
                f"{path}: the first row looks like data, not a header (its feature names {features[:3]} are "
                f"numbers); {no_header}; if those numbers are the column names, set dataset.header=true"
            )
    return names


def _column_name(names: list[str], column: str | int, path: Path, role: str) -> str:
    if isinstance(column, int):
        if not -len(names) <= column < len(names):
            raise ValueError(f"{path}: {role} column index {column} is out of range ({len(names)} columns)")
        return names[column]
    if column not in names:
        shown = names if len(names) <= 12 else [*names[:10], "...", names[-1]]
        other = [d for d in ";\t|," if d in names[0]] if len(names) == 1 else []  # read as one column
        hint = f"; if the columns are separated by {other[0]!r}, set dataset.delimiter={other[0]!r}" if other else ""
        raise ValueError(f"{path}: no column {column!r} (dataset.{role}_column); have {shown}{hint}")
    return column


def _client_name(names: list[str], cfg: CsvConfig, path: Path) -> list[str]:
    return [] if cfg.client_column is None else [_column_name(names, cfg.client_column, path, "client")]


@DATASETS.register("csv", config=CsvConfig, description="your CSV table: numeric features and a label column")
def load_csv(cfg: CsvConfig) -> Pool:
    import pandas as pd

    path = require_file(cfg.path, "CSV file")
    names = csv_columns(path, cfg)
    label = _column_name(names, cfg.label_column, path, "label")
    client = _client_name(names, cfg, path)
    if client == [label]:
        raise ValueError(f"{path}: the label and client columns are the same column ({label!r})")
    features = [n for n in names if n != label and n not in client]
    if not features:
        raise ValueError(f"{path}: no feature columns besides the label/client columns")
    text_columns = {names.index(n): str for n in [label, *client]}
    try:  # the C parser reads every column in one vectorised pass
        table = pd.read_csv(
            path, sep=cfg.delimiter, header=None, skiprows=0 if cfg.header is False else 1, names=range(len(names)),
            dtype=text_columns, keep_default_na=False, na_values=["", "NA", "NaN", "nan", "null"],
            skipinitialspace=True, engine="c", low_memory=False, encoding="utf-8-sig",
        )  # fmt: skip
    except UnicodeDecodeError:  # past the first kilobytes, which csv_columns checked
        raise ValueError(f"{path}: not UTF-8 text; save the CSV as UTF-8") from None
    except (pd.errors.ParserError, ValueError) as exc:
        raise ValueError(f"{path}: cannot parse it as CSV ({str(exc).strip().splitlines()[-1]})") from None
    if table.empty:
        raise ValueError(f"{path}: needs at least one data row")
    feature_idx = [names.index(n) for n in features]
    x = _numeric_features(table, feature_idx, names, path)
    x = require_finite(x, f"{path}: features", "empty fields count too")
    labels, class_names = csv_labels(_text_column(table, names.index(label), label, path), f"{path}: column {label!r}")
    natural_id = sorted_codes(_text_column(table, names.index(client[0]), client[0], path))[0] if client else None
    return Pool(
        x, labels, len(class_names), path.stem, natural_id=natural_id, class_names=class_names,
        standardize=cfg.standardize,
    )  # fmt: skip


def _numeric_features(table: Any, idx: list[int], names: list[str], path: Path) -> np.ndarray:
    import pandas as pd

    for i in idx:
        column = table[i]
        if not pd.api.types.is_numeric_dtype(column):
            as_number = pd.to_numeric(column, errors="coerce")
            row = int(np.flatnonzero(as_number.isna() & column.notna())[0])
            raise ValueError(
                f"{path}: feature column {names[i]!r} is not numeric (data row {row + 1}: {column.iloc[row]!r}); "
                "encode it as numbers or drop it"
            )
    return to_float32(table[idx].to_numpy())


def _text_column(table: Any, i: int, name: str, path: Path) -> list[str]:
    values = table[i].fillna("").str.strip()
    empty = int((values == "").sum())
    if empty:
        raise ValueError(f"{path}: column {name!r} has {empty} empty value(s)")
    return values.tolist()


class ImageFolderConfig(DatasetConfig):
    name: Literal["image_folder"] = "image_folder"
    path: str = Field(description="root folder with one sub-folder of images per class")
    image_size: int = Field(32, ge=1, le=1024, description="every image is resized to image_size x image_size")
    channels: Literal[1, 3] = Field(3, description="1: read as grayscale; 3: read as RGB")


def is_hidden(path: Path) -> bool:
    """Folders and files no user means as data: .ipynb_checkpoints, macOS's __MACOSX and ._ files, .git..."""
    return path.name.startswith((".", "__MACOSX"))


@DATASETS.register(
    "image_folder", config=ImageFolderConfig, description="your ImageFolder tree: path/<class>/*.png|jpg"
)
def load_image_folder(cfg: ImageFolderConfig) -> Pool:
    from PIL import Image, UnidentifiedImageError

    root = Path(cfg.path).expanduser()
    if root.is_file():
        raise DataUnavailable(
            f"{root} is a file, not a folder: image_folder reads a folder with one sub-folder of images per class "
            "(for a .csv or .npz file, give dataset.name=csv or npz, or leave dataset.name out)"
        )
    if not root.is_dir():
        raise DataUnavailable(f"image folder not found: {root} (check dataset.path)")
    class_dirs = sorted(d for d in root.iterdir() if d.is_dir() and not is_hidden(d))
    images = {d: [f for f in sorted(d.iterdir()) if f.suffix.lower() in IMAGE_SUFFIXES and not is_hidden(f)]
              for d in class_dirs}  # fmt: skip
    files = [(f, c) for c, d in enumerate(class_dirs) for f in images[d]]
    if not files:
        raise DataUnavailable(f"{root}: no images found; expected {root}/<class_name>/<image>.png|jpg")
    empty = [d.name for d in class_dirs if not images[d]]
    if empty:
        raise ValueError(
            f"{root}: class folder(s) {empty[:5]} hold no images ({', '.join(sorted(IMAGE_SUFFIXES))}); every "
            "sub-folder is a class: remove them or add their images"
        )
    mode = "L" if cfg.channels == 1 else "RGB"
    size = (cfg.image_size, cfg.image_size)
    x = np.empty((len(files), size[1], size[0], cfg.channels), dtype=np.uint8)
    for i, (file, _) in enumerate(files):
        try:
            with Image.open(file) as im:
                x[i] = np.asarray(im.convert(mode).resize(size, Image.BILINEAR)).reshape(size[1], size[0], -1)
        except UnidentifiedImageError:
            raise ValueError(f"{file}: not an image (PIL cannot identify it); replace or remove it") from None
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:  # e.g. a truncated JPEG
            raise ValueError(f"{file}: not a readable image ({first_line(exc)}); replace or remove it") from None
    y = np.array([c for _, c in files], dtype=np.int64)
    return Pool(
        to_unit_float(x.transpose(0, 3, 1, 2)),
        y,
        len(class_dirs),
        root.name,
        class_names=[d.name for d in class_dirs],
    )
