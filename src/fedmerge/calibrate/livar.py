"""``fedmerge livar calibrate``: build LIVAR's G_SHAP table on a proxy task (paper Section 4.1, App. A).

1. From one seeded start, train each of the K clients of the proxy config for one round (the LIVAR
   client: ordinary local training, collecting the path-integral importances s_A, s_B per LoRA
   layer) and a centralized model on the union of their training data with the same settings.
2. Per layer l, solve Eq. 4: ``min ||dW_joint - sum_k lambda_k dW_k||^2`` s.t. ``lambda >= 0``
   (``scipy.optimize.nnls``), with ``dW = B A - B0 A0`` the layer's LoRA update.
3. Fit a random forest from the quantiles (percent rank over all clients and layers of the repeat)
   of (s_A, s_B) to lambda, explain it with ``shap.TreeExplainer``, and discretise: the cell of
   (A bin, B bin) is ``base + mean SHAP_A(bin) + mean SHAP_B(bin)`` (floored at a small positive value).

Repeats use fresh initialisations and data orders, adding K x L samples each. Outputs, in the
output folder: ``g_shap.json`` (load with ``algorithm.shap_table=...``), ``samples.csv`` and
``shap_dependence.png`` (the paper's Figs. 2-3).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedmerge.algorithms.base import train_received
from fedmerge.algorithms.importance import PathIntegralImportance, lora_layers
from fedmerge.algorithms.shap_table import ShapTable, bins_against
from fedmerge.config.schema import ConfigError, ExperimentConfig, make_folder
from fedmerge.core.algorithm import ClientContext
from fedmerge.core.seeding import torch_generator
from fedmerge.core.training import LocalTraining
from fedmerge.engines.workers import set_threads
from fedmerge.run.data_plan import plan_data

MIN_CELL = 1e-3  # cells are normalised into merge weights: keep every one positive


@dataclass
class JointData:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor


@dataclass
class Calibration:
    table: ShapTable
    samples: list[dict[str, float]]
    out_dir: Path


def _lora_deltas(weights: dict[str, torch.Tensor], start: dict[str, torch.Tensor], layers) -> list[torch.Tensor]:
    return [(weights[b] @ weights[a] - start[b] @ start[a]).double().reshape(-1) for _, a, b in layers]


def percent_rank(values: np.ndarray) -> np.ndarray:
    """Position of each value in the sorted values, 0..100 (ties share their mean rank)."""
    from scipy.stats import rankdata

    if values.size < 2:
        return np.full(values.shape, 50.0)
    return (rankdata(values) - 1) / (values.size - 1) * 100.0


def collect_samples(cfg: ExperimentConfig, repeats: int, log: Callable[[str], None] = print) -> list[dict[str, float]]:
    """Steps 1-2: one (client, layer) row per sample with s_A, s_B, their percent ranks and lambda."""
    from scipy.optimize import nnls

    set_threads(cfg.threads)  # before the data is built, as a run does: the count is part of the numbers
    planned = plan_data(cfg)
    data, device, factory = planned.data, planned.device, planned.build_model
    model = factory(torch.Generator().manual_seed(0)).to(device)
    layers = lora_layers(list(model.state_dict()))
    if not layers:
        raise ConfigError("livar calibrate needs a LoRA model (e.g. model.name=minilm_lora)")
    train = LocalTraining(**cfg.algorithm.model_dump(include=set(LocalTraining.model_fields)))
    joint = JointData(
        torch.cat([c.x_train for c in data.clients]),
        torch.cat([c.y_train for c in data.clients]),
        torch.cat([c.x_val for c in data.clients]),
        torch.cat([c.y_val for c in data.clients]),
    )
    rows: list[dict[str, float]] = []
    for rep in range(repeats):
        init = factory(torch_generator(cfg.seed, -1, rep, "livar-calibrate/init")).state_dict()
        start = {k: v.detach().clone().to(device) for k, v in init.items()}
        s_a, s_b, deltas = [], [], []
        for cid, client in enumerate(data.clients):
            ctx = ClientContext(model, device, cfg.seed, rep, cid)
            tracker = PathIntegralImportance(model, layers)
            train_received(start, client, train, ctx, before_step=tracker.before_step, after_step=tracker.after_step)
            s_a.append(tracker.sums[0].numpy())
            s_b.append(tracker.sums[1].numpy())
            deltas.append(_lora_deltas(model.state_dict(), start, layers))
            log(f"repeat {rep + 1}/{repeats}: client {cid + 1}/{len(data.clients)} trained")
        train_received(start, joint, train, ClientContext(model, device, cfg.seed, rep, -1))
        target = _lora_deltas(model.state_dict(), start, layers)
        log(f"repeat {rep + 1}/{repeats}: centralized model trained on {int(joint.y_train.shape[0])} samples")
        sa, sb = np.stack(s_a), np.stack(s_b)  # (clients, layers)
        qa, qb = percent_rank(sa.ravel()).reshape(sa.shape), percent_rank(sb.ravel()).reshape(sb.shape)
        for j, (name, _, _) in enumerate(layers):
            basis = torch.stack([d[j] for d in deltas], dim=1).cpu().numpy()
            lam, _ = nnls(basis, target[j].cpu().numpy())
            for cid in range(len(data.clients)):
                rows.append(
                    {
                        "repeat": rep, "client": cid, "layer": name, "s_A": float(sa[cid, j]),
                        "s_B": float(sb[cid, j]), "q_A": float(qa[cid, j]), "q_B": float(qb[cid, j]),
                        "lambda": float(lam[cid]),
                    }
                )  # fmt: skip
    return rows


def fit_table(
    rows: list[dict[str, float]],
    a_edges: tuple[float, ...] = (25.0, 50.0),
    b_edges: tuple[float, ...] = (60.0, 80.0),
    trees: int = 200,
    seed: int = 0,
) -> tuple[ShapTable, np.ndarray]:
    """Step 3: random forest (q_A, q_B) -> lambda, SHAP values, discretised table. Returns the
    table and the SHAP values ``(samples, 2)``."""
    import shap
    from sklearn.ensemble import RandomForestRegressor

    x = np.array([[r["q_A"], r["q_B"]] for r in rows])
    y = np.array([r["lambda"] for r in rows])
    forest = RandomForestRegressor(n_estimators=trees, min_samples_leaf=2, random_state=seed).fit(x, y)
    explainer = shap.TreeExplainer(forest)
    values = np.asarray(explainer.shap_values(x))
    base = float(np.ravel(explainer.expected_value)[0])
    a_bins = bins_against(torch.from_numpy(x[:, 0]), a_edges).numpy()
    b_bins = bins_against(torch.from_numpy(x[:, 1]), b_edges).numpy()

    def bin_means(bins: np.ndarray, column: np.ndarray, count: int) -> list[float]:
        return [float(column[bins == i].mean()) if (bins == i).any() else 0.0 for i in range(count)]

    shap_a = bin_means(a_bins, values[:, 0], len(a_edges) + 1)
    shap_b = bin_means(b_bins, values[:, 1], len(b_edges) + 1)
    cells = tuple(tuple(max(base + sa + sb, MIN_CELL) for sb in shap_b) for sa in shap_a)
    source = f"fedmerge livar calibrate ({len(rows)} samples)"
    table = ShapTable(a_edges=a_edges, b_edges=b_edges, values=cells, base=base, source=source)
    return table, values


def plot_dependence(rows: list[dict[str, float]], values: np.ndarray, table: ShapTable, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    q = np.array([[r["q_A"], r["q_B"]] for r in rows])
    for ax, col, label, edges in ((axes[0], 0, "s_A", table.a_edges), (axes[1], 1, "s_B", table.b_edges)):
        sc = ax.scatter(q[:, col], values[:, col], c=q[:, 1 - col], cmap="coolwarm", s=12, alpha=0.8)
        for e in edges:
            ax.axvline(e, color="grey", ls="--", lw=0.8)
        ax.axhline(0, color="black", lw=0.5)
        ax.set_xlabel(f"quantile of {label} (%)")
        fig.colorbar(sc, ax=ax, label=f"quantile of {'s_B' if col == 0 else 's_A'} (%)")
    axes[0].set_ylabel("SHAP value (impact on lambda)")
    fig.suptitle("LIVAR calibration: SHAP dependence of the optimal merge coefficient")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def calibrate(
    cfg: ExperimentConfig,
    out_dir: str | Path,
    repeats: int = 3,
    trees: int = 200,
    a_edges: tuple[float, ...] = (25.0, 50.0),
    b_edges: tuple[float, ...] = (60.0, 80.0),
    log: Callable[[str], None] = print,
) -> Calibration:
    """The whole pipeline; writes g_shap.json, samples.csv, shap_dependence.png and config.json."""
    out = Path(out_dir)
    make_folder(out, "--out")
    rows = collect_samples(cfg, repeats, log)
    table, values = fit_table(rows, a_edges, b_edges, trees, cfg.seed)
    for r, v in zip(rows, values):
        r["shap_A"], r["shap_B"] = float(v[0]), float(v[1])
    with open(out / "samples.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot_dependence(rows, values, table, out / "shap_dependence.png")
    meta: dict[str, Any] = {"proxy": cfg.model_dump(mode="json"), "repeats": repeats, "trees": trees}
    (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    table.save(out / "g_shap.json")  # last: its presence means the run finished
    return Calibration(table, rows, out)
