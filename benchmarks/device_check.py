"""Every registered method on an accelerator: a short run on ``--device`` next to the same run on CPU.

    python benchmarks/device_check.py --device cuda [--rounds 2] [--out checks.json]

(``scripts/device_check.py``, the path the docs named first, runs the same.)

For each algorithm, the built-in default (FedAvg's UCI digits, 10 clients, Dirichlet(0.5), an MLP) is
run for a few rounds with ``algorithm.name`` set to it, once on CPU and once on the device, and the
vectorised engine (``vectorize: true``) once on the device for the methods it accepts (it refuses the
others in one line before training, which leaves their cell out). A method whose
config the default refuses (one that needs a LoRA model) is listed as skipped with the reason. The two
devices are not bit-identical (other kernels sum in other orders), so the check is that each run
finishes and that its last-round mean client test accuracy is close to the CPU run's; one line per
method, and exit status 1 if any run failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from fedmerge.algorithms import ALGORITHMS
from fedmerge.config.schema import ConfigError, load_config
from fedmerge.run.runner import run_experiment


def last_acc(summary: dict) -> float:
    return float(summary["last"]["clients"]["test_acc"]["mean"])


def run_one(name: str, overrides: list[str], folder: Path) -> tuple[str, float | None, float]:
    """(status, last-round mean client test accuracy, seconds)."""
    t0 = time.perf_counter()
    try:
        cfg = load_config(None, [f"algorithm.name={name}", *overrides])
        result = run_experiment(cfg, folder, show_progress=False)
    except ConfigError as exc:  # refused before training (a method that needs another model)
        return "skipped: " + str(exc).strip().splitlines()[0], None, 0.0
    except Exception as exc:  # reported per method; the traceback goes to stderr
        traceback.print_exc(file=sys.stderr)
        return (
            f"FAILED: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
            None,
            0.0,
        )
    return "ok", last_acc(result.summary), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    """The command: 1 if any run failed, else 0."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--algorithms", default=None, help="comma-separated names (default: all registered)")
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but torch sees no CUDA device")
    names = args.algorithms.split(",") if args.algorithms else sorted(ALGORITHMS.names())
    common = [f"rounds={args.rounds}", "eval_every=1"]
    rows, failed = [], False
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            row = {"algorithm": name}
            for i, (label, extra) in enumerate(
                (
                    ("cpu", ["device=cpu"]),
                    (args.device, [f"device={args.device}"]),
                    ("vectorized", [f"device={args.device}", "vectorize=true"]),
                )
            ):  # a folder per run (with --device cpu two labels are the same; a run folder is never reused)
                status, acc, secs = run_one(name, [*common, *extra], Path(tmp) / f"{name}-{i}-{label}")
                if label == "vectorized" and status.startswith("skipped"):
                    continue  # not a vectorizable method, or the default refuses it anyway
                row[label] = {"status": status, "acc": acc, "seconds": round(secs, 2)}
                failed |= status.startswith("FAILED")
            rows.append(row)
            cells = []
            for label in ("cpu", args.device, "vectorized"):
                if label in row:
                    r = row[label]
                    cells.append(f"{label} {r['acc']:.3f}" if r["acc"] is not None else f"{label} {r['status']}")
            print(f"{name:<12} " + " | ".join(cells), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
