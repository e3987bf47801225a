"""What the aggregation rules cost over FedAvg: steady-state seconds per training round, as ratios.

Every rule trains exactly like FedAvg; the extra work is the client's statistics (LIVAR: importances
during the steps + one feature pass; RegMean: one pass collecting input Grams; Fisher: one backward per
example; CCVR: one feature pass + covariances) and the server's merge. Same config for all; a round's
time is the logged fit time (client updates + aggregation), median over rounds 2.. .

    python benchmarks/aggregator_overhead.py [--clients 10] [--rounds 6] [--model mlp]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from fedmerge.config.schema import load_config
from fedmerge.run.results import RunStore
from fedmerge.run.runner import run_experiment

RULES = {
    "fedavg": [],
    "livar": ["algorithm.name=livar"],
    "livar+ccvr": ["algorithm.name=livar", "algorithm.ccvr={}"],
    "ccvr": ["algorithm.name=ccvr"],
    "regmean": ["algorithm.name=regmean"],
    "fisher_avg (sampled, 256)": ["algorithm.name=fisher_avg"],
    "fedproto (shared)": ["algorithm.name=fedproto", "algorithm.share_parameters=true"],
}


def fit_seconds(overrides: list[str], out: Path) -> float:
    result = run_experiment(load_config(None, overrides), out, show_progress=False)
    rows = RunStore(result.run_dir).read_metrics()
    return statistics.median(r["fit_seconds"] for r in rows[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--model", default="mlp")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = [
        f"partition.num_clients={args.clients}",
        f"rounds={args.rounds}",
        f"model.name={args.model}",
        "eval_every=1000",
        "algorithm.local_epochs=1",
        "threads=1",
        "checkpoint_every=1000",
    ]
    times = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in RULES.items():
            times[name] = fit_seconds([*base, *extra], Path(tmp) / name.split()[0])
    print(f"config: UCI digits, {args.clients} clients, {args.model}, 1 local epoch; fit seconds per round")
    for name, t in times.items():
        print(f"{name:28s} {t:.3f} s/round  {t / times['fedavg']:.2f}x FedAvg")


if __name__ == "__main__":
    main()
