"""``keep_freed_memory``: freed blocks stay in the process, so that a round's updates reuse them instead
of page-faulting fresh memory; it is a run's default, changes no number, and can be turned off."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from helpers import QUICK, assert_runs_identical, quick_config, run

import fedmerge.engines.memory as memory
import fedmerge.run.execute as execute

glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings (Linux)")

# A round as a simulation makes it: 20 updates, all freed after "aggregation". Printed: how many bytes
# of freed memory malloc still holds for the next round (glibc's mallinfo2: fordblks). Page-fault
# counts would say the same less reliably (transparent huge pages fault 2 MB at once).
ROUND = textwrap.dedent(
    """
    import ctypes, sys, torch
    torch.set_num_threads(1)
    from fedmerge.engines.memory import keep_freed_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    import fedmerge.engines.memory as memory
    if sys.argv[1] == "keep":
        assert keep_freed_memory()
    if sys.argv[2] == "round":
        weights = torch.randn(1500, 1000)  # 6 MB (a TwoCNN has 6.6 MB)
        updates = [weights.clone() for _ in range(20)]
        del updates
    else:  # one evaluation batch's activations: the CNN's first convolution over 1024 rows, 103 MB
        activations = torch.ones(1024, 32, 28, 28)
        del activations
    print(libc.mallinfo2().fordblks, memory.mmap_threshold)
    """
)
UPDATES = 20 * 1500 * 1000 * 4
ACTIVATIONS = 1024 * 32 * 28 * 28 * 4


def held_after(mode: str, work: str = "round") -> int:
    out = subprocess.run([sys.executable, "-c", ROUND, mode, work], capture_output=True, text=True, check=True)
    held, threshold = out.stdout.split()
    if mode == "keep" and int(threshold) != memory.MMAP_THRESHOLD:
        pytest.skip(f"this glibc refuses an mmap threshold of {memory.MMAP_THRESHOLD} bytes (took {threshold})")
    return int(held)


@glibc
def test_memory_freed_by_a_round_stays_for_the_next_one():
    assert held_after("keep") >= UPDATES
    # glibc's default gives it back to the system (munmap, or trimming the heap); the next round's
    # updates then start on fresh pages, and each first touch of a page is a page fault
    assert held_after("default") < UPDATES // 2


@glibc
def test_an_evaluation_batchs_activations_stay_for_the_next_batch():
    # above glibc's largest default threshold (32 MiB): without the setting, every batch mmaps and zero-fills it
    assert held_after("keep", "activations") >= ACTIVATIONS
    assert held_after("default", "activations") < ACTIVATIONS // 2


def test_a_run_keeps_freed_memory_unless_told_not_to(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(execute, "keep_freed_memory", lambda: calls.append(1) or True)
    default = run(quick_config("rounds=1"), tmp_path / "default")
    assert calls == [1]
    off = run(quick_config("rounds=1", "keep_freed_memory=false"), tmp_path / "off")
    assert calls == [1]
    assert "keep_freed_memory" not in (default.run_dir / "config.yaml").read_text()
    assert "keep_freed_memory: false" in (off.run_dir / "config.yaml").read_text()


def test_keeping_freed_memory_changes_no_number(tmp_path):
    # Each run in its own process: the setting is process-wide, and this one has runs behind it.
    dirs = []
    for value in ("true", "false"):
        out = tmp_path / value
        cmd = [sys.executable, "-m", "fedmerge", "run", *QUICK, "eval_every=2", f"keep_freed_memory={value}"]
        subprocess.run([*cmd, f"output_dir={out}"], capture_output=True, text=True, check=True)
        (run_dir,) = out.iterdir()
        dirs.append(run_dir)
    assert_runs_identical(*dirs)


def test_flower_client_processes_get_the_setting_with_their_job():
    from fedmerge.engines.flower.job import client_job

    for overrides, expected in (((), True), (("keep_freed_memory=false",), False)):
        experiment = quick_config(*overrides).model_dump(mode="json")
        assert client_job(experiment, 4, with_data=False)["keep_freed_memory"] is expected
    older = {k: v for k, v in quick_config().model_dump(mode="json").items() if k != "keep_freed_memory"}
    assert client_job(older, 4, with_data=False)["keep_freed_memory"] is True
