"""Workers sweep: seconds per round with 1, 2, ... worker processes for FedAvg, Ditto and FedMerge on the
PFLlib-sized setting (Fashion-MNIST, 20 clients, Dirichlet 0.1, TwoCNN, batch 10, 1 local epoch, 75% of
each client's samples for training, evaluation every round), and a model of the round that predicts
other core counts from measured quantities.

Every worker count gives the same numbers (bit for bit); only where the clients run differs. Per run:
``fit`` and ``eval`` are the medians over rounds 2.. of metrics.jsonl's ``fit_seconds`` and
``eval_seconds`` (round 1 also pays warm-up); ``fit/plain`` divides fit by one process's plain
training loop over the same samples and batches (benchmarks/plain_loop.py); ``round/floor`` divides
fit + eval by the round's floor: that plain loop spread over the run's workers plus one evaluation pass
(one forward pass over every client's validation and test rows in one process).

The model of a round, from the runs at 1 and 2 workers (client-work figures from the 1-worker run):

- fit(N) = server + makespan_N(client_i) + K * per_client: ``server`` is the fit time outside the
  engine (configure, screening, aggregation: serial); ``client_i`` each client's training time; the
  makespan is the pool's schedule (clients largest first to whichever worker is free: the engine orders
  them by their rows, which their times follow), so the largest client bounds a round however many cores
  there are; ``per_client`` is what each client costs the
  parent process with workers (its payload out, its update and state back), from the 2-worker run;
- eval(N) = here + spread / N, fitted to the two runs (Amdahl): ``here`` is what the parent does alone
  (a global-model method's grouped pass and pooled test), ``spread`` what the workers share.

It predicts N = min(cores, clients per round) for 8 and 64 cores; the machine's own counts are printed
next to their measurements as a check of the model.

    python benchmarks/workers_sweep.py                          # 1..cores workers, three methods, 6 rounds
    python benchmarks/workers_sweep.py --rounds 2 dataset.max_samples=6000   # a quick check of the script
"""

from __future__ import annotations

import argparse
import heapq
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from engine_overhead import plain_seconds

from fedmerge.config.schema import load_config
from fedmerge.core.seeding import torch_generator
from fedmerge.core.training import predict_logits
from fedmerge.engines.local import LocalEngine
from fedmerge.engines.workers import available_cores
from fedmerge.run.data_plan import plan_data
from fedmerge.run.results import RunStore
from fedmerge.run.runner import run_experiment

SETTING = [
    "dataset.name=fashion_mnist",
    "partition.name=dirichlet",
    "partition.num_clients=20",
    "partition.alpha=0.1",
    "split.val_fraction=0.1",
    "split.test_fraction=0.15",
    "model.name=twocnn",
    "algorithm.batch_size=10",
    "algorithm.local_epochs=1",
    "algorithm.lr=0.005",
    "eval_every=1",
]
METHODS = {
    "fedavg": ["algorithm.name=fedavg"],
    "ditto": ["algorithm.name=ditto", "algorithm.lam=0"],  # the comparison: lambda 0
    "fedmerge": ["algorithm.name=fedmerge"],
}


class Timings:
    """What the engine spends, per round: its fit and evaluation calls in the parent, each client's
    training when it runs here, and the global model's pooled test."""

    def __init__(self) -> None:
        self.fit: list[float] = []
        self.clients: list[list[float]] = []
        self.evaluate_global: list[float] = []

    def install(self) -> None:
        fit, fit_one, evaluate_global = LocalEngine.fit, LocalEngine._fit_one, LocalEngine.evaluate_global
        timings = self

        def timed_fit(engine, algorithm, rnd, payloads):  # noqa: ANN001, ANN202
            timings.clients.append([])
            start = time.perf_counter()
            out = fit(engine, algorithm, rnd, payloads)
            timings.fit.append(time.perf_counter() - start)
            return out

        def timed_fit_one(engine, *args):  # noqa: ANN001, ANN002, ANN202
            start = time.perf_counter()
            out = fit_one(engine, *args)
            timings.clients[-1].append(time.perf_counter() - start)  # here only: a worker's list is its own
            return out

        def timed_global(engine, algorithm, state):  # noqa: ANN001, ANN202
            start = time.perf_counter()
            out = evaluate_global(engine, algorithm, state)
            timings.evaluate_global.append(time.perf_counter() - start)
            return out

        LocalEngine.fit, LocalEngine._fit_one, LocalEngine.evaluate_global = timed_fit, timed_fit_one, timed_global
        self._saved = (fit, fit_one, evaluate_global)

    def uninstall(self) -> None:
        LocalEngine.fit, LocalEngine._fit_one, LocalEngine.evaluate_global = self._saved


def timed_run(overrides: list[str], out: Path) -> dict[str, Any]:
    timings = Timings()
    timings.install()
    try:
        result = run_experiment(load_config(None, overrides), out, show_progress=False)
    finally:
        timings.uninstall()
    rows = RunStore(result.run_dir).read_metrics()
    steady = slice(1, None) if len(rows) > 1 else slice(None)
    fit = [r["fit_seconds"] for r in rows][steady]
    engine_fit = timings.fit[steady]
    return {
        "fit": statistics.median(fit),
        "eval": statistics.median([r.get("eval_seconds", 0.0) for r in rows][steady]),
        "first": rows[0]["fit_seconds"],
        "server": statistics.median(f - e for f, e in zip(fit, engine_fit)),
        "engine_fit": statistics.median(engine_fit),
        "clients": [statistics.median(c) for c in zip(*timings.clients[steady])] if timings.clients[-1] else [],
        "workers": result.summary.get("workers", {}).get("processes", 1),
    }


def eval_pass_seconds(overrides: list[str], repeats: int = 3) -> float:
    """One forward pass over every client's validation and test rows, in one process (the floor's part)."""
    cfg = load_config(None, overrides)
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    planned = plan_data(cfg, device=torch.device("cpu"))
    data, model = planned.data, planned.build_model(torch_generator(cfg.seed))
    x = torch.cat([t for c in data.clients for t in (c.x_val, c.x_test)])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        predict_logits(model, x, cfg.eval_batch_size)
        times.append(time.perf_counter() - start)
    return min(times)


def makespan(seconds: list[float], workers: int) -> float:
    """When the last client ends: clients largest first, each to the worker that is free first."""
    free = [0.0] * max(1, workers)
    for s in sorted(seconds, reverse=True):
        heapq.heappush(free, heapq.heappop(free) + s)
    return max(free)


def round_model(one: dict[str, Any], two: dict[str, Any] | None) -> tuple[dict[str, float], Any]:
    """The measured quantities and fit(N), eval(N) as functions (see the module docstring)."""
    clients = one["clients"]
    k = max(1, len(clients))
    per_client = 0.0
    here, spread = one["eval"], 0.0
    if two is not None and clients:
        per_client = max(0.0, (two["engine_fit"] - makespan(clients, 2)) / k)
        here, spread = max(0.0, 2 * two["eval"] - one["eval"]), max(0.0, 2 * (one["eval"] - two["eval"]))
    quantities = {
        "server": one["server"],
        "client_total": sum(clients),
        "client_max": max(clients, default=0.0),
        "per_client": per_client,
        "eval_here": here,
        "eval_spread": spread,
    }

    def predict(n: int) -> tuple[float, float]:
        n = max(1, min(n, k))
        parent = k * per_client if n > 1 else 0.0
        return one["server"] + makespan(clients, n) + parent, here + spread / n

    return quantities, predict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("args", nargs="*", help="key=value overrides on top of the setting")
    ap.add_argument("--workers", default=None, help="worker counts (comma-separated; default 1..cores)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"among {', '.join(METHODS)}")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--predict", default="8,64", help="core counts to predict (comma-separated)")
    args = ap.parse_args()
    cores = available_cores()
    counts = [int(w) for w in args.workers.split(",")] if args.workers else list(range(1, cores + 1))
    if 1 not in counts:
        counts = [1, *counts]  # the model and fit/plain need the one-process run
    base = [*SETTING, *args.args, f"rounds={args.rounds}", f"checkpoint_every={args.rounds}"]

    plain, about = plain_seconds(None, [*base, *METHODS["fedavg"]], max(2, args.rounds))
    evaluation_pass = eval_pass_seconds(base)
    print(f"setting: {about}; {cores} cores available; medians over rounds 2..{args.rounds}")
    print(f"plain loop: {plain:.3f} s (training, one process); one evaluation pass: {evaluation_pass:.3f} s")
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            runs: dict[int, dict[str, Any]] = {}
            for n in counts:
                runs[n] = run = timed_run([*base, *METHODS[method], f"workers={n}"], Path(tmp) / f"{method}-{n}")
                floor = plain / n + evaluation_pass
                print(
                    f"{method:<9} workers={n}: round {run['fit'] + run['eval']:.3f} s (fit {run['fit']:.3f}, "
                    f"eval {run['eval']:.3f}); fit/plain {run['fit'] / plain:.3f}; round/floor "
                    f"{(run['fit'] + run['eval']) / floor:.2f}; first round's fit {run['first']:.2f} s",
                    flush=True,
                )
            quantities, predict = round_model(runs[1], runs.get(2))
            q = quantities
            print(
                f"{method:<9} model: server {q['server']:.3f} s/round; clients {q['client_total']:.3f} s in all, "
                f"the largest {q['client_max']:.3f} s; {1e3 * q['per_client']:.2f} ms of the parent per client with "
                f"workers; evaluation {q['eval_here']:.3f} s here + {q['eval_spread']:.3f} s shared"
            )
            checks = [n for n in counts if n > 2]
            for n in [*checks, *(int(c) for c in args.predict.split(","))]:
                fit, ev = predict(n)
                seen = f" (measured {runs[n]['fit'] + runs[n]['eval']:.3f})" if n in runs else ""
                print(f"{method:<9} predicted, {n} cores: round {fit + ev:.3f} s (fit {fit:.3f}, eval {ev:.3f}){seen}")


if __name__ == "__main__":
    main()
