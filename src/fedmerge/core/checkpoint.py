"""Atomic, checksummed checkpoints of everything a run needs to continue exactly.

Layout in a checkpoint folder::

    round-000012.safetensors   server state + every client state (one file)
    latest.json                {"file": ..., "round": ..., "sha256": ...}

Both files are written to a temporary name, fsynced and renamed, so a crash (even ``kill -9``)
leaves either the previous or the new checkpoint, never half of one. ``latest.json`` is written
last and carries the SHA-256 of the data file: a truncated or altered file is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .types import ClientState, Record, ServerState

LATEST = "latest.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated or corrupt."""


@dataclass
class Checkpoint:
    round: int
    server_state: ServerState
    client_states: dict[int, ClientState]
    meta: dict[str, Any] = field(default_factory=dict)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(
    folder: Path,
    round_idx: int,
    server_state: ServerState,
    client_states: dict[int, ClientState],
    meta: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"server/{k}": v for k, v in server_state.tensors.items()}
    client_meta: dict[str, Any] = {}
    for cid, cs in sorted(client_states.items()):
        tensors.update({f"client/{cid}/{k}": v for k, v in cs.tensors.items()})
        client_meta[str(cid)] = cs.meta
    record = Record(
        tensors,
        {
            "round": round_idx,
            "server_meta": server_state.meta,
            "client_meta": client_meta,
            "meta": meta or {},
        },
    )
    data = record.to_bytes()
    path = folder / f"round-{round_idx:06d}.safetensors"
    atomic_write_bytes(path, data)
    pointer = {"file": path.name, "round": round_idx, "sha256": hashlib.sha256(data).hexdigest()}
    atomic_write_bytes(folder / LATEST, json.dumps(pointer, indent=1).encode())
    for old in sorted(folder.glob("round-*.safetensors"))[:-keep] if keep > 0 else []:
        if old.name != path.name:
            old.unlink(missing_ok=True)
    return path


def load_checkpoint(folder: Path) -> Checkpoint:
    """Load the checkpoint ``latest.json`` points to, verifying its checksum."""
    folder = Path(folder)
    pointer_path = folder / LATEST
    if not pointer_path.exists():
        raise CheckpointError(f"no checkpoint in {folder} (missing {LATEST})")
    try:
        pointer = json.loads(pointer_path.read_text())
        file, expected, round_idx = pointer["file"], pointer["sha256"], int(pointer["round"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{pointer_path} is unreadable ({exc}); refusing to resume") from None
    path = folder / file
    if not path.exists():
        raise CheckpointError(f"checkpoint file {path} named by {LATEST} is missing")
    data = path.read_bytes()
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise CheckpointError(
            f"checkpoint {path} is corrupt or truncated (sha256 {actual[:12]}... != recorded {expected[:12]}...); "
            "refusing to load it"
        )
    checkpoint = parse_checkpoint(path, data)
    if checkpoint.round != round_idx:
        raise CheckpointError(f"checkpoint {path} holds round {checkpoint.round}, {LATEST} says {round_idx}")
    return checkpoint


def newest_checkpoint_file(folder: Path) -> Path | None:
    """The ``round-*.safetensors`` file of the highest round in ``folder``, if any."""
    files = sorted(Path(folder).glob("round-*.safetensors"))
    return files[-1] if files else None


def parse_checkpoint(path: Path, data: bytes | None = None) -> Checkpoint:
    """Read one checkpoint file as it is (no checksum: :func:`load_checkpoint` verifies one first)."""
    path = Path(path)
    if data is None:
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} does not exist")
        data = path.read_bytes()
    try:
        record = Record.from_bytes(data)
        round_idx = int(record.meta["round"])
    except Exception as exc:  # truncated, altered, or not a checkpoint at all
        raise CheckpointError(f"checkpoint {path} cannot be parsed: {str(exc).splitlines()[0]}") from None
    server = ServerState(meta=record.meta["server_meta"])
    clients: dict[int, ClientState] = {int(cid): ClientState(meta=m) for cid, m in record.meta["client_meta"].items()}
    for key, value in record.tensors.items():
        scope, _, rest = key.partition("/")
        if scope == "server":
            server.tensors[rest] = value
        else:
            cid, _, name = rest.partition("/")
            clients[int(cid)].tensors[name] = value
    return Checkpoint(round_idx, server, clients, record.meta.get("meta", {}))
