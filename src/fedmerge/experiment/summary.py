"""Turn per-round metric rows into per-round summaries and the final run summary."""

from __future__ import annotations

import math
from typing import Any

from fedmerge.metrics import summarize

HEADLINE = ("test_acc", "test_top5", "test_nll", "test_ece", "test_mce")
TIMING_KEYS = ("fit_seconds", "eval_seconds", "wall_seconds", "elapsed_seconds")


def _lower_is_better(key: str) -> bool:
    return any(t in key for t in ("nll", "loss", "ece", "mce"))


def summarize_eval(per_client: dict[Any, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Across clients: mean, sample-weighted mean (by that split's size), std, worst 10%."""
    keys = sorted({k for m in per_client.values() for k in m if not k.endswith("_n")})
    out: dict[str, dict[str, float]] = {}
    for key in keys:
        split = key.split("_", 1)[0]
        vals, wts = [], []
        for m in per_client.values():
            if key in m and math.isfinite(m[key]):
                vals.append(m[key])
                wts.append(m.get(f"{split}_n", 1.0))
        if vals:
            out[key] = summarize(vals, wts, higher_is_better=not _lower_is_better(key))
    return out


def build_summary(rows: list[dict[str, Any]], info: dict[str, Any]) -> dict[str, Any]:
    """Final figures: the last evaluated round and the round with the lowest mean val loss."""
    evals = [r for r in rows if "eval" in r]
    summary: dict[str, Any] = dict(info)
    summary["rounds_completed"] = rows[-1]["round"] if rows else 0
    if rows:
        summary["communication_per_client_per_round"] = {
            "down": sum(r["comm_down"] for r in rows) / len(rows),
            "up": sum(r["comm_up"] for r in rows) / len(rows),
        }
    if not evals:
        return summary
    last = evals[-1]
    summary["last"] = {
        "round": last["round"],
        "clients": last["summary"],
        "global": last["eval"].get("global"),
    }
    with_val = [r for r in evals if "val_nll" in r["summary"]]
    if with_val:
        best = min(with_val, key=lambda r: (r["summary"]["val_nll"]["mean"], r["round"]))
        summary["best_val"] = {
            "round": best["round"],
            "val_nll": best["summary"]["val_nll"]["mean"],
            "clients": best["summary"],
            "global": best["eval"].get("global"),
        }
    return summary


def summary_markdown(summary: dict[str, Any]) -> str:
    lines = [
        f"# {summary.get('name', 'run')}: {summary.get('algorithm')} on {summary.get('dataset')}",
        "",
        f"rounds completed: {summary.get('rounds_completed')}",
        "",
        "| selection | round | metric | mean | weighted mean | std | worst 10% |",
        "|---|---|---|---|---|---|---|",
    ]
    for label in ("last", "best_val"):
        part = summary.get(label)
        if not part:
            continue
        for key in HEADLINE:
            s = part["clients"].get(key)
            if s:
                lines.append(
                    f"| {label} | {part['round']} | {key} | {s['mean']:.4f} | {s['weighted_mean']:.4f} | "
                    f"{s['std']:.4f} | {s['worst10']:.4f} |"
                )
        glob = part.get("global")
        if glob:
            lines.append(
                f"| {label} (global model, pooled test) | {part['round']} | test_acc | {glob['test_acc']:.4f} | | | |"
            )
    params = summary.get("parameters")
    if params:
        lines += ["", "| parameters | count |", "|---|---|"]
        lines += [f"| {k} | {v:,.0f} |" for k, v in params.items()]
    return "\n".join(lines) + "\n"
