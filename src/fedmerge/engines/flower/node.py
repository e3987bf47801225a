"""What a deployed SuperNode owns: its node config, its one client file and its state store.

A SuperNode is started with ``--node-config "data-path=FILE [partition-id=N] [state-dir=DIR]"``:

- ``data-path``: the client file ``fedmerge export-clients`` wrote for this site; the node reads
  nothing else (no dataset, no other client's file).
- ``partition-id``: optional; when given it must equal the file's client id.
- ``state-dir``: where the client's state store lives (default: ``FILE``'s folder +
  ``/fedmerge-state-NNNN``). The state never leaves this folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from fedmerge.data.client_files import ClientFileMeta, load_client_file
from fedmerge.data.errors import ClientFileError
from fedmerge.data.federated import ClientData


class NodeConfigError(ValueError):
    """A SuperNode's node config cannot serve the run (one-line message)."""


@dataclass(frozen=True)
class NodeSettings:
    partition_id: int | None
    data_path: Path | None
    state_dir: Path | None

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


def node_settings(node_config: dict[str, Any]) -> NodeSettings:
    def text(key: str) -> str | None:
        value = node_config.get(key)
        return None if value is None or str(value) == "" else str(value)

    pid = text("partition-id")
    if pid is not None and not pid.lstrip("-").isdigit():
        raise NodeConfigError(f"node config partition-id={pid!r} is not an integer")
    data, state = text("data-path"), text("state-dir")
    return NodeSettings(
        int(pid) if pid is not None else None,
        Path(data).expanduser() if data is not None else None,
        Path(state).expanduser() if state is not None else None,
    )


@cache
def _load(path: Path) -> tuple[ClientData, ClientFileMeta]:
    return load_client_file(path)


def node_data(settings: NodeSettings) -> tuple[ClientData, ClientFileMeta]:
    """This node's client data and the file's metadata (read once per process); refuses a file whose
    client id differs from the node's partition-id."""
    client, meta = _load(settings.require_data().resolve())
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
    )
