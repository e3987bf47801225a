"""Atomic, checksummed checkpoints of everything a run needs to continue exactly.

Layout in a checkpoint folder::

    round-000012.safetensors   server state + every client state (one file)
    latest.json                {"file": ..., "round": ..., "sha256": ...}

Both files are written to a temporary name, fsynced and renamed, so a crash (even ``kill -9``)
leaves either the previous or the new checkpoint, never half of one. ``latest.json`` is written
last and carries the SHA-256 of the data file: a truncated or altered file is refused.

Incremental checkpoints (client states in a `StateStore`, config key ``state:``)::

    round-000012.safetensors   server state only; its metadata names the store ("client_store")
    clients/                   the LMDB store: each client's versions, tagged by round
    latest.json                as above

A client's state is written to the store when its round produces it, so a round's checkpoint adds
only the states that changed. Saving round ``r`` fsyncs the store, writes the server file and
``latest.json``, deletes the round files beyond ``keep`` and prunes the store to the oldest round
file kept (`StateStore.prune()`): every kept round file can still be resumed from, and a client
holds at most two versions with ``checkpoint_every: 1``. Resuming from round ``c`` rewinds the store
to ``c`` (`StateStore.rewind()`): versions of rounds never checkpointed are dropped and redone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .state_store import StateStore
from .types import ClientState, Record, ServerState

LATEST = "latest.json"
CLIENT_STORE = "clients"  # the state store's folder inside the checkpoint folder


class CheckpointError(RuntimeError):
    """A checkpoint is missing, truncated or corrupt."""


@dataclass
class Checkpoint:
    round: int
    server_state: ServerState
    client_states: dict[int, ClientState]
    meta: dict[str, Any] = field(default_factory=dict)
    client_store: str | None = None  # incremental checkpoint: client states are in this store folder


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """``path`` holds either its old content or ``data``, never part of it; a write that fails (a full disk)
    leaves no temporary file behind."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        _write_synced(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


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
    client_states: dict[int, ClientState] | StateStore,
    meta: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Checkpoint round ``round_idx``: every client state in the file, or (``client_states`` a
    `StateStore` in ``folder/clients``) only the server state, committing the store's states."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"server/{k}": v for k, v in server_state.tensors.items()}
    client_meta: dict[str, Any] = {}
    header = {"round": round_idx, "server_meta": server_state.meta, "client_meta": client_meta, "meta": meta or {}}
    store = client_states if isinstance(client_states, StateStore) else None
    if store is not None:
        if store.path.resolve() != (folder / CLIENT_STORE).resolve():
            raise ValueError(f"the client-state store must be {folder / CLIENT_STORE}, not {store.path}")
        store.flush()  # the states this round produced are on disk before the file that commits them
        header["client_store"] = CLIENT_STORE
    else:
        for cid, cs in sorted(client_states.items()):
            tensors.update({f"client/{cid}/{k}": v for k, v in cs.tensors.items()})
            client_meta[str(cid)] = cs.meta
    record = Record(tensors, header)
    data = record.to_bytes()
    path = folder / f"round-{round_idx:06d}.safetensors"
    atomic_write_bytes(path, data)
    pointer = {"file": path.name, "round": round_idx, "sha256": hashlib.sha256(data).hexdigest()}
    atomic_write_bytes(folder / LATEST, json.dumps(pointer, indent=1).encode())
    for old in sorted(folder.glob("round-*.safetensors"))[:-keep] if keep > 0 else []:
        if old.name != path.name:
            old.unlink(missing_ok=True)
    if store is not None:
        kept = [_file_round(f) for f in folder.glob("round-*.safetensors")]
        store.prune(min([r for r in kept if r is not None and r <= round_idx], default=round_idx))
    return path


def _file_round(path: Path) -> int | None:
    digits = path.name.removeprefix("round-").removesuffix(".safetensors")
    return int(digits) if digits.isdigit() else None


def load_checkpoint(folder: Path, with_clients: bool = True) -> Checkpoint:
    """Load the checkpoint ``latest.json`` points to, verifying its checksum. ``with_clients=False``
    leaves an incremental checkpoint's client states in their store (a resumed run reads them lazily)."""
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
    checkpoint = parse_checkpoint(path, data, with_clients)
    if checkpoint.round != round_idx:
        raise CheckpointError(f"checkpoint {path} holds round {checkpoint.round}, {LATEST} says {round_idx}")
    return checkpoint


def checkpoint_files(folder: Path) -> dict[int, Path]:
    """The ``round-*.safetensors`` files in ``folder`` by round."""
    files = {_file_round(f): f for f in Path(folder).glob("round-*.safetensors")}
    return {r: f for r, f in sorted(files.items()) if r is not None}


def roll_back_checkpoints(folder: Path, round_idx: int) -> None:
    """Make round ``round_idx`` the latest checkpoint (0: none): ``latest.json`` names its file, and the
    files of later rounds, which the resumed run makes again, are deleted. ``latest.json`` is rewritten
    first, so a crash in between leaves a folder that resumes from ``round_idx`` too."""
    folder = Path(folder)
    files = checkpoint_files(folder)
    if round_idx in files:
        data = files[round_idx].read_bytes()
        pointer = {"file": files[round_idx].name, "round": round_idx, "sha256": hashlib.sha256(data).hexdigest()}
        atomic_write_bytes(folder / LATEST, json.dumps(pointer, indent=1).encode())
    else:
        (folder / LATEST).unlink(missing_ok=True)
    for rnd, path in files.items():
        if rnd > round_idx:
            path.unlink(missing_ok=True)
    _fsync_dir(folder)


def newest_checkpoint_file(folder: Path) -> Path | None:
    """The ``round-*.safetensors`` file of the highest round in ``folder``, if any."""
    files = sorted(Path(folder).glob("round-*.safetensors"))
    return files[-1] if files else None


def parse_checkpoint(path: Path, data: bytes | None = None, with_clients: bool = True) -> Checkpoint:
    """Read one checkpoint file as it is (no checksum: [`load_checkpoint()`][fedmerge.core.checkpoint.load_checkpoint]
    verifies one first)."""
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
    store = record.meta.get("client_store")
    if store is not None:
        if not (path.parent / store / "data.mdb").is_file():
            raise CheckpointError(
                f"checkpoint {path} keeps its client states in {path.parent / store}, which is missing"
            )
        if with_clients:
            clients = read_store_states(path.parent / store, round_idx)
    return Checkpoint(round_idx, server, clients, record.meta.get("meta", {}), store)


def read_store_states(folder: Path, round_idx: int) -> dict[int, ClientState]:
    """Every client's state as of round ``round_idx`` from the store in ``folder`` (reads them all)."""
    with StateStore(folder, cache_size=0) as store:
        states = {cid: store.get(cid, max_round=round_idx) for cid in store.ids()}
    return {cid: s for cid, s in states.items() if s is not None}
