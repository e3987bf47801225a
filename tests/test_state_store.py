"""The LMDB client-state store: exact round trips, version selection, the prune/rewind rule,
refusal of corrupt entries, LRU eviction, reopening, and durability across ``kill -9``."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import textwrap

import lmdb
import pytest
import torch

from fedmerge.core.state_store import StateStore, StateStoreError
from fedmerge.core.types import ClientState


def _state(seed: int) -> ClientState:
    g = torch.Generator().manual_seed(seed)
    return ClientState(
        {
            "w": torch.randn(7, 5, generator=g),
            "b": torch.randn(5, generator=g).double(),
            "steps": torch.tensor([seed], dtype=torch.int64),
            "half": torch.randn(3, generator=g).to(torch.bfloat16),
        },
        {"seed": seed, "note": "x"},
    )


def _same(a: ClientState, b: ClientState) -> None:
    assert a.meta == b.meta
    assert a.tensors.keys() == b.tensors.keys()
    for k in a.tensors:
        assert a.tensors[k].dtype == b.tensors[k].dtype
        assert torch.equal(a.tensors[k], b.tensors[k]), k


def test_round_trip_is_bit_exact_without_cache(tmp_path):
    with StateStore(tmp_path / "s", cache_size=0) as store:
        state = _state(3)
        store.put(12, state, rnd=1)
        back = store.get(12)
        assert back is not state  # decoded from disk, not the object handed in
        _same(back, state)
        assert store.get(13) is None and store.round_of(13) is None
        assert 12 in store and 13 not in store and "12" not in store
        assert store.ids() == [12] and len(store) == 1


def test_max_round_selects_the_newest_version_not_after_it(tmp_path):
    with StateStore(tmp_path / "s", cache_size=0) as store:
        for rnd in (2, 5, 9):
            store.put(4, _state(rnd), rnd)
        store.put(3, _state(100), 7)  # neighbours in key order must not leak into client 4's answers
        store.put(5, _state(101), 1)
        assert store.round_of(4) == 9
        assert [store.round_of(4, m) for m in (0, 1, 2, 4, 5, 8, 9, 50)] == [None, None, 2, 2, 5, 5, 9, 9]
        _same(store.get(4, max_round=6), _state(5))
        assert store.get(4, max_round=1) is None
        assert store.round_of(3, 6) is None and store.round_of(5) == 1
        assert store.ids() == [3, 4, 5] and len(store) == 3


def test_prune_keeps_newest_committed_and_newer_versions(tmp_path):
    path = tmp_path / "s"
    with StateStore(path) as store:
        for rnd in (1, 2, 4, 6):
            store.put(0, _state(rnd), rnd)
        store.put(1, _state(10), 1)
        store.put(2, _state(20), 5)
        store.prune(4)
        # client 0: 1 and 2 dropped (older than the newest committed, 4); 6 kept (not committed yet)
        assert store.versions() == [(0, 4), (0, 6), (1, 1), (2, 5)]
        _same(store.get(0, max_round=4), _state(4))
        store.put(0, _state(7), 7)
        store.prune(6)  # only client 0 was written since: 4 goes, 6 and 7 stay
        assert store.versions() == [(0, 6), (0, 7), (1, 1), (2, 5)]
        store.prune(7)
        assert store.versions() == [(0, 7), (1, 1), (2, 5)]


def test_rewind_drops_versions_of_rounds_never_committed(tmp_path):
    path = tmp_path / "s"
    with StateStore(path) as store:
        for rnd in (1, 3, 4):
            store.put(0, _state(rnd), rnd)
        store.put(1, _state(9), 4)
        store.rewind(3)
        assert store.versions() == [(0, 1), (0, 3)]
        _same(store.get(0), _state(3))  # the cache forgot the dropped round too
        assert store.get(1) is None and 1 not in store
    with StateStore(path) as store:  # a fresh process: the first rewind/prune scans the whole store
        store.prune(3)
        assert store.versions() == [(0, 3)]


def test_corrupt_value_is_refused_with_a_clear_message(tmp_path):
    path = tmp_path / "s"
    with StateStore(path, cache_size=0) as store:
        store.put(12, _state(1), 3)
    env = lmdb.open(str(path))
    with env.begin(write=True) as txn:
        key = struct.pack(">QQ", 12, 3)
        value = bytearray(txn.get(key))
        value[-5] ^= 0x01  # one bit of one tensor value
        txn.put(key, bytes(value))
    env.close()
    with StateStore(path, cache_size=0) as store:
        with pytest.raises(StateStoreError) as err:
            store.get(12)
    msg = str(err.value)
    assert "\n" not in msg and "client 12" in msg and str(path) in msg and "corrupt" in msg and "checksum" in msg


def test_truncated_value_and_garbage_store_are_refused(tmp_path):
    path = tmp_path / "s"
    with StateStore(path) as store:
        store.put(2, _state(1), 1)
    env = lmdb.open(str(path))
    with env.begin(write=True) as txn:
        txn.put(struct.pack(">QQ", 2, 1), b"short")
    env.close()
    with StateStore(path) as store, pytest.raises(StateStoreError, match="client 2's state .* corrupt"):
        store.get(2)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "data.mdb").write_bytes(b"not an lmdb file" * 512)
    with pytest.raises(StateStoreError, match=f"state store {bad} cannot be opened"):
        StateStore(bad)


def test_lru_eviction_reloads_identical_tensors(tmp_path):
    with StateStore(tmp_path / "s", cache_size=3) as store:
        for cid in range(10):
            store.put(cid, _state(cid), 1)
        assert len(store._cache) == 3 and list(store._cache) == [(7, 1), (8, 1), (9, 1)]
        for cid in range(10):  # 0..6 come back from disk, 7..9 from the cache
            _same(store.get(cid), _state(cid))
        assert list(store._cache) == [(7, 1), (8, 1), (9, 1)]
        store.get(8)
        assert list(store._cache)[-1] == (8, 1)


def test_reopen_after_close(tmp_path):
    path = tmp_path / "s"
    store = StateStore(path)
    store.put(1, _state(1), 1)
    store.put(1, _state(2), 2)
    store.close()
    store.close()  # idempotent
    with pytest.raises(StateStoreError, match="closed"):
        store.get(1)
    with StateStore(path) as again:
        assert again.round_of(1) == 2
        _same(again.get(1), _state(2))
        _same(again.get(1, max_round=1), _state(1))


@pytest.mark.parametrize("durable", [True, False])
def test_put_survives_kill_9(tmp_path, durable):
    path = tmp_path / "s"
    code = textwrap.dedent(
        f"""
        import sys, time, torch
        from fedmerge.core.state_store import StateStore
        from fedmerge.core.types import ClientState
        store = StateStore({str(path)!r}, durable={durable})
        store.put(5, ClientState({{"w": torch.arange(6.0)}}, {{"r": 8}}), 8)
        print("stored", flush=True)
        time.sleep(60)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"stored"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    with StateStore(path) as store:
        state = store.get(5)
        assert state is not None and state.meta == {"r": 8} and torch.equal(state.tensors["w"], torch.arange(6.0))


def test_parameter_counts_read_headers_of_the_newest_versions(tmp_path):
    with StateStore(tmp_path / "s", cache_size=0) as store:
        store.put(1, _state(1), 1)
        store.put(1, ClientState({"w": torch.zeros(2, 3)}), 2)  # the newest: 6 values
        store.put(4, _state(4), 3)
        store.put(6, ClientState(), 1)
        assert store.parameter_counts() == {1: 6, 4: _state(4).num_parameters(), 6: 0}
        assert _state(4).num_parameters() == 35 + 5 + 3  # float32, float64, bfloat16; not the int64 counter
