"""``fedmerge plot lambda RUN_DIR``: accuracy along the interpolation line (SuPerFed Fig. 3 / A2) of a run folder,
drawn by the methods' own [`draw_lambda`][fedmerge.algorithms.lambda_line.draw_lambda]."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fedmerge.algorithms.lambda_line import draw_lambda, lambda_curve

__all__ = ["lambda_curve", "plot_lambda", "read_rows"]


def read_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; is {run_dir} a run folder?")
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut by a crash
    return rows


def plot_lambda(
    run_dir: str | Path, out: str | Path | None = None, split: str = "test", rnd: int | None = None
) -> Path:
    """Draw mean +- std client accuracy against lambda; returns the image path (default RUN_DIR/lambda.png)."""
    run_dir = Path(run_dir)
    curve = lambda_curve(read_rows(run_dir), split, rnd)
    return draw_lambda(curve, Path(out) if out is not None else run_dir / "lambda.png", run_dir.name, split)
