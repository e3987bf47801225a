"""Client states on disk: an LMDB store of versioned, checksummed `ClientState` records.

One store serves both engines: the in-process engine keeps a large population's personal states
here instead of in RAM, and a Flower node keeps its own clients' states here on its local disk.

Layout: an LMDB environment (a folder holding ``data.mdb`` and ``lock.mdb``). Each entry's key is
``(client id, round)`` as two big-endian unsigned 64-bit integers, so one client's versions are
adjacent and sorted by round; the value is the SHA-256 of the record followed by the record
(``ClientState.to_bytes()``, safetensors). Every read from disk verifies the checksum.

Versions and the commit rule. ``put(cid, state, rnd)`` tags a state with the round that produced
it. The server *commits* a round when it has aggregated it (and checkpointed it):

- ``prune(c)``: per client, keep the newest version with round <= ``c`` and drop the older ones;
  versions newer than ``c`` are kept (their round may still be committed). In normal operation a
  client therefore has at most two versions: the committed one and the one being produced.
- ``rewind(c)``: drop every version newer than ``c``: they come from rounds the server never
  aggregated (a crash between a client's work and the checkpoint), and a resumed run redoes them.

Every write is one LMDB transaction, so a crash leaves each entry either old or new. A killed
process (even ``kill -9``) loses nothing that ``put`` returned from, because committed pages are
in the operating system's cache; with ``durable=True`` (the default) each commit is also fsynced,
so a power loss loses nothing either. With ``durable=False`` call `flush()` at the points that
must survive a power loss (the in-process engine does at each checkpoint).

A bounded LRU cache keeps the ``cache_size`` most recently used decoded states (0: none). States
returned by `get()` may be the cached objects: treat them as read-only and ``put`` a new one.
One process writes a store at a time (LMDB's lock serialises writers; readers never block), and a
process opens a given store once (LMDB refuses a second environment on the same path in one process).
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
import struct
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb

from .types import ClientState

_KEY = struct.Struct(">QQ")  # (client id, round), big-endian so that LMDB's byte order is numeric order
_DIGEST = 32  # SHA-256


class StateStoreError(RuntimeError):
    """A state store, or one entry in it, is unreadable or corrupt."""


def _key(cid: int, rnd: int) -> bytes:
    if cid < 0 or rnd < 0:
        raise ValueError(f"client id and round must be >= 0 (got client {cid}, round {rnd})")
    return _KEY.pack(cid, rnd)


class StateStore:
    """Versioned client states in an LMDB environment at ``path`` (a folder, created if missing)."""

    def __init__(
        self, path: str | Path, cache_size: int = 256, map_size: int = 1 << 40, *, durable: bool = True
    ) -> None:
        if cache_size < 0:
            raise ValueError(f"cache_size must be >= 0, got {cache_size}")
        self.path = Path(path)
        self.cache_size = cache_size
        self.durable = durable
        try:
            # owner-only: client states hold personal models and a DP client's noise secret
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            # readahead off: random access to a store larger than RAM should read only what it uses.
            self._env = lmdb.open(
                str(self.path), map_size=map_size, subdir=True, sync=durable, metasync=durable, readahead=False,
                mode=0o600,
            )  # fmt: skip
        except (lmdb.Error, OSError) as exc:
            raise StateStoreError(f"state store {self.path} cannot be opened: {_first_line(exc)}") from None
        self._cache: OrderedDict[tuple[int, int], ClientState] = OrderedDict()
        # Clients that may hold more than one version (written since the last prune); None: unknown
        # (an existing store just opened), so the first prune/rewind scans the whole store and later
        # ones only these: no per-round work grows with the population.
        self._touched: set[int] | None = set() if self._env.stat()["entries"] == 0 else None
        self.bytes_written = 0  # bytes of the entries put so far (figures for checkpoint accounting)

    # --- context manager -------------------------------------------------------------------
    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Sync and close the environment (idempotent)."""
        if getattr(self, "_env", None) is not None:
            self._env.sync(True)
            self._env.close()
            self._env = None
        self._cache.clear()

    def flush(self) -> None:
        """Force everything written so far to disk (fsync), whatever ``durable`` says."""
        self._open_env().sync(True)

    # --- reads -----------------------------------------------------------------------------
    def round_of(self, cid: int, max_round: int | None = None) -> int | None:
        """Round of ``cid``'s newest version with round <= ``max_round`` (None: newest), or None."""
        with self._transaction() as txn:
            return self._find_round(txn, cid, max_round)

    def get(self, cid: int, max_round: int | None = None) -> ClientState | None:
        """``cid``'s newest state with round <= ``max_round`` (None: the newest), or None if it has none."""
        with self._transaction(buffers=True) as txn:
            rnd = self._find_round(txn, cid, max_round)
            if rnd is None:
                return None
            cached = self._cache.get((cid, rnd))
            if cached is not None:
                self._cache.move_to_end((cid, rnd))
                return cached
            state = self._decode(cid, rnd, txn.get(_key(cid, rnd)))
        self._remember(cid, rnd, state)
        return state

    def ids(self) -> list[int]:
        """Every client id with at least one version, ascending (scans the store)."""
        return list(dict.fromkeys(cid for cid, _ in self._versions()))

    def versions(self) -> list[tuple[int, int]]:
        """Every stored ``(client id, round)``, ascending (scans the store)."""
        return list(self._versions())

    def parameter_counts(self) -> dict[int, int]:
        """Floating-point values in each client's newest state (what ``ClientState.num_parameters``
        counts), from the records' headers: no state is decoded, whatever the population."""
        counts: dict[int, int] = {}
        with self._transaction(buffers=True) as txn:
            for key, value in txn.cursor():  # ascending: a client's newest version comes last
                cid, _ = _KEY.unpack(bytes(key))
                size = int.from_bytes(bytes(value[_DIGEST : _DIGEST + 8]), "little")
                header = json.loads(bytes(value[_DIGEST + 8 : _DIGEST + 8 + size]))
                counts[cid] = sum(
                    math.prod(info["shape"])
                    for name, info in header.items()
                    if name != "__metadata__" and info["dtype"].startswith(("F", "BF"))
                )
        return counts

    def __contains__(self, cid: object) -> bool:
        try:
            return self.round_of(operator.index(cid)) is not None  # type: ignore[arg-type]
        except TypeError:
            return False

    def __len__(self) -> int:
        return len(self.ids())

    # --- writes ----------------------------------------------------------------------------
    def put(self, cid: int, state: ClientState, rnd: int) -> None:
        """Store ``state`` as ``cid``'s version of round ``rnd`` (replacing one of the same round)."""
        data = state.to_bytes()
        key = _key(cid, rnd)
        with self._transaction(write=True) as txn:
            txn.put(key, hashlib.sha256(data).digest() + data)
        self.bytes_written += _DIGEST + len(data)
        if self._touched is not None:
            self._touched.add(cid)
        self._remember(cid, rnd, state)

    def prune(self, committed_round: int) -> None:
        """Per client, keep the newest version with round <= ``committed_round`` and drop older
        ones; versions newer than ``committed_round`` are kept until committed or rewound."""
        still: set[int] = set()
        with self._transaction(write=True) as txn:
            for cid, rounds in self._grouped(txn, self._touched):
                committed = [r for r in rounds if r <= committed_round]
                for r in committed[:-1]:
                    txn.delete(_key(cid, r))
                    self._cache.pop((cid, r), None)
                if len(rounds) - max(len(committed) - 1, 0) > 1:
                    still.add(cid)
        self._touched = still

    def rewind(self, committed_round: int) -> None:
        """Drop every version newer than ``committed_round`` (rounds the server never aggregated)."""
        still: set[int] = set()
        with self._transaction(write=True) as txn:
            for cid, rounds in self._grouped(txn, self._touched):
                kept = [r for r in rounds if r <= committed_round]
                for r in rounds:
                    if r > committed_round:
                        txn.delete(_key(cid, r))
                        self._cache.pop((cid, r), None)
                if len(kept) > 1:
                    still.add(cid)
        self._touched = still

    # --- internals -------------------------------------------------------------------------
    def _open_env(self) -> Any:
        if getattr(self, "_env", None) is None:
            raise StateStoreError(f"state store {self.path} is closed")
        return self._env

    @contextmanager
    def _transaction(self, write: bool = False, buffers: bool = False) -> Iterator[Any]:
        """One LMDB transaction (committed on success); LMDB's own errors become one-line StateStoreErrors."""
        env = self._open_env()
        try:
            with env.begin(write=write, buffers=buffers) as txn:
                yield txn
        except lmdb.Error as exc:
            action = "written" if write else "read"
            raise StateStoreError(f"state store {self.path} cannot be {action}: {_first_line(exc)}") from None

    def _find_round(self, txn: Any, cid: int, max_round: int | None) -> int | None:
        """Newest round of ``cid`` <= ``max_round``: one B-tree seek, whatever the population."""
        if max_round is not None and max_round < 0:
            return None
        cursor = txn.cursor()
        # Seek to the first key after (cid, max_round), then step back once.
        after = _key(cid + 1, 0) if max_round is None else _key(cid, max_round + 1)
        found = cursor.prev() if cursor.set_range(after) else cursor.last()
        if not found:
            return None
        key_cid, key_round = _KEY.unpack(bytes(cursor.key()))
        return key_round if key_cid == cid else None

    def _decode(self, cid: int, rnd: int, value: Any) -> ClientState:
        if value is None or len(value) < _DIGEST:
            raise StateStoreError(f"client {cid}'s state (round {rnd}) in {self.path} is corrupt (truncated entry)")
        value = bytes(value)
        stored, data = value[:_DIGEST], value[_DIGEST:]
        actual = hashlib.sha256(data).digest()
        if actual != stored:
            raise StateStoreError(
                f"client {cid}'s state (round {rnd}) in {self.path} is corrupt "
                f"(checksum {actual.hex()[:12]}... != stored {stored.hex()[:12]}...); refusing to load it"
            )
        try:
            return ClientState.from_bytes(data)
        except Exception as exc:  # the checksum matched but the record is not a ClientState
            raise StateStoreError(
                f"client {cid}'s state (round {rnd}) in {self.path} cannot be parsed: {_first_line(exc)}"
            ) from None

    def _remember(self, cid: int, rnd: int, state: ClientState) -> None:
        if self.cache_size == 0:
            return
        self._cache[(cid, rnd)] = state
        self._cache.move_to_end((cid, rnd))
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def _versions(self) -> Iterator[tuple[int, int]]:
        with self._transaction() as txn:
            keys = [_KEY.unpack(bytes(key)) for key in txn.cursor().iternext(keys=True, values=False)]
        return iter(keys)

    def _grouped(self, txn: Any, only: set[int] | None) -> Iterator[tuple[int, list[int]]]:
        """``(cid, rounds ascending)`` for the clients in ``only`` (None: every client)."""
        cursor = txn.cursor()
        if only is not None:
            for cid in sorted(only):
                rounds: list[int] = []
                if cursor.set_range(_key(cid, 0)):
                    for key in cursor.iternext(keys=True, values=False):
                        key_cid, key_round = _KEY.unpack(bytes(key))
                        if key_cid != cid:
                            break
                        rounds.append(key_round)
                if rounds:
                    yield cid, rounds
            return
        groups: dict[int, list[int]] = {}
        for key in cursor.iternext(keys=True, values=False):
            key_cid, key_round = _KEY.unpack(bytes(key))
            groups.setdefault(key_cid, []).append(key_round)
        yield from groups.items()


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


class MemoryStates(dict):
    """Client states in a dict keyed by client id (the default), with the store's ``put``."""

    def put(self, cid: int, state: ClientState, rnd: int) -> None:
        self[cid] = state


class StoredStates(Mapping):
    """A read-only mapping view of a [`StateStore`][fedmerge.core.state_store.StateStore] (each client's newest state,
    on ``device``),
    with ``put``: what an engine holds instead of a [`MemoryStates`][fedmerge.core.state_store.MemoryStates] dict."""

    def __init__(self, store: StateStore, device: Any = None) -> None:
        self.store = store
        self.device = device

    def put(self, cid: int, state: ClientState, rnd: int) -> None:
        self.store.put(cid, state, rnd)

    def get(self, cid: int, default: Any = None) -> Any:  # one seek, no KeyError round trip
        state = self.store.get(cid)
        if state is None:
            return default
        return state if self.device is None else state.to(self.device)

    def __getitem__(self, cid: int) -> ClientState:
        state = self.get(cid)
        if state is None:
            raise KeyError(cid)
        return state

    def __iter__(self) -> Iterator[int]:
        return iter(self.store.ids())

    def __len__(self) -> int:
        return len(self.store)
