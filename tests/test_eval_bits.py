"""Every metric of small default FedAvg, Ditto and FedMerge runs of the floor's setting (benchmarks/floor.py:
Fashion-MNIST, TwoCNN, batch 10) in one process and in two workers, against the metrics the code wrote before
evaluation and scheduling were reworked for issue 56 (``tests/data/eval_bits.json``, made with
``python tests/test_eval_bits.py --write`` at commit 783b00b).

Bit for bit on a machine like the one that made the file (same CPU, torch and CPU capability); elsewhere
within float32 rounding (tests/golden.py): another BLAS kernel moves a float's last bits, not a count."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from golden import json_close  # noqa: E402
from helpers import quick_config, run, strip_timing  # noqa: E402

from fedmerge.run.results import RunStore  # noqa: E402

FIXTURE = Path(__file__).parent / "data" / "eval_bits.json"
# the floor's setting (benchmarks/workers_sweep.py's SETTING), cut to seconds; eval_batch_size 32 so that the
# evaluation passes have several batches to share between the workers
SETTING = [
    "dataset.name=fashion_mnist",
    "dataset.max_samples=900",
    "partition.name=dirichlet",
    "partition.num_clients=6",
    "partition.alpha=0.1",
    "split.val_fraction=0.1",
    "split.test_fraction=0.15",
    "model.name=twocnn",
    "model.hidden=32",
    "algorithm.batch_size=10",
    "algorithm.local_epochs=1",
    "algorithm.lr=0.005",
    "eval_every=1",
    "rounds=2",
    "eval_batch_size=32",
]
METHODS = ("fedavg", "ditto", "fedmerge")
WORKERS = (1, 2)


def machine() -> dict[str, str]:
    """What decides a float's last bits besides the code: the CPU, torch, and the kernels torch picks."""
    cpu = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return {"cpu": cpu, "torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability()}


def metrics(method: str, workers: int, out: Path) -> list[dict[str, Any]]:
    # FedMerge at the logit_lr the file was made with (the default then): the file guards evaluation, not defaults
    pinned = ["algorithm.logit_lr=0.01"] if method == "fedmerge" else []
    cfg = quick_config(*SETTING, f"algorithm.name={method}", f"workers={workers}", *pinned)
    return strip_timing(RunStore(run(cfg, out).run_dir).read_metrics())


@pytest.mark.slow
@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("method", METHODS)
def test_metrics_equal_those_of_the_code_before(tmp_path, requires_fashion_mnist, method, workers):
    want = json.loads(FIXTURE.read_text())
    got = json.loads(json.dumps(metrics(method, workers, tmp_path / "run")))  # as the file holds them
    if want["machine"] == machine():
        assert got == want["runs"][method], f"{method}, workers={workers}: a metric changed"
    else:
        assert json_close(got, want["runs"][method]), f"{method}, workers={workers}: a metric changed"


if __name__ == "__main__" and "--write" in sys.argv:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        runs = {m: metrics(m, 1, Path(tmp) / m) for m in METHODS}
        for m in METHODS:  # the file holds one run per method: the workers give the same bits
            assert metrics(m, 2, Path(tmp) / f"{m}-2") == runs[m], f"{m}: workers=2 differs from workers=1"
    FIXTURE.write_text(json.dumps({"machine": machine(), "runs": runs}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")
