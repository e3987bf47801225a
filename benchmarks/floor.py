"""The round against this machine's floor: what the hardware needs for a round's arithmetic at the throughput
it attains for the model's own layers and batch sizes, next to what a default run takes for it.

Measured in one process run, so that the ratios stay meaningful on a busy machine (each figure is slowed
alike):

1. **Throughput**, in one process per worker as the run's workers run (``workers: auto`` resolves the count:
   one per core available, at most the clients per round; each with the run's ``threads``, 1), all of them
   at once: training steps of the plain loop (zero_grad, forward, cross-entropy, backward, SGD step) at the
   training batch size, and no-grad forward passes at the evaluation batch size, on the setting's own rows.
   Each process's rate is its best of ``--windows`` timed windows, and their mean is taken. The server's
   rate is that of a plain weighted sum over flat vectors of the model's size in the run's process. The
   rates are measured at the start and after each method's run; a method's floor uses the mean of those on
   either side of its run (a load that drifts moves both).
2. **The floor** of a round: ``train = samples trained x models trained per sample / (processes x train
   rate)``, ``eval = rows evaluated / (processes x forward rate)``, ``server = values the server reads /
   read rate`` (:func:`floor_seconds`). Rows evaluated: every client's validation and test rows once per
   model it is evaluated with, and, for a method with a global model, the pooled test rows once more unless
   that model is the one every client is evaluated with (FedAvg's pooled test is the clients' own test pass).
3. **The run**: the default round of the PFLlib-style setting (Fashion-MNIST, 20 clients, Dirichlet 0.1,
   TwoCNN, batch 10, 1 local epoch, 75% of each client's rows for training, evaluation every round) with our
   defaults, for FedAvg, Ditto and FedMerge. ``fit`` and ``eval`` are the medians over rounds 2.. of
   metrics.jsonl's ``fit_seconds`` and ``eval_seconds`` (round 1 also pays warm-up); the engine's ``fit`` is
   timed around it, so ``server`` is what the round spends outside the clients (configure, screening,
   aggregation), and the engine's client and pooled-global evaluation are timed apart.

It prints ``round/floor: R.RRx`` and ``eval/floor: E.EEx`` per method (1.00x: the hardware's own speed).
See docs/performance/floor.md for the model and how to read it.

    python benchmarks/floor.py                       # the three methods, 4 rounds, this machine's CPUs
    python benchmarks/floor.py --device cuda         # the same on a GPU (one process: workers are CPU-only)
    python benchmarks/floor.py --smoke --json f.json # a tiny check of the script (seconds)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, astuple, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F
from workers_sweep import SETTING  # the PFLlib-sized setting (issue 56's comparison), beside this file

from fedmerge.config.schema import load_config
from fedmerge.core.seeding import torch_generator
from fedmerge.core.training import planned_steps
from fedmerge.engines.device import resolve_device
from fedmerge.engines.local import LocalEngine
from fedmerge.engines.memory import keep_freed_memory
from fedmerge.engines.workers import resolve_workers, set_threads
from fedmerge.run.data_plan import plan_data
from fedmerge.run.results import RunStore
from fedmerge.run.runner import run_experiment

PULL_CACHE_BYTES = 256 * 1024 * 1024  # the pull's rate is measured over this much memory, cycled
SMOKE = ["dataset.max_samples=400", "partition.num_clients=4", "model.hidden=32"]


@dataclass(frozen=True)
class Method:
    overrides: list[str]
    models_trained: int  # forward + backward passes per training sample (Ditto trains w and v on each batch)
    pooled_test: bool  # a global model tested on the pooled test rows (FedMerge has none)
    evaluates_global: bool  # every client is evaluated with the global model: the pooled test is its test pass
    server_models: int  # model-sized vectors the server reads besides the round's updates (FedMerge: its d models)
    pull: str | None = None  # the option whose coefficient, when above 0, adds a proximal pull to every step


METHODS = {
    "fedavg": Method(["algorithm.name=fedavg"], 1, True, True, 0),
    "ditto": Method(["algorithm.name=ditto"], 2, True, False, 0, "lam"),  # its personal model's pull
    "fedmerge": Method(["algorithm.name=fedmerge"], 1, False, False, 5, "prox_mu"),  # num_models' default
}


# --- the floor's arithmetic ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Work:
    """A round's arithmetic: training samples (each a forward + backward of one model), rows evaluated (each a
    forward pass), the values the server step reads (each once), and the parameters a proximal pull moves
    (each step, each a pass reading the weight, its anchor and its gradient and writing the gradient)."""

    train_samples: float
    eval_rows: float
    server_values: float
    pull_values: float = 0.0


@dataclass(frozen=True)
class Rates:
    """Attainable throughput: per process while ``processes`` run at once (training samples/s, forward rows/s,
    proximal-pull values/s), and the server's (values/s)."""

    train: float
    forward: float
    read: float
    processes: int
    pull: float = float("inf")


def floor_seconds(work: Work, rates: Rates) -> dict[str, float]:
    """The round's floor in seconds, by part: the clients' work spread evenly over the processes at their rate."""
    train = work.train_samples / (rates.train * rates.processes)
    pull = work.pull_values / (rates.pull * rates.processes)
    evaluation = work.eval_rows / (rates.forward * rates.processes)
    server = work.server_values / rates.read
    return {
        "train": train,
        "pull": pull,
        "server": server,
        "eval": evaluation,
        "round": train + pull + server + evaluation,
    }


def round_work(
    method: Method, train: list[int], val: list[int], test: list[int], epochs: int, params: int, pulled: float = 0.0
) -> Work:
    """The work of one round of ``method`` with every client taking part and evaluated (row counts per client);
    ``pulled``: the values a proximal pull moves in the round (its steps x the model's weights; 0: none)."""
    eval_rows = sum(val) + sum(test) + (sum(test) if method.pooled_test and not method.evaluates_global else 0)
    server = (len(train) + method.server_models) * params
    return Work(float(sum(train) * epochs * method.models_trained), float(eval_rows), float(server), float(pulled))


# --- throughput ---------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _windows(step: Callable[[], int], seconds: float, windows: int, device: torch.device) -> float:
    """Best samples/s over ``windows`` windows of about ``seconds`` each (after a short warm-up)."""
    for _ in range(3):
        step()
    _sync(device)
    best = 0.0
    for _ in range(windows):
        n, start = 0, time.perf_counter()
        while True:
            n += step()
            if time.perf_counter() - start >= seconds:
                _sync(device)
                break
        best = max(best, n / (time.perf_counter() - start))
    return best


def model_rates(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    eval_batch_size: int,
    seconds: float,
    windows: int,
    device: torch.device,
    barrier: Any = None,
) -> tuple[float, float]:
    """(training samples/s, forward rows/s, proximal-pull values/s) of ``model`` on rows of ``x``; ``barrier``:
    wait for the other processes before each phase, so that they run at once. The pull's rate is that of one
    pass over the model's parameters reading a weight, its anchor and its gradient and writing the gradient
    (``addcmul_``: the least memory traffic the pull's arithmetic needs), over vectors not in cache."""
    model = model.to(device)
    x, y = x.to(device), y.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    state = {"i": 0}

    def train_step() -> int:
        i = state["i"] = (state["i"] + batch_size) % max(1, x.shape[0] - batch_size)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[i : i + batch_size]), y[i : i + batch_size]).backward()
        opt.step()
        return batch_size

    eval_x = x[:eval_batch_size]
    while eval_x.shape[0] < eval_batch_size:  # fewer rows than a batch (smoke): repeat them
        eval_x = torch.cat([eval_x, x])[:eval_batch_size]

    @torch.no_grad()
    def forward() -> int:
        model(eval_x)
        return eval_x.shape[0]

    if barrier is not None:
        barrier.wait()
    model.train()
    train = _windows(train_step, seconds, windows, device)
    if barrier is not None:
        barrier.wait()
    model.eval()
    fwd = _windows(forward, seconds, windows, device)
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    # as in a training step, whose forward and backward pass between two pulls: the vectors not in cache
    # (sets of three, cycled, more than a large last-level cache holds)
    sets = [[weights.clone() for _ in range(3)] for _ in range(max(2, -(-PULL_CACHE_BYTES // (12 * weights.numel()))))]
    turn = {"i": 0}

    def pull() -> int:
        w, anchor, grad = sets[turn["i"] % len(sets)]
        turn["i"] += 1
        grad.addcmul_(w, anchor)
        return grad.numel()

    if barrier is not None:
        barrier.wait()
    return train, fwd, _windows(pull, seconds, windows, device)


def _worker(rates: Any, args: tuple, barrier: Any, threads: int | None) -> None:
    set_threads(threads)
    rates.put(model_rates(*args, barrier=barrier))


def measure_rates(
    build: Callable[[], torch.nn.Module],
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    eval_batch_size: int,
    processes: int,
    threads: int | None,
    device: torch.device,
    seconds: float,
    windows: int,
    params: int,
    updates: int,
) -> tuple[Rates, dict[str, Any]]:
    """The floor's rates: ``processes`` forked processes measure at once (one here in-process when 1)."""
    set_threads(threads)
    args = (build(), x, y, batch_size, eval_batch_size, seconds, windows, device)
    if processes == 1:
        per = [model_rates(*args)]
    else:
        ctx = mp.get_context("fork")
        queue, barrier = ctx.Queue(), ctx.Barrier(processes)
        procs = [ctx.Process(target=_worker, args=(queue, args, barrier, threads)) for _ in range(processes)]
        for p in procs:
            p.start()
        per = [queue.get() for _ in procs]
        for p in procs:
            p.join()
    read = read_rate(params, updates, device, seconds, windows)
    rates = Rates(
        train=statistics.mean(t for t, _, _ in per),
        forward=statistics.mean(f for _, f, _ in per),
        read=read,
        processes=processes,
        pull=statistics.mean(u for _, _, u in per),
    )
    return rates, {"per_process": [{"train": t, "forward": f, "pull": u} for t, f, u in per]}


def read_rate(params: int, updates: int, device: torch.device, seconds: float, windows: int) -> float:
    """Values/s of a weighted sum over ``updates`` flat vectors of ``params`` values (the server's reads)."""
    gen = torch.Generator().manual_seed(0)
    vectors = [torch.randn(params, generator=gen).to(device) for _ in range(max(1, updates))]
    out = torch.zeros(params, device=device)

    def step() -> int:
        out.zero_()
        for v in vectors:
            out.add_(v, alpha=0.05)
        return params * len(vectors)

    return _windows(step, seconds, windows, device)


# --- the run ------------------------------------------------------------------------------------------
class Timings:
    """The engine's fit, client evaluation and pooled-global evaluation per round, timed in the run's process."""

    def __init__(self) -> None:
        self.fit: list[float] = []
        self.evaluate: list[float] = []
        self.evaluate_global: list[float] = []

    def __enter__(self) -> Timings:
        self._saved = saved = (LocalEngine.fit, LocalEngine.evaluate, LocalEngine.evaluate_global)

        def timed(fn: Callable, into: list[float]) -> Callable:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                out = fn(*args, **kwargs)
                into.append(time.perf_counter() - start)
                return out

            return wrapper

        LocalEngine.fit = timed(saved[0], self.fit)
        LocalEngine.evaluate = timed(saved[1], self.evaluate)
        LocalEngine.evaluate_global = timed(saved[2], self.evaluate_global)
        return self

    def __exit__(self, *exc: object) -> None:
        LocalEngine.fit, LocalEngine.evaluate, LocalEngine.evaluate_global = self._saved


def timed_run(overrides: list[str], out: Path) -> dict[str, Any]:
    """Medians over rounds 2.. of the run's round, fit, evaluation, and of the engine's parts."""
    with Timings() as t:
        result = run_experiment(load_config(None, overrides), out, show_progress=False)
    rows = RunStore(result.run_dir).read_metrics()
    steady = slice(1, None) if len(rows) > 1 else slice(None)

    def median(values: list[float]) -> float:
        values = values[steady]
        return statistics.median(values) if values else 0.0

    fit = [r["fit_seconds"] for r in rows]
    evaluation = [r.get("eval_seconds", 0.0) for r in rows]
    return {
        "fit": median(fit),
        "eval": median(evaluation),
        "round": median([f + e for f, e in zip(fit, evaluation)]),
        "first_round": fit[0] + evaluation[0],
        "clients_fit": median(t.fit),
        "server": median([f - c for f, c in zip(fit, t.fit)]),
        "eval_clients": median(t.evaluate),
        "eval_global": median(t.evaluate_global) if t.evaluate_global else 0.0,
        "workers": result.summary.get("workers", {}).get("processes", 1),
        "rounds": len(rows),
    }


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    about = {"cpu": cpu, "torch": torch.__version__, "cores": len(os.sched_getaffinity(0))}
    if torch.cuda.is_available():
        about["gpu"] = torch.cuda.get_device_name()
    return about


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("args", nargs="*", help="key=value overrides on top of the setting")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--rounds", type=int, default=4, help="rounds per run (medians over rounds 2..)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"among {', '.join(METHODS)}")
    ap.add_argument("--seconds", type=float, default=2.0, help="length of one throughput window")
    ap.add_argument("--windows", type=int, default=3, help="throughput windows per rate (the best counts)")
    ap.add_argument("--json", type=Path, default=None, help="write every figure to this file")
    ap.add_argument("--smoke", action="store_true", help="a tiny setting and short windows: checks the script")
    args = ap.parse_args(argv)
    extra = list(args.args)
    if args.smoke:
        extra = [*SMOKE, *extra]
        args.seconds, args.windows, args.rounds = min(args.seconds, 0.05), 1, min(args.rounds, 2)
    base = [*SETTING, *extra, f"device={args.device}", f"rounds={args.rounds}", f"checkpoint_every={args.rounds}"]

    cfg = load_config(None, [*base, *METHODS["fedavg"].overrides])
    device = resolve_device(cfg.device)
    set_threads(cfg.threads)  # before any torch work: forked processes must not inherit a thread pool in use
    if cfg.keep_freed_memory:  # the allocator the runs have (they set it on start): the first rates too
        keep_freed_memory()
    planned = plan_data(cfg, device=torch.device("cpu"))  # on the CPU: each measurement moves what it times
    data = planned.data
    clients = data.clients
    resolved = resolve_workers(cfg.workers, cfg.threads, device, len(clients), cfg.engine, cfg.vectorize)
    processes = resolved.count

    def build() -> torch.nn.Module:
        return planned.build_model(torch_generator(cfg.seed))

    params = sum(p.numel() for p in build().state_dict().values())
    weights = sum(p.numel() for p in build().parameters())  # what a proximal pull moves
    x = torch.cat([c.x_train for c in clients])
    y = torch.cat([c.y_train for c in clients])

    def rates_now() -> tuple[Rates, dict[str, Any]]:
        return measure_rates(
            build, x, y, cfg.algorithm.batch_size, cfg.eval_batch_size, processes, cfg.threads, device,
            args.seconds, args.windows, params, len(clients),
        )  # fmt: skip

    def throughput(when: str, r: Rates) -> str:
        return (
            f"throughput {when}, {processes} process(es) at once: training {r.train:.0f} samples/s per process, "
            f"forward {r.forward:.0f} rows/s per process, proximal pull {r.pull / 1e9:.2f} G values/s per process; "
            f"server reads {r.read / 1e9:.2f} G values/s"
        )

    rates, detail = rates_now()
    train_n = [int(c.y_train.shape[0]) for c in clients]
    val_n = [int(c.y_val.shape[0]) for c in clients]
    test_n = [int(c.y_test.shape[0]) for c in clients]
    print(
        f"setting: {cfg.dataset.name}, {len(clients)} clients, {sum(train_n)} training rows, "
        f"{sum(val_n) + sum(test_n)} validation + test rows, {cfg.model.name} ({params} parameters), batch "
        f"{cfg.algorithm.batch_size}, evaluation batch {cfg.eval_batch_size}, device {device.type}, "
        f"{processes} process(es) ({resolved.reason})"
    )
    print(throughput("at the start", rates))
    report: dict[str, Any] = {
        "machine": machine(),
        "setting": base,
        "processes": processes,
        "rates": asdict(rates),
        **detail,
        "rows": {"train": sum(train_n), "val": sum(val_n), "test": sum(test_n)},
        "params": params,
        "methods": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.methods.split(","):
            method = METHODS[name]
            algo = load_config(None, [*base, *method.overrides]).algorithm
            if method.server_models:  # FedMerge's d models, as configured
                method = replace(method, server_models=int(getattr(algo, "num_models", method.server_models)))
            pulled = method.pull is not None and float(getattr(algo, method.pull)) > 0
            steps = sum(planned_steps(n, algo) for n in train_n) if pulled else 0
            work = round_work(method, train_n, val_n, test_n, algo.local_epochs, params, steps * weights)
            run = timed_run([*base, *method.overrides], Path(tmp) / name)
            # the rates on either side of the run, averaged: a machine whose load drifts moves both alike
            after, _ = rates_now()
            around = Rates(*(statistics.mean(pair) for pair in zip(astuple(rates), astuple(after))))
            around = replace(around, processes=processes)
            floor = floor_seconds(work, around)
            ratios = {
                "round": run["round"] / floor["round"],
                "eval": run["eval"] / floor["eval"],
                "fit": run["fit"] / (floor["train"] + floor["pull"] + floor["server"]),
            }
            print(throughput(f"after {name}", after))
            report["methods"][name] = {
                "work": asdict(work),
                "rates": {"before": asdict(rates), "after": asdict(after), "used": asdict(around)},
                "floor": floor,
                "run": run,
                "ratios": ratios,
            }
            rates = after  # the next method's "before"
            print(
                f"{name:<9} round {run['round']:.3f} s (fit {run['fit']:.3f} = clients {run['clients_fit']:.3f} + "
                f"server {run['server']:.3f}; eval {run['eval']:.3f} = clients {run['eval_clients']:.3f} + global "
                f"{run['eval_global']:.3f}; {run['workers']} worker process(es)); floor {floor['round']:.3f} s "
                f"(train {floor['train']:.3f}, pull {floor['pull']:.3f}, server {floor['server']:.4f}, eval "
                f"{floor['eval']:.3f})"
            )
            print(
                f"{name:<9} round/floor: {ratios['round']:.2f}x   eval/floor: {ratios['eval']:.2f}x   "
                f"fit/floor: {ratios['fit']:.2f}x",
                flush=True,
            )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
