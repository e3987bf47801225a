"""Engine overhead: steady-state seconds per round on the local engine vs Flower's simulation runtime.

Same config, same numbers (the engines are bit-identical); only where client work runs differs.
A round's time is fit + evaluation as logged in metrics.jsonl; the steady state is the median over
rounds 2.. (round 1 also pays Flower's ClientApp warm-up: imports and data loading in Ray workers).
Flower's start-up (Ray, virtual SuperNodes, partition handshake) and shut-down are reported apart.

    python benchmarks/engine_overhead.py [--clients 10] [--rounds 10] [--cpus 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fedmerge.experiment.config import load_config
from fedmerge.experiment.results import RunStore
from fedmerge.experiment.runner import run_experiment


def timed_run(overrides: list[str], out: Path) -> tuple[list[float], float]:
    cfg = load_config(None, overrides)
    t0 = time.perf_counter()
    result = run_experiment(cfg, out, show_progress=False)
    wall = time.perf_counter() - t0
    rows = RunStore(result.run_dir).read_metrics()
    per_round = [r["fit_seconds"] + r.get("eval_seconds", 0.0) for r in rows]
    outside_rounds = wall - rows[-1]["elapsed_seconds"]  # data loading, engine start-up and shut-down
    return per_round, outside_rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--cpus", type=int, default=2, help="CPUs Ray may use (parallel ClientApps)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = [
        f"partition.num_clients={args.clients}",
        f"rounds={args.rounds}",
        "algorithm.local_epochs=1",
        "threads=1",
        "checkpoint_every=1000",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        local, local_outside = timed_run(base, Path(tmp) / "local")
        flower, flower_outside = timed_run([*base, "engine=flower", f"flower.num_cpus={args.cpus}"], Path(tmp) / "fl")
    steady_local, steady_flower = statistics.median(local[1:]), statistics.median(flower[1:])
    print(f"config: digits, {args.clients} clients, {args.rounds} rounds, MLP, 1 local epoch, {args.cpus} Ray CPUs")
    print(f"local  engine: {steady_local:.3f} s/round (steady state, median of rounds 2..{args.rounds})")
    print(f"flower engine: {steady_flower:.3f} s/round (steady state); first round {flower[0]:.2f} s (warm-up)")
    print(f"ratio flower/local: {steady_flower / steady_local:.2f}x per round")
    print(f"outside the rounds (data, start-up, shut-down): local {local_outside:.2f} s, flower {flower_outside:.2f} s")
    print(f"flower start-up + shut-down over local: {flower_outside - local_outside:.2f} s")


if __name__ == "__main__":
    main()
