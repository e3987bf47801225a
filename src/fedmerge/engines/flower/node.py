"""What a deployed SuperNode owns: its node config, its one client file and its state store.

A SuperNode is started with ``--node-config 'data-path="FILE" [partition-id=N] [state-dir="DIR"]'``:

- ``data-path``: the client file ``fedmerge export-clients`` wrote for this site (``.safetensors``), or
  the site's own raw data (``.npz``, ``.csv``, an image folder), which the node splits itself with the
  project's split rules and the run's seed (then ``partition-id`` and ``num-partitions`` are required,
  and ``classes`` may list the federation's class names, comma-separated). The node reads nothing else.
- ``partition-id``: with a client file optional; when given it must equal the file's client id.
- ``state-dir``: where the client's state stores live (default: ``FILE``'s folder +
  ``/fedmerge-state-NNNN``), one per run (``run-KEY``, the key the server names in each message), so that
  no run ever continues from another run's state. The state never leaves this folder.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from fedmerge.data.client_files import ClientFileMeta, load_client_file, site_client
from fedmerge.data.errors import ClientFileError, DataUnavailable
from fedmerge.data.federated import ClientData
from fedmerge.data.pool import Pool
from fedmerge.data.split import SplitConfig


class NodeConfigError(ValueError):
    """A SuperNode's node config cannot serve the run (one-line message)."""


class NodeStateError(RuntimeError):
    """This node has no usable state for the run the server asks about (one-line message)."""


RUN_KEY = re.compile(r"^[0-9a-f]{1,32}(-[0-9a-f]{1,32})?$")
RUN_PREFIX = "run-"
LEGACY_STORE = "data.mdb"  # an LMDB store directly in state-dir: fedmerge before stores were kept per run


@dataclass(frozen=True)
class NodeSettings:
    partition_id: int | None
    data_path: Path | None
    state_dir: Path | None
    num_partitions: int | None = None  # raw data only: the number of clients of the federation
    classes: tuple[str, ...] | None = None  # raw data only: the federation's class names

    @property
    def raw(self) -> bool:
        return self.data_path is not None and self.data_path.suffix != ".safetensors"

    def require_data(self) -> Path:
        if self.data_path is None:
            raise NodeConfigError(
                "this SuperNode has no data-path; start it with --node-config 'data-path=FILE' "
                "(one of the files fedmerge export-clients writes)"
            )
        return self.data_path

    def store_dir(self, cid: int) -> Path:
        if self.state_dir is not None:
            return self.state_dir
        return self.require_data().parent / f"fedmerge-state-{cid:04d}"

    def run_store(self, cid: int, run_key: str, state_round: int) -> Path:
        """The folder of this client's state store for the run ``run_key``. Refused in one line: a key
        that is not one, a state-dir of an earlier fedmerge (one store for every run), and a run that the
        server has results of (``state_round`` > 0) but this state-dir has no store for."""
        root = self.store_dir(cid)
        if not RUN_KEY.fullmatch(run_key):
            raise NodeStateError(f"the server named run {run_key!r}, which is not a run key; is it a fedmerge server?")
        if (root / LEGACY_STORE).exists():
            raise NodeStateError(
                f"state-dir {root} holds client states of an earlier fedmerge, which kept one store for every run; "
                f"move its {LEGACY_STORE} and lock.mdb away (or delete them) and start the run again"
            )
        folder = root / f"{RUN_PREFIX}{run_key}"
        if state_round > 0 and not folder.is_dir():
            runs = sorted(p.name.removeprefix(RUN_PREFIX) for p in root.glob(f"{RUN_PREFIX}*") if p.is_dir())
            raise NodeStateError(
                f"client {cid} has no state for run {run_key} in state-dir {root} (the server has its results up to "
                f"round {state_round}; the folder holds runs {runs[:5]}): start this node with the state-dir it "
                "used for this run"
            )
        return folder


def node_settings(node_config: dict[str, Any]) -> NodeSettings:
    def text(key: str) -> str | None:
        value = node_config.get(key)
        return None if value is None or str(value) == "" else str(value)

    def integer(key: str) -> int | None:
        value = text(key)
        if value is not None and not value.isdigit():
            raise NodeConfigError(f"node config {key}={value!r} is not a non-negative integer")
        return int(value) if value is not None else None

    data, state, classes = text("data-path"), text("state-dir"), text("classes")
    return NodeSettings(
        integer("partition-id"),
        Path(data).expanduser() if data is not None else None,
        Path(state).expanduser() if state is not None else None,
        integer("num-partitions"),
        tuple(c.strip() for c in classes.split(",")) if classes is not None else None,
    )


@cache
def _load(path: Path) -> tuple[ClientData, ClientFileMeta]:
    return load_client_file(path)


RAW_LOADERS = {".npz": "npz", ".csv": "csv", ".tsv": "csv", ".txt": "csv"}


@cache
def _raw_pool(path: Path) -> Pool:
    from fedmerge.data.pool import load_pool

    name = "image_folder" if path.is_dir() else RAW_LOADERS.get(path.suffix.lower())
    if name is None:
        raise ClientFileError(
            f"{path}: not a client file (.safetensors) nor raw data this node can split (.npz, .csv, an image folder)"
        )
    try:
        return load_pool({"name": name, "path": str(path)})
    except (DataUnavailable, ValueError) as exc:
        raise ClientFileError(f"{path}: {str(exc).splitlines()[0]}") from None


def _raw_meta(settings: NodeSettings, path: Path) -> ClientFileMeta:
    if settings.partition_id is None or settings.num_partitions is None:
        raise NodeConfigError(
            f"{path} is raw data: give the node partition-id=N num-partitions=M (and classes=... if this site "
            "lacks some of the federation's classes)"
        )
    if not 0 <= settings.partition_id < settings.num_partitions:
        raise NodeConfigError(f"partition-id={settings.partition_id} is outside 0..{settings.num_partitions - 1}")
    pool = _raw_pool(path)
    names = list(settings.classes) if settings.classes is not None else pool.class_names
    if names is None:
        names = [str(c) for c in range(pool.num_classes)]
    return ClientFileMeta(
        path=path,
        client_id=settings.partition_id,
        num_clients=settings.num_partitions,
        group=None,
        dataset="raw",
        num_classes=len(names),
        class_names=names,
        input_shape=tuple(int(s) for s in pool.x.shape[1:]),
        input_dtype="float32" if pool.x.dtype.kind == "f" else "int64",
        source_digest="raw",
        format_version=0,
    )


def node_meta(settings: NodeSettings) -> ClientFileMeta:
    """What this node's data says about itself (the handshake), without splitting raw data."""
    if settings.raw:
        return _raw_meta(settings, settings.require_data().resolve())
    return node_data(settings)[1]


def node_data(
    settings: NodeSettings, split: dict[str, Any] | None = None, seed: int = 0
) -> tuple[ClientData, ClientFileMeta]:
    """This node's client data and its metadata (read once per process). A client file is used as it
    is (and refused if its client id differs from the node's partition-id); raw data is split here with
    the run's ``split`` settings and ``seed`` ([`site_client()`][fedmerge.data.client_files.site_client])."""
    path = settings.require_data().resolve()
    if settings.raw:
        meta = _raw_meta(settings, path)
        split_cfg = SplitConfig.model_validate(split or {})
        client, _ = site_client(_raw_pool(path), meta.client_id, split_cfg, seed, settings.classes)
        return client, meta
    client, meta = _load(path)
    if settings.partition_id is not None and settings.partition_id != meta.client_id:
        raise ClientFileError(
            f"{meta.path}: holds client {meta.client_id} but this SuperNode has partition-id={settings.partition_id}"
        )
    return client, meta


# What a node tells the server in the handshake: metadata only (no sample, no statistic of its data
# beyond what the model needs and what tells federations apart).
REPORT_KEYS = ("client_id", "num_clients", "dataset", "num_classes", "class_names", "input_shape", "input_dtype")


def data_report(meta: ClientFileMeta) -> str:
    out = {key: getattr(meta, key) for key in REPORT_KEYS}
    out["input_shape"] = list(meta.input_shape)
    out["group"] = meta.group
    out["source_digest"] = meta.source_digest
    if meta.source is not None:  # the export's data config and seed: the server checks its own against them
        out["source"] = meta.source
    return json.dumps(out, sort_keys=True)


def meta_from_report(report: str, where: str) -> ClientFileMeta:
    """The server's view of a node's report, as a ClientFileMeta (``path`` names the node)."""
    d = json.loads(report)
    return ClientFileMeta(
        path=Path(where),
        client_id=int(d["client_id"]),
        num_clients=int(d["num_clients"]),
        group=d.get("group"),
        dataset=str(d["dataset"]),
        num_classes=int(d["num_classes"]),
        class_names=d.get("class_names"),
        input_shape=tuple(int(s) for s in d["input_shape"]),
        input_dtype=str(d["input_dtype"]),
        source_digest=str(d.get("source_digest", "")),
        format_version=0,
        source=d.get("source"),
    )
