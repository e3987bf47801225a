"""``fedmerge livar``: LIVAR's tools, a method command group (``METHOD_COMMANDS`` in cli/app.py: imported when
named)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from fedmerge.cli.app import (
    CONFIG_AND_OVERRIDES,
    err,
    fail,
    new_typer,
    out,
    split_args,
    user_errors,
)

livar_app = new_typer(no_args_is_help=True, help="LIVAR tools.")


def _edges(text: str, name: str) -> tuple[float, ...]:
    try:
        edges = tuple(float(v) for v in text.split(","))
    except ValueError:
        fail(f"{name}: expected comma-separated percentages such as 25,50, got {text!r}", 2)
    return edges


@livar_app.command("calibrate")
def livar_calibrate_cmd(
    args: list[str] = CONFIG_AND_OVERRIDES,
    out_dir: Path = typer.Option(Path("runs/livar-calibration"), "--out", help="folder for g_shap.json and plots"),
    repeats: int = typer.Option(3, "--repeats", min=1, help="fresh starts, each adding clients x layers samples"),
    trees: int = typer.Option(200, "--trees", min=1, help="random-forest size"),
    a_edges: str = typer.Option("25,50", "--a-edges", help="quantile edges (percent) of s_A"),
    b_edges: str = typer.Option("60,80", "--b-edges", help="quantile edges (percent) of s_B"),
) -> None:
    """Fit LIVAR's G_SHAP table on a proxy task (a LoRA config): federated clients vs. a centralized
    model, per-layer NNLS, random forest, SHAP, quantile table. Use it with algorithm.shap_table=OUT/g_shap.json."""
    from fedmerge.calibrate.livar import calibrate
    from fedmerge.config.schema import load_config

    config_path, overrides = split_args(args)
    if config_path is None:
        fail("livar calibrate needs a proxy config with a LoRA model, e.g. configs/livar_proxy_bible.yaml", 2)
    a, b = _edges(a_edges, "--a-edges"), _edges(b_edges, "--b-edges")
    try:
        cfg = load_config(config_path, overrides)
        result = calibrate(cfg, out_dir, repeats, trees, a, b, log=lambda m: err.print(escape(m), highlight=False))
    except ImportError as exc:
        fail(f"{exc}: livar calibrate needs pip install -e '.[livar]' (scikit-learn, shap)", 2)
    except (*user_errors(), ValueError) as exc:
        fail(str(exc), 2)
    grid = Table(title=f"G_SHAP from {len(result.samples)} samples (rows: s_A bins, columns: s_B bins)")
    grid.add_column("")
    bounds = lambda e: [f"<{e[0]:g}", *[f"{lo:g}-{hi:g}" for lo, hi in zip(e[:-1], e[1:])], f">{e[-1]:g}"]  # noqa: E731
    for label in bounds(result.table.b_edges):
        grid.add_column(f"Q_B {label}", justify="right")
    for label, row in zip(bounds(result.table.a_edges), result.table.values):
        grid.add_row(f"Q_A {label}", *[f"{v:.4f}" for v in row])
    out.print(grid)
    out.print(f"table saved to {result.out_dir / 'g_shap.json'}", soft_wrap=True, highlight=False)
