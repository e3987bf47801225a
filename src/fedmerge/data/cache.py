"""On-disk cache of preprocessed arrays and partitions, keyed by every parameter that shapes them.

An entry is a folder ``<data dir>/cache/<kind>-<key>/`` holding one ``.npy`` per array and a
``manifest.json`` (the parameters and each file's SHA-256). The key is the SHA-256 of the parameters
(JSON, sorted keys, with a format version), so a changed parameter, seed included, finds another
entry and never a stale one. The folder is written under a temporary name and renamed into place,
``manifest.json`` last; an entry whose files do not match its manifest (truncated, altered, half
deleted) is refused with a warning, removed and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1
Arrays = dict[str, np.ndarray]


def params_key(params: dict[str, Any]) -> str:
    text = json.dumps({"format": FORMAT_VERSION, **params}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class ArrayCache:
    """Entries under ``root`` (normally ``<data dir>/cache``)."""

    root: Path

    def entry(self, kind: str, params: dict[str, Any]) -> Path:
        return self.root / f"{kind}-{params_key(params)}"

    def load(self, kind: str, params: dict[str, Any]) -> Arrays | None:
        """The arrays stored for exactly these parameters; None when absent or damaged (then removed)."""
        folder = self.entry(kind, params)
        manifest_path = folder / "manifest.json"
        if not manifest_path.is_file():
            return None
        try:
            manifest = json.loads(manifest_path.read_text())
            expected = json.loads(json.dumps(params, sort_keys=True, default=str))
            if manifest.get("params") != expected:
                raise ValueError("its parameters differ from the ones asked for")
            arrays = {}
            for name, meta in manifest["files"].items():
                path = folder / f"{name}.npy"
                if not path.is_file() or path.stat().st_size != meta["size"] or file_sha256(path) != meta["sha256"]:
                    raise ValueError(f"{path.name} does not match its recorded SHA-256")
                arrays[name] = np.load(path, allow_pickle=False)
            return arrays
        except (ValueError, KeyError, TypeError, OSError) as exc:
            print(f"cache entry {folder} is damaged ({exc}); rebuilding it", file=sys.stderr)
            shutil.rmtree(folder, ignore_errors=True)
            return None

    def store(self, kind: str, params: dict[str, Any], arrays: Arrays) -> Path:
        """Write the entry atomically (temporary folder, fsynced, renamed into place)."""
        folder = self.entry(kind, params)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=self.root))
        try:
            files = {}
            for name, array in arrays.items():
                path = tmp / f"{name}.npy"
                with open(path, "wb") as f:
                    np.save(f, np.ascontiguousarray(array), allow_pickle=False)
                    f.flush()
                    os.fsync(f.fileno())
                files[name] = {"sha256": file_sha256(path), "size": path.stat().st_size}
            manifest = {"kind": kind, "params": params, "files": files}
            (tmp / "manifest.json").write_text(json.dumps(manifest, sort_keys=True, default=str, indent=1))
            if folder.exists():  # a damaged or concurrent entry: the new one wins
                shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return folder

    def get_or_build(self, kind: str, params: dict[str, Any], build: Callable[[], Arrays]) -> Arrays:
        cached = self.load(kind, params)
        if cached is not None:
            return cached
        arrays = build()
        self.store(kind, params, arrays)
        return arrays


@dataclass(frozen=True)
class PoolCacheRef:
    """Where a pool's derived results (partitions) are cached, and the key of the pool's contents."""

    cache: ArrayCache
    pool_key: str
