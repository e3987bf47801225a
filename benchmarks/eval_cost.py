"""Evaluation cost: the personal evaluation of every client (plus the global model's pooled test) as a
share of a round, for configs run as they are (median over rounds 2.., as logged in metrics.jsonl).
Target: at most 10% of a FedAvg round on the default config.

    python benchmarks/eval_cost.py [CONFIG ...] [--rounds 6] [--set key=value ...]

With no CONFIG: the built-in default (FedAvg, UCI digits, 10 clients). ``--clock cpu`` is not offered:
the figures come from the run's own wall-clock fields, so run it on a machine as quiet as you can.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from fedmerge.config.schema import load_config
from fedmerge.run.results import RunStore
from fedmerge.run.runner import run_experiment


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="*", help="config files (default: the built-in default)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--set", nargs="*", default=[], help="key=value overrides for every config")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for i, config in enumerate(args.configs or [None]):
            overrides = [*args.set, f"rounds={args.rounds}", "eval_every=1", f"checkpoint_every={args.rounds}"]
            cfg = load_config(config, overrides)
            result = run_experiment(cfg, Path(tmp) / str(i), show_progress=False)
            rows = RunStore(result.run_dir).read_metrics()[1:]
            fit = statistics.median(r["fit_seconds"] for r in rows)
            evaluation = statistics.median(r["eval_seconds"] for r in rows)
            print(
                f"{config or 'default'}: {cfg.algorithm.name}, {len(rows[0]['eval']['clients'])} clients evaluated; "
                f"fit {fit * 1e3:.1f} ms, evaluation {evaluation * 1e3:.1f} ms = "
                f"{evaluation / (fit + evaluation):.1%} of the round",
                flush=True,
            )


if __name__ == "__main__":
    main()
