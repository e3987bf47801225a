"""Runs with client states on disk (``state:``): the same numbers as states in RAM, incremental
checkpoints (server file + the store), exact resume, and refusal of a damaged store entry."""

from __future__ import annotations

import struct

import lmdb
import numpy as np
import pytest
from helpers import assert_runs_identical, kill_9_run_after, quick_config, resume_in_process, run, strip_timing
from typer.testing import CliRunner

from fedmerge.cli import app
from fedmerge.core.checkpoint import load_checkpoint
from fedmerge.core.state_store import StateStore
from fedmerge.core.types import Record
from fedmerge.run.runner import run_experiment

# 24 clients, 12 per round, every client evaluated: a cache of 10 states evicts all the time
DITTO = ["algorithm.name=ditto", "partition.num_clients=24", "participation=0.5", "rounds=4"]


def test_states_on_disk_with_a_small_cache_equal_states_in_ram(tmp_path):
    in_ram = run(quick_config(*DITTO), tmp_path / "ram")
    on_disk = run(quick_config(*DITTO, "state.cache_size=10"), tmp_path / "disk")
    assert_runs_identical(in_ram.run_dir, on_disk.run_dir)  # metrics, server and every client state
    assert strip_timing(on_disk.summary) == strip_timing(in_ram.summary)
    uncached = run(quick_config(*DITTO, "state.cache_size=0"), tmp_path / "nocache")
    assert_runs_identical(in_ram.run_dir, uncached.run_dir)


def test_incremental_checkpoint_holds_the_server_state_and_the_store(tmp_path):
    res = run(quick_config(*DITTO, "state.cache_size=10"), tmp_path / "r")
    folder = res.run_dir / "checkpoints"
    files = sorted(p.name for p in folder.glob("round-*.safetensors"))
    assert files == ["round-000003.safetensors", "round-000004.safetensors"]  # keep_checkpoints=2
    header = Record.from_bytes((folder / files[-1]).read_bytes())
    assert header.meta["client_store"] == "clients" and header.meta["client_meta"] == {}
    assert not any(k.startswith("client/") for k in header.tensors)
    ckpt = load_checkpoint(folder, with_clients=False)
    assert ckpt.client_store == "clients" and ckpt.client_states == {}
    with StateStore(folder / "clients") as store:
        versions = store.versions()
    # pruned to round 3, the oldest round file kept: per client its newest state of round <= 3, plus round 4's
    per_client: dict[int, list[int]] = {}
    for cid, rnd in versions:
        per_client.setdefault(cid, []).append(rnd)
    assert sorted(per_client) == list(range(24))  # every client has one (evaluation made the missing ones)
    assert all(len(r) <= 2 and len([x for x in r if x <= 3]) == 1 for r in per_client.values()), per_client


@pytest.mark.parametrize("extra", [[], ["checkpoint_every=2"]])
def test_stop_and_resume_with_states_on_disk_is_bit_identical(tmp_path, extra):
    cfg = quick_config(*DITTO, "rounds=5", "state.cache_size=4", *extra)
    full = run(quick_config(*DITTO, "rounds=5", *extra), tmp_path / "full")  # states in RAM
    run(cfg, tmp_path / "cut", stop_after=3)  # with checkpoint_every=2, round 3's states are not committed
    if extra:
        with StateStore(tmp_path / "cut" / "checkpoints" / "clients") as store:
            assert max(r for _, r in store.versions()) == 3  # ... but they are in the store: rewind drops them
    resumed = run_experiment(cfg, tmp_path / "cut", resume=True, show_progress=False)
    assert_runs_identical(full.run_dir, resumed.run_dir)


def test_damaged_state_in_the_store_is_refused_with_one_line(tmp_path):
    cfg = quick_config(*DITTO, "state.cache_size=0")
    run(cfg, tmp_path / "r", stop_after=2)
    path = tmp_path / "r" / "checkpoints" / "clients"
    env = lmdb.open(str(path))
    with env.begin(write=True) as txn:
        key, value = next(iter(txn.cursor()))
        cid, rnd = struct.unpack(">QQ", key)
        damaged = bytearray(value)
        damaged[len(damaged) // 2] ^= 0xFF
        txn.put(key, bytes(damaged))
    env.close()
    result = CliRunner().invoke(app, ["run", "--resume", str(tmp_path / "r"), "--no-progress"])
    assert result.exit_code == 2, result.output  # damaged input data: exit 2, as a damaged checkpoint
    assert f"client {cid}'s state (round {rnd})" in result.output and "corrupt" in result.output
    assert "Traceback" not in result.output


def test_cache_size_may_change_on_resume_but_not_where_states_live(tmp_path):
    full = run(quick_config(*DITTO), tmp_path / "full")
    run(quick_config(*DITTO, "state.cache_size=3"), tmp_path / "r", stop_after=1)
    resumed = CliRunner().invoke(app, ["run", "--resume", str(tmp_path / "r"), "state.cache_size=5", "--no-progress"])
    assert resumed.exit_code == 0, resumed.output
    assert_runs_identical(full.run_dir, tmp_path / "r")
    run(quick_config(*DITTO), tmp_path / "ram", stop_after=1)  # states in RAM: a resume cannot move them to disk
    moved = CliRunner().invoke(app, ["run", "--resume", str(tmp_path / "ram"), "state.cache_size=5", "--no-progress"])
    assert moved.exit_code == 2 and "no longer matches the checkpoint" in moved.output


def test_missing_store_is_refused(tmp_path):
    run(quick_config(*DITTO, "state.cache_size=3"), tmp_path / "r", stop_after=1)
    store = tmp_path / "r" / "checkpoints" / "clients"
    for f in store.iterdir():
        f.unlink()
    store.rmdir()
    result = CliRunner().invoke(app, ["run", "--resume", str(tmp_path / "r"), "--no-progress"])
    assert result.exit_code == 2 and "which is missing" in result.output and "Traceback" not in result.output


def test_states_on_disk_with_workers_equal_states_in_ram(tmp_path):
    short = [*DITTO, "rounds=2"]
    in_ram = run(quick_config(*short, "workers=1"), tmp_path / "ram")
    on_disk = run(quick_config(*short, "state.cache_size=3", "workers=2"), tmp_path / "disk")
    assert_runs_identical(in_ram.run_dir, on_disk.run_dir)


@pytest.mark.slow
def test_kill_9_at_1000_clients_then_resume_is_bit_identical(tmp_path):
    """Ditto, 1,000 clients (8 features, a 16-unit MLP), 50 per round, states on disk with a cache of
    16: killed mid-run, resumed from the command line, equal to an uninterrupted run with states in RAM."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16_000, 8)).astype(np.float32)
    np.savez(tmp_path / "syn.npz", x=x, y=(x @ rng.normal(size=(8, 4))).argmax(1))
    common = [
        "dataset.name=npz",
        f"dataset.path={tmp_path / 'syn.npz'}",
        "partition.name=iid",
        "partition.num_clients=1000",
        "model.name=mlp",
        "model.hidden=[16]",
        "algorithm.name=ditto",
        "algorithm.local_epochs=1",
        "participation=0.05",
        "eval_clients=sample:20",
        "rounds=12",
    ]
    overrides = [*common, "state.cache_size=16", f"output_dir={tmp_path}", "name=killed"]
    run_dir = kill_9_run_after(overrides, tmp_path, rounds_logged=3)
    assert len(run_dir.joinpath("metrics.jsonl").read_text().splitlines()) < 12, "killed too late"
    resume_in_process(run_dir)
    full = run(quick_config(*common), tmp_path / "full")
    assert_runs_identical(full.run_dir, run_dir)


@pytest.mark.parametrize(
    "method",
    [
        ["algorithm.name=scaffold"],  # client control variates
        ["algorithm.name=ifca", "algorithm.num_clusters=2"],
        ["algorithm.name=fedem", "algorithm.num_components=2"],
        ["algorithm.name=pfedmoe"],  # local expert and gate
    ],
    ids=lambda m: m[0].partition("=")[2],
)
def test_per_client_parts_of_other_methods_go_through_the_store(tmp_path, method):
    common = ["partition.num_clients=8", "participation=0.5", "rounds=2", "eval_clients=sample:3", *method]
    in_ram = run(quick_config(*common), tmp_path / "ram")
    on_disk = run(quick_config(*common, "state.cache_size=2"), tmp_path / "disk")
    assert_runs_identical(in_ram.run_dir, on_disk.run_dir)
    assert strip_timing(on_disk.summary) == strip_timing(in_ram.summary)  # parameter counts included
    with StateStore(on_disk.run_dir / "checkpoints" / "clients") as store:
        assert len(store) >= 4  # the round's participants (and evaluated clients) have their state there
