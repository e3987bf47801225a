"""Engine overhead: seconds per round on the local engine with 1, 2, ... worker processes (and,
optionally, Flower's simulation runtime), against the plain training loop over the same samples.

Same config, same numbers (the engines and worker counts are bit-identical); only where client
work runs differs. A round's fit time is as logged in metrics.jsonl (configure + client training +
aggregation); the steady state is the median over rounds 2.. (round 1 also pays warm-up: worker
start, Flower's ClientApp imports and data loading in Ray workers). The plain loop trains one model
on every client's samples in the same batches (no batch spans two clients), on the same one thread.
``plain/fit`` above 1 means the round beats one process's plain loop (parallel workers).

    python benchmarks/engine_overhead.py [CONFIG] [key=value ...] [--workers 1,2] [--rounds 6] [--flower]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from plain_loop import plain_loop

from fedmerge.config.schema import load_config
from fedmerge.core.seeding import torch_generator
from fedmerge.run.data_plan import plan_data
from fedmerge.run.results import RunStore
from fedmerge.run.runner import run_experiment


def timed_run(config: str | None, overrides: list[str], out: Path) -> tuple[float, float, float, float]:
    """(steady fit s/round, first round's fit, eval s of the last round, seconds outside the rounds)."""
    t0 = time.perf_counter()
    result = run_experiment(load_config(config, overrides), out, show_progress=False)
    wall = time.perf_counter() - t0
    rows = RunStore(result.run_dir).read_metrics()
    fit = [r["fit_seconds"] for r in rows]
    outside = wall - rows[-1]["elapsed_seconds"]  # data loading, engine start-up and shut-down
    return statistics.median(fit[1:]), fit[0], rows[-1].get("eval_seconds", 0.0), outside


def plain_seconds(config: str | None, overrides: list[str], rounds: int) -> tuple[float, str]:
    """Median seconds of the plain loop over the round's clients' samples, and a description."""
    cfg = load_config(config, overrides)
    torch.set_num_threads(cfg.threads or torch.get_num_threads())
    planned = plan_data(cfg, device=torch.device("cpu"))
    data, model = planned.data, planned.build_model(torch_generator(cfg.seed))
    algo = cfg.algorithm
    if cfg.participation < 1 or getattr(algo, "local_steps", None):
        raise SystemExit("the plain-loop comparison needs participation=1 and epoch-based local training")
    parts = [(c.x_train, c.y_train) for c in data.clients]
    times = [
        plain_loop(model, parts, algo.batch_size, algo.lr, algo.local_epochs, torch_generator(cfg.seed, r))
        for r in range(rounds)
    ]
    about = (
        f"{cfg.dataset.name}, {len(parts)} clients, {sum(len(y) for _, y in parts)} training samples, "
        f"{cfg.model.name}, {cfg.algorithm.name}, batch {algo.batch_size}, {algo.local_epochs} local epoch(s), "
        f"threads={cfg.threads}"
    )
    return statistics.median(times[1:]), about


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("args", nargs="*", help="[CONFIG] [key.path=value ...] as for fedmerge run")
    ap.add_argument("--workers", default="1,2", help="worker counts to run (comma-separated)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--flower", action="store_true", help="also run Flower's simulation (slow to start)")
    ap.add_argument("--cpus", type=int, default=2, help="CPUs Ray may use (parallel ClientApps)")
    args = ap.parse_args()
    config = args.args[0] if args.args and "=" not in args.args[0] else None
    base = [a for a in args.args if "=" in a]
    base += [f"rounds={args.rounds}", f"eval_every={args.rounds}", f"checkpoint_every={args.rounds}"]

    plain, about = plain_seconds(config, base, args.rounds)
    print(f"config: {about}; steady state over rounds 2..{args.rounds}")
    print(f"plain loop          : {plain:.3f} s/round (training only)")
    runs = {f"local workers={w}": [f"workers={w}"] for w in args.workers.split(",")}
    if args.flower:
        runs[f"flower ({args.cpus} CPUs)"] = ["engine=flower", f"flower.num_cpus={args.cpus}"]
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, extra) in enumerate(runs.items()):
            fit, first, evaluation, outside = timed_run(config, [*base, *extra], Path(tmp) / str(i))
            print(
                f"{name:<20}: fit {fit:.3f} s/round, plain/fit {plain / fit:.3f}; first round {first:.2f} s, "
                f"evaluation {evaluation:.3f} s, outside the rounds {outside:.2f} s",
                flush=True,
            )


if __name__ == "__main__":
    main()
