"""What the loaders of fetched datasets share: their config options, the verified files, and the cached,
preprocessed uint8 arrays they build a Pool from."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field, field_validator

from fedmerge.data.cache import ArrayCache, Arrays, PoolCacheRef, params_key
from fedmerge.data.catalog import CATALOG, dataset_files
from fedmerge.data.download import DownloadError, expected_checksum, resolve_data_dir
from fedmerge.data.pool import DatasetConfig

CONVERT_ROWS = 4096  # uint8 -> float32 in blocks: no second full-size temporary


class FetchedConfig(DatasetConfig):
    """Options of every dataset that `fedmerge data fetch` downloads."""

    data_dir: str | None = Field(
        None, description="cache root holding <name>/ (default: $FEDMERGE_DATA_DIR, else ~/.cache/fedmerge/data)"
    )
    download: bool = Field(
        False, description="download and verify the files when missing (a run never touches the network otherwise)"
    )
    mirror: list[str] | None = Field(
        None,
        description="mirrors tried before the publisher's URLs: base URLs or folders holding <name>/<file> "
        "(default: $FEDMERGE_DATA_MIRROR, space-separated); every file is still checked against its checksum",
    )

    @field_validator("mirror", mode="before")
    @classmethod
    def _one_or_more(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value


def cached_arrays(
    name: str,
    cfg: FetchedConfig,
    params: dict[str, Any],
    build: Callable[[dict[str, Path]], Arrays],
    needed: Sequence[str] | None = None,
) -> tuple[Arrays, PoolCacheRef]:
    """The preprocessed arrays of ``name`` for ``params``: from the cache, else built from the verified
    files (``needed`` ones, default all; checked against their checksums first) and cached. Also the pool's
    cache reference, keyed by the same parameters and the files' checksums."""
    files = dataset_files(name, cfg.data_dir, cfg.download, cfg.mirror, needed)
    entry = CATALOG.get(name)
    folder = entry.folder(cfg.data_dir)
    full = {"dataset": name, "files": {f.name: expected_checksum(f, folder) for f in entry.files}, **params}
    cache = ArrayCache(resolve_data_dir(cfg.data_dir) / "cache")

    def verified_build() -> Arrays:
        from pooch.hashes import hash_matches

        for remote in entry.files:
            path = files.get(remote.name)
            if path is None:
                continue
            known = expected_checksum(remote, folder)
            if known is None or not hash_matches(str(path), known):
                raise DownloadError(
                    f"{path} does not match {known} (damaged or replaced); delete it and run "
                    f"`fedmerge data fetch {name}`"
                )
        return build(files)

    return cache.get_or_build(name, full, verified_build), PoolCacheRef(cache, params_key(full))


def cached_folder_arrays(
    name: str,
    cfg: FetchedConfig,
    folder: Path,
    params: dict[str, Any],
    build: Callable[[], Arrays],
    key_files: list[str],
) -> tuple[Arrays, PoolCacheRef]:
    """``cached_arrays`` for an extracted folder (another tool's layout): no archive checksum to key the cache
    on, so it is keyed by the folder's place and the SHA-256 of its index files (``key_files``)."""
    from fedmerge.data.cache import file_sha256

    index = {f: file_sha256(folder / f) for f in key_files if (folder / f).is_file()}
    full = {"dataset": name, "extracted": str(folder.resolve()), "index": index, **params}
    cache = ArrayCache(resolve_data_dir(cfg.data_dir) / "cache")
    return cache.get_or_build(name, full, build), PoolCacheRef(cache, params_key(full))


class FolderArchive:
    """An extracted archive read like ``zipfile.ZipFile``: ``namelist()`` (posix paths) and ``read(name)``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def namelist(self) -> list[str]:
        return sorted(p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file())

    def read(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def __enter__(self) -> FolderArchive:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def unit_float(images: np.ndarray) -> np.ndarray:
    """uint8 ``N x C x H x W`` -> float32 in [0, 1], converted block by block."""
    out = np.empty(images.shape, dtype=np.float32)
    for start in range(0, len(images), CONVERT_ROWS):
        np.divide(images[start : start + CONVERT_ROWS], 255.0, out=out[start : start + CONVERT_ROWS], dtype=np.float32)
    return out


def decode_image(data: bytes, size: int | None, mode: str = "RGB") -> np.ndarray:
    """Image file bytes -> uint8 ``C x H x W`` (resized to ``size x size`` when given)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        im = im.convert(mode)
        if size is not None and im.size != (size, size):
            im = im.resize((size, size), Image.BILINEAR)
        arr = np.asarray(im, dtype=np.uint8)
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)


def decode_thumbnail(data: bytes, size: int) -> np.ndarray:
    """LEAF's FEMNIST step: grey, ``thumbnail((size, size))`` with antialiasing -> uint8 ``H x W``."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        gray = im.convert("L")
        gray.thumbnail((size, size), Image.LANCZOS)
        return np.asarray(gray, dtype=np.uint8).copy()


def progress(iterable: Any, total: int | None, desc: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit="img", leave=False, mininterval=1.0)
