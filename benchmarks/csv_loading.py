"""CSV loading: seconds to load a wide CSV against the same data as .npz (``load_pool``, in one process).

The CSV loader reads every column in one vectorised pass (pandas' C parser); a per-cell Python loop
took about 140x the .npz time on 3,000 x 2,000 values. pandas' import is timed apart.

    python benchmarks/csv_loading.py [--rows 3000] [--cols 2000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from fedmerge.data import load_pool


def best_of(runs: int, fn) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=3000)
    ap.add_argument("--cols", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.rows, args.cols)).astype(np.float32)
    y = rng.integers(0, 5, args.rows)
    with tempfile.TemporaryDirectory() as tmp:
        csv, npz = Path(tmp) / "wide.csv", Path(tmp) / "wide.npz"
        np.savez(npz, x=x, y=y)
        with open(csv, "w") as fh:
            fh.write(",".join([f"f{i}" for i in range(args.cols)] + ["label"]) + "\n")
            for row, label in zip(x, y):
                fh.write(",".join(f"{v:.6g}" for v in row) + f",{label}\n")
        t0 = time.perf_counter()
        import pandas  # noqa: F401

        import_s = time.perf_counter() - t0
        csv_s = best_of(args.repeats, lambda: load_pool({"name": "csv", "path": str(csv)}))
        npz_s = best_of(args.repeats, lambda: load_pool({"name": "npz", "path": str(npz)}))
        size_mb = csv.stat().st_size / 1e6
    print(f"{args.rows} x {args.cols} values, CSV {size_mb:.0f} MB")
    print(f"csv {csv_s:.2f}s  npz {npz_s:.3f}s  ratio csv/npz {csv_s / npz_s:.1f}  (pandas import {import_s:.2f}s)")


if __name__ == "__main__":
    main()
