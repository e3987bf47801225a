"""One self-contained file per client, so that a deployed node holds only its own data.

``export_clients`` writes each client of a `FederatedDataset` to ``client-NNNN.safetensors``:
the tensors ``x_train y_train x_val y_val x_test y_test`` (and ``y_train_clean`` with label noise),
plus string metadata (format, format version, client id, number of clients, group, dataset name,
number of classes, class names, input shape and dtype, a digest of the data config that produced
it and, from ``fedmerge export-clients``, that data config and seed themselves, and a SHA-256 over the
metadata and every tensor). ``load_client_file`` reads exactly one such file and needs nothing else;
``check_consistent`` refuses files that cannot belong to one federation.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from fedmerge.core.seeding import numpy_rng
from fedmerge.data.errors import ClientFileError
from fedmerge.data.federated import ClientData, FederatedDataset
from fedmerge.data.pool import Pool, standardize
from fedmerge.data.split import SplitConfig, split_indices

FORMAT = "fedmerge-client"
FORMAT_VERSION = 1
SPLITS = ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test")
OPTIONAL = ("y_train_clean",)
FILE_GLOB = "client-*.safetensors"


@dataclass(frozen=True)
class ClientFileMeta:
    """What a client file says about itself (everything but the tensors)."""

    path: Path
    client_id: int
    num_clients: int
    group: int | None
    dataset: str
    num_classes: int
    class_names: list[str] | None
    input_shape: tuple[int, ...]
    input_dtype: str
    source_digest: str
    format_version: int
    # the data sections (dataset, partition, split, noise, seed) of the export, when it recorded them
    source: dict[str, Any] | None = None


def client_file_name(cid: int, num_clients: int) -> str:
    width = max(4, len(str(num_clients - 1)))
    return f"client-{cid:0{width}d}.safetensors"


def _checksum(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """SHA-256 over the metadata and each tensor's name, dtype, shape and bytes. Safetensors checks
    only that its header is well-formed and the offsets fit, not the bytes they point to."""
    digest = hashlib.sha256(json.dumps(metadata, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name]
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def client_file_bytes(data: FederatedDataset, client: ClientData, source_digest: str = "", source: str = "") -> bytes:
    """The safetensors bytes of one client's file."""
    tensors = {name: getattr(client, name).detach().cpu().contiguous() for name in SPLITS}
    if client.y_train_clean is not None:
        tensors["y_train_clean"] = client.y_train_clean.detach().cpu().contiguous()
    metadata = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "client_id": str(client.cid),
        "num_clients": str(data.num_clients),
        "group": json.dumps(client.group),
        "dataset": data.name,
        "num_classes": str(data.num_classes),
        "class_names": json.dumps(data.class_names),
        "input_shape": json.dumps(list(data.input_shape)),
        "input_dtype": str(client.x_train.dtype).removeprefix("torch."),
        "source_digest": source_digest,
    }
    if source:  # files of older exports lack it (and their checksums cover only what they have)
        metadata["source"] = source
    metadata["sha256"] = _checksum(tensors, metadata)
    return save_safetensors(tensors, metadata=metadata)


def source_digest(data_sections: dict[str, Any]) -> str:
    """A digest of the config sections that decide the data (dataset, partition, split, noise, seed),
    so that files from different exports are told apart. Where the dataset's files sit does not count."""
    fixed = json.loads(json.dumps(data_sections, sort_keys=True, default=str))
    if isinstance(fixed.get("dataset"), dict):
        fixed["dataset"].pop("data_dir", None)
    return hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()[:16]


def _write_atomic(path: Path, payload: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)  # a reader sees the old file or the whole new one, never half of one
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check_out_dir(out_dir: Path, *, force: bool) -> None:
    """Refuse a file, or an existing non-empty folder unless ``force`` (one line); writes nothing."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ClientFileError(f"{out_dir}: exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ClientFileError(f"{out_dir}: folder is not empty; choose another or pass --force to overwrite")


def prepare_out_dir(out_dir: Path, *, force: bool) -> None:
    """[`check_out_dir()`][fedmerge.data.client_files.check_out_dir], then create the folder and check that it is
    writable."""
    check_out_dir(out_dir, force=force)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ClientFileError(f"{out_dir}: cannot create the folder: {exc.strerror or exc}") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ClientFileError(f"{out_dir}: folder is not writable")


def export_clients(
    data: FederatedDataset,
    out_dir: str | Path,
    *,
    source_digest: str = "",
    source: str = "",
    force: bool = False,
    on_written: Callable[[Path], None] | None = None,
) -> list[Path]:
    """Write one file per client into ``out_dir`` (see the module docstring) and return their paths.

    Each file is written to a temporary name and renamed, so an interrupted export leaves only whole
    files. With ``force``, client files of an earlier export that this one does not rewrite are removed.
    """
    out_dir = Path(out_dir)
    prepare_out_dir(out_dir, force=force)
    paths = []
    for client in data.clients:
        path = out_dir / client_file_name(client.cid, data.num_clients)
        try:
            _write_atomic(path, client_file_bytes(data, client, source_digest, source))
        except OSError as exc:
            raise ClientFileError(f"{path}: cannot write: {exc.strerror or exc}") from None
        paths.append(path)
        if on_written is not None:
            on_written(path)
    for stale in set(out_dir.glob(FILE_GLOB)) - set(paths):
        stale.unlink()
    return paths


def _meta_value(meta: dict[str, str], key: str, path: Path) -> str:
    if key not in meta:
        raise ClientFileError(f"{path}: client file lacks its {key!r} metadata")
    return meta[key]


def _read_header_metadata(raw: bytes) -> dict[str, str]:
    size = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + size]).get("__metadata__") or {}


def _read_verified(path: Path, fmt: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a file of format ``fmt``, its checksum verified (one-line errors)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ClientFileError(f"{path}: client file not found") from None
    except OSError as exc:
        raise ClientFileError(f"{path}: cannot read the client file: {exc.strerror or exc}") from None
    try:
        tensors = load_safetensors(raw)  # checks the header and that every tensor lies inside the file
        meta = _read_header_metadata(raw)
    except (SafetensorError, ValueError, UnicodeDecodeError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ClientFileError(f"{path}: not a readable client file (truncated or damaged: {reason})") from None
    if meta.get("format") != fmt:
        what = "fedmerge client file" if fmt == FORMAT else "fedmerge pooled test file"
        raise ClientFileError(f"{path}: not a {what}; write one with: fedmerge export-clients")
    version = _meta_value(meta, "format_version", path)
    if version != str(FORMAT_VERSION):
        raise ClientFileError(f"{path}: client file format version {version}; this fedmerge reads {FORMAT_VERSION}")
    stored = _meta_value(meta, "sha256", path)
    if _checksum(tensors, {k: v for k, v in meta.items() if k != "sha256"}) != stored:
        raise ClientFileError(f"{path}: checksum mismatch: the client file was altered or damaged")
    return tensors, meta


def _file_meta(path: Path, meta: dict[str, str], client_id: int) -> ClientFileMeta:
    try:
        return ClientFileMeta(
            path=path,
            client_id=client_id,
            num_clients=int(_meta_value(meta, "num_clients", path)),
            group=json.loads(meta.get("group", "null")),
            dataset=_meta_value(meta, "dataset", path),
            num_classes=int(_meta_value(meta, "num_classes", path)),
            class_names=json.loads(_meta_value(meta, "class_names", path)),
            input_shape=tuple(json.loads(_meta_value(meta, "input_shape", path))),
            input_dtype=_meta_value(meta, "input_dtype", path),
            source_digest=meta.get("source_digest", ""),
            format_version=int(meta["format_version"]),
            source=json.loads(meta["source"]) if meta.get("source") else None,
        )
    except (ValueError, TypeError) as exc:  # a hand-made file with malformed values
        raise ClientFileError(f"{path}: malformed client file metadata: {exc}") from None


def load_client_file(path: str | Path) -> tuple[ClientData, ClientFileMeta]:
    """Read one exported client file: its tensors as a `ClientData` and its metadata.

    A missing, truncated, altered or foreign file raises `ClientFileError` (one line).
    """
    path = Path(path)
    tensors, meta = _read_verified(path, FORMAT)
    missing = [name for name in SPLITS if name not in tensors]
    unknown = sorted(set(tensors) - set(SPLITS) - set(OPTIONAL))
    if missing or unknown:
        raise ClientFileError(f"{path}: client file has tensors missing {missing} / unexpected {unknown}")
    try:
        client_id = int(_meta_value(meta, "client_id", path))
    except ValueError as exc:
        raise ClientFileError(f"{path}: malformed client file metadata: {exc}") from None
    info = _file_meta(path, meta, client_id)
    client = ClientData(
        cid=info.client_id,
        x_train=tensors["x_train"],
        y_train=tensors["y_train"],
        x_val=tensors["x_val"],
        y_val=tensors["y_val"],
        x_test=tensors["x_test"],
        y_test=tensors["y_test"],
        group=info.group,
        y_train_clean=tensors.get("y_train_clean"),
    )
    _check_tensors(client, info)
    return client, info


def _check_tensors(client: ClientData, info: ClientFileMeta) -> None:
    for split in ("train", "val", "test"):
        x, y = getattr(client, f"x_{split}"), getattr(client, f"y_{split}")
        if tuple(x.shape[1:]) != info.input_shape or len(x) != len(y):
            raise ClientFileError(
                f"{info.path}: x_{split} has shape {tuple(x.shape)} for {len(y)} labels; "
                f"the file says inputs of shape {info.input_shape}"
            )
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= info.num_classes):
            raise ClientFileError(f"{info.path}: y_{split} has labels outside 0..{info.num_classes - 1}")


def check_consistent(metas: Sequence[ClientFileMeta]) -> None:
    """Refuse client files that cannot belong to one federation: two files with the same client id,
    or files that disagree on the classes, the input shape/dtype or the export they come from.
    The error names the clients (one line)."""
    by_id: dict[int, ClientFileMeta] = {}
    for m in metas:
        if m.client_id in by_id:
            raise ClientFileError(f"two files claim client id {m.client_id}: {by_id[m.client_id].path} and {m.path}")
        by_id[m.client_id] = m
    if not metas:
        return
    first = metas[0]
    checks = (
        ("number of clients", lambda m: m.num_clients),
        ("number of classes", lambda m: m.num_classes),
        ("class names", lambda m: m.class_names),
        ("input shape", lambda m: m.input_shape),
        ("input dtype", lambda m: m.input_dtype),
        ("source (data config and seed)", lambda m: m.source_digest),
    )
    for what, key in checks:
        odd = [m for m in metas if key(m) != key(first)]
        if odd:
            names = ", ".join(str(m.client_id) for m in odd)
            raise ClientFileError(
                f"clients disagree on the {what}: client {first.client_id} has {key(first)!r}, "
                f"client(s) {names} have {key(odd[0])!r}"
            )


# The pooled test set a deployed server may hold (optional): every client's test split in one file
# (with split.test_from: publisher, the dataset publisher's test rows).
POOLED_FORMAT = "fedmerge-pooled-test"
POOLED_FILE = "pooled-test.safetensors"


def pooled_test_bytes(data: FederatedDataset, source_digest: str = "") -> bytes:
    """The safetensors bytes of the pooled test file: ``x_test``, ``y_test`` of all clients, in client
    order, or the publisher's test rows (``data.pooled_test()``: what the in-process engine tests a global model
    on), with the client files' metadata."""
    x, y = data.pooled_test()
    tensors = {"x_test": x.detach().cpu().contiguous(), "y_test": y.detach().cpu().contiguous()}
    metadata = {
        "format": POOLED_FORMAT,
        "format_version": str(FORMAT_VERSION),
        "num_clients": str(data.num_clients),
        "dataset": data.name,
        "num_classes": str(data.num_classes),
        "class_names": json.dumps(data.class_names),
        "input_shape": json.dumps(list(data.input_shape)),
        "input_dtype": str(x.dtype).removeprefix("torch."),
        "source_digest": source_digest,
    }
    metadata["sha256"] = _checksum(tensors, metadata)
    return save_safetensors(tensors, metadata=metadata)


def write_pooled_test(data: FederatedDataset, path: str | Path, source_digest: str = "") -> Path:
    path = Path(path)
    try:
        _write_atomic(path, pooled_test_bytes(data, source_digest))
    except OSError as exc:
        raise ClientFileError(f"{path}: cannot write: {exc.strerror or exc}") from None
    return path


def load_pooled_test(path: str | Path) -> tuple[torch.Tensor, torch.Tensor, ClientFileMeta]:
    """The pooled test file's ``x_test``, ``y_test`` and metadata (``client_id`` -1), verified."""
    path = Path(path)
    tensors, meta = _read_verified(path, POOLED_FORMAT)
    if set(tensors) != {"x_test", "y_test"}:
        raise ClientFileError(f"{path}: a pooled test file holds x_test and y_test, not {sorted(tensors)}")
    info = _file_meta(path, meta, -1)
    x, y = tensors["x_test"], tensors["y_test"]
    if tuple(x.shape[1:]) != info.input_shape or len(x) != len(y):
        raise ClientFileError(f"{path}: x_test has shape {tuple(x.shape)} for {len(y)} labels")
    return x, y, info


def site_client(
    pool: Pool, cid: int, split_cfg: SplitConfig, seed: int, classes: Sequence[str] | None = None
) -> tuple[ClientData, list[str]]:
    """One site's own raw data (a whole `Pool` holding only its samples) split into train/val/test
    exactly as a simulation splits client ``cid``: the project's stratified split with the generator of
    ``(seed, cid, "split")``, so a site holding the rows a natural partition gives client ``cid`` gets the
    simulation's split. ``classes``: the federation's class names, into which the site's labels are
    mapped (default: the site's own, which every site must then share). Tabular features are
    standardized with this site's training samples (a simulation uses the whole federation's).
    Label noise does not apply: a site's labels are its real ones."""
    if split_cfg.test_per_client is not None:
        raise ClientFileError(
            "split.test_per_client draws test samples from the held-out part of a whole dataset, which a site "
            "splitting its own raw data does not have; leave it unset, or give the nodes exported client files"
        )
    names = [str(c) for c in (pool.class_names or range(pool.num_classes))]
    if classes is not None:
        index = {str(c): i for i, c in enumerate(classes)}
        unknown = sorted(set(names) - set(index))
        if unknown:
            raise ClientFileError(f"labels {unknown[:5]} are not among the federation's classes {list(classes)[:10]}")
        y = np.asarray([index[names[c]] for c in range(len(names))], dtype=np.int64)[pool.y]
        names = [str(c) for c in classes]
    else:
        y = np.asarray(pool.y, dtype=np.int64)
    train, val, test = split_indices(y, split_cfg, numpy_rng(seed, client_id=cid, purpose="split"))
    x_np = standardize(pool.x, train) if pool.standardize else pool.x
    x = torch.from_numpy(np.ascontiguousarray(x_np))
    x = x.float() if x.is_floating_point() else x.long()

    def part(pos: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return x[torch.from_numpy(pos)].contiguous(), torch.from_numpy(np.ascontiguousarray(y[pos]))

    (x_train, y_train), (x_val, y_val), (x_test, y_test) = part(train), part(val), part(test)
    return ClientData(cid, x_train, y_train, x_val, y_val, x_test, y_test), names


def load_client_files(paths: Sequence[str | Path]) -> FederatedDataset:
    """Assemble a FederatedDataset (ordered by client id) from exported files, after
    [`check_consistent()`][fedmerge.data.client_files.check_consistent]. The round trip of ``export_clients``."""
    loaded = [load_client_file(p) for p in paths]
    if not loaded:
        raise ClientFileError("no client files given")
    check_consistent([m for _, m in loaded])
    loaded.sort(key=lambda pair: pair[1].client_id)
    first = loaded[0][1]
    return FederatedDataset(
        [c for c, _ in loaded], first.num_classes, first.input_shape, first.dataset, first.class_names
    )
