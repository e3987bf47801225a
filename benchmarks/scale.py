"""Large populations on one machine: FedAvg and Ditto (MLP) at N = 1,000 / 10,000 / 100,000 clients.

Every N has 100 participants per round and ``eval_clients: sample:100``, client states on disk
(``state: {cache_size: 256}``; ``--states ram`` keeps them in a dict instead). The data are synthetic,
shaped like Fashion-MNIST: a pool of 70,000 1x28x28 images in 10 classes (the size of Fashion-MNIST),
and each client holds SAMPLES (default 60: 42 train, 6 validation, 12 test) as index views into that one
pool (``data.views.PooledClients``; clients share rows when N x SAMPLES exceeds the pool). The data
therefore cost the same at every N, and what grows with N is only the per-client bookkeeping that the
figures are meant to catch.

Each (method, N) runs in its own process, which reports:
- peak RSS (``ru_maxrss``);
- seconds per round in steady state: the median of the time between consecutive rounds' ends,
  rounds 2.. (training, evaluation, logging and the checkpoint);
- set-up seconds: from building the data to the first round (partition views, model check, engine);
- checkpoint bytes per round: the server file plus the client states the round wrote to the store
  (median over rounds 2..), and the store's size on disk at the end.

Targets (issue 15): RSS at 100k <= 2x the RSS at 1k; s/round at 100k <= 1.5x 1k; checkpoint bytes
per round proportional to the participants, not to N.

    python benchmarks/scale.py [--clients 1000,10000,100000] [--methods fedavg,ditto] [--rounds 6] [--set KEY=VALUE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

POOL = 70_000
PARTICIPANTS = 100


def synthetic_clients(num_clients: int, samples: int, seed: int = 0):
    """Fashion-MNIST-shaped pool and ``num_clients`` clients of ``samples`` rows each, as index views."""
    import numpy as np
    import torch

    from fedmerge.data.federated import FederatedDataset
    from fedmerge.data.views import PooledClients

    rng = np.random.default_rng(seed)
    prototypes = rng.random((10, 1, 28, 28), dtype=np.float32)
    y_pool = rng.integers(0, 10, POOL)
    x_pool = rng.random((POOL, 1, 28, 28), dtype=np.float32)
    for k in range(10):  # class by class: no temporary the size of the pool
        x_pool[y_pool == k] = 0.5 * x_pool[y_pool == k] + 0.5 * prototypes[k]
    rows = rng.integers(0, POOL, num_clients * samples)
    n_val, n_test = max(1, samples // 10), max(1, samples // 5)
    starts = np.arange(num_clients, dtype=np.int64)[:, None] * samples
    bounds = np.hstack([starts, starts + samples - n_val - n_test, starts + samples - n_test, starts + samples])
    clients = PooledClients(
        torch.from_numpy(x_pool), torch.from_numpy(rows), torch.from_numpy(y_pool[rows]), bounds.astype(np.int64)
    )
    return FederatedDataset(clients, 10, (1, 28, 28), "synthetic-fmnist")


def one(method: str, num_clients: int, rounds: int, samples: int, states: str, out: Path, extra: list[str]) -> dict:
    """Run one (method, N) in this process and return its figures."""
    from fedmerge.config.schema import load_config
    from fedmerge.core import checkpoint as ckpt_module
    from fedmerge.core.state_store import StateStore
    from fedmerge.run import runner
    from fedmerge.run.results import RunStore

    t0 = time.perf_counter()  # after the imports, which are the same at every N
    written: dict[int, int] = {}
    stored = [0]  # the store's bytes_written at the previous checkpoint
    save = ckpt_module.save_checkpoint

    def counting_save(folder, rnd, server_state, client_states, meta=None, keep=2):
        path = save(folder, rnd, server_state, client_states, meta, keep)
        now = client_states.bytes_written if isinstance(client_states, StateStore) else 0
        written[rnd] = path.stat().st_size + (Path(folder) / ckpt_module.LATEST).stat().st_size + now - stored[0]
        stored[0] = now
        return path

    runner.save_checkpoint = counting_save
    overrides = [
        "dataset.name=npz",
        "dataset.path=synthetic",  # never read: the data are passed in
        "partition.name=iid",
        f"partition.num_clients={num_clients}",
        "model.name=mlp",
        f"algorithm.name={method}",
        "algorithm.local_epochs=1",
        f"participation={PARTICIPANTS / num_clients}",
        "eval_clients=sample:100",
        f"rounds={rounds}",
        f"output_dir={out}",
    ]
    if states == "disk":
        overrides.append("state.cache_size=256")
    overrides += extra
    data = synthetic_clients(num_clients, samples)
    t_data = time.perf_counter()
    result = runner.run_experiment(load_config(None, overrides), None, show_progress=False, data=data)
    wall = time.perf_counter() - t0
    rows = RunStore(result.run_dir).read_metrics()
    ends = [r["elapsed_seconds"] for r in rows]
    steady = statistics.median(b - a for a, b in zip(ends[1:], ends[2:]))
    store = result.run_dir / "checkpoints" / "clients"
    return {
        "method": method,
        "clients": num_clients,
        "states": states,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "seconds_per_round": steady,
        "first_round_seconds": ends[0],
        "setup_seconds": wall - result.summary["wall_seconds"],
        "data_seconds": t_data - t0,
        "checkpoint_bytes_per_round": statistics.median(written[r] for r in sorted(written)[1:]),
        "store_bytes_on_disk": sum(f.stat().st_size for f in store.iterdir()) if store.is_dir() else 0,
        "selected_per_round": len(rows[-1]["selected"]),
        "evaluated_per_round": len(rows[-1]["eval"]["clients"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1000,10000,100000")
    parser.add_argument("--methods", default="fedavg,ditto")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--samples", type=int, default=60, help="samples per client")
    parser.add_argument("--states", choices=["disk", "ram"], default="disk")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="another run setting (repeatable)"
    )
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        with tempfile.TemporaryDirectory() as tmp:
            figures = one(args.one[0], int(args.one[1]), args.rounds, args.samples, args.states, Path(tmp), args.set)
        print(json.dumps(figures))
        return
    extra = f"; settings: {' '.join(args.set)}" if args.set else ""
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; states: {args.states}{extra}")
    head = f"{'method':<7} {'N':>7} {'peak RSS MB':>11} {'s/round':>8} {'set-up s':>8} {'ckpt bytes/round':>16}"
    print(head)
    results: list[dict] = []
    for method in args.methods.split(","):
        for n in (int(v) for v in args.clients.split(",")):
            cmd = [sys.executable, __file__, "--one", method, str(n), "--rounds", str(args.rounds)]
            cmd += ["--samples", str(args.samples), "--states", args.states]
            cmd += [f"--set={kv}" for kv in args.set]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"{method} at {n} clients failed:\n{done.stderr[-2000:]}")
            r = json.loads(done.stdout.strip().splitlines()[-1])
            results.append(r)
            print(
                f"{method:<7} {n:>7} {r['peak_rss_mb']:>11.0f} {r['seconds_per_round']:>8.2f} "
                f"{r['setup_seconds']:>8.1f} {r['checkpoint_bytes_per_round']:>16,.0f}",
                flush=True,
            )
    print("ratios, largest N against smallest (targets: RSS <= 2, s/round <= 1.5, checkpoint bytes ~ 1):")
    for method in args.methods.split(","):
        mine = [r for r in results if r["method"] == method]
        small, large = mine[0], mine[-1]
        print(
            f"  {method:<7} RSS {large['peak_rss_mb'] / small['peak_rss_mb']:.2f}x  "
            f"s/round {large['seconds_per_round'] / small['seconds_per_round']:.2f}x  "
            f"checkpoint bytes {large['checkpoint_bytes_per_round'] / small['checkpoint_bytes_per_round']:.2f}x"
        )
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
