"""Turn per-round metric rows into per-round summaries and the final run summary."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fedmerge.algorithms import ALGORITHMS  # importing it registers the built-in methods and their hooks
from fedmerge.metrics import summarize
from fedmerge.run.run_records import RoundRecord, RunSummary, Selection, Stats, as_summary, plain, round_records

HEADLINE = ("test_acc", "test_top5", "test_rouge1", "test_nll", "test_ece", "test_mce")
# measurements that differ between two runs of one config, not what it computed (gpu_peak_mib: a CUDA run's peak
# memory per round; workers: the processes its clients ran in, which changes no number)
TIMING_KEYS = ("fit_seconds", "eval_seconds", "wall_seconds", "elapsed_seconds", "gpu_peak_mib", "workers")


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


def build_summary(rows: Sequence[RoundRecord | dict[str, Any]], info: dict[str, Any]) -> dict[str, Any]:
    """Final figures: the last evaluated round and the round with the lowest mean val loss."""
    rounds = round_records(rows)
    evals = [r for r in rounds if r.eval is not None]
    summary: dict[str, Any] = dict(info)
    summary["rounds_completed"] = rounds[-1].round if rounds else 0
    if rounds:
        comm = {
            "down": sum(r.comm_down for r in rounds) / len(rounds),
            "up": sum(r.comm_up for r in rounds) / len(rounds),
        }
        summary["communication_per_client_per_round"] = comm
        summary["parameter_budget"] = parameter_budget(info.get("parameters", {}), comm)
        gap = local_gap_summary(rounds)
        if gap:
            summary["local_gap"] = gap
    diverged = divergence(rounds, info.get("num_classes"))
    if diverged:
        summary["diverged"] = diverged
    # a method's hooks read the rows as the JSON objects of metrics.jsonl
    summary |= method_extras([r.to_dict() if isinstance(r, RoundRecord) else r for r in rows], summary)
    if not evals:
        return summary
    last = evals[-1]
    summary["last"] = selection(last)
    names = info.get("client_names")
    if names is not None:  # named clients (e.g. "PLAY: ROLE"): each one's last figures under its name
        summary["last"]["by_client"] = named_clients(last.eval.clients, names)  # type: ignore[union-attr]
    with_val = [(stats.mean, r.round, r) for r in evals if (stats := (r.summary or {}).get("val_nll")) is not None]
    if with_val:
        val_nll, _, best = min(with_val, key=lambda t: (t[0], t[1]))
        # the round chosen on the participants' validation loss only
        summary["best_val"] = {"round": best.round, "val_nll": val_nll, **selection(best)}
    return summary


def selection(row: RoundRecord) -> dict[str, Any]:
    """An evaluated round's figures as the summary's ``last`` and ``best_val`` hold them."""
    assert row.eval is not None
    return {"round": row.round, "clients": plain(row.summary), "global": plain(row.eval.pooled), **unseen_part(row)}


# the fields build_summary writes itself: a method's summary_extras may not replace them
OWN_FIELDS = frozenset(
    {
        "rounds_completed",
        "communication_per_client_per_round",
        "parameter_budget",
        "local_gap",
        "diverged",
        "last",
        "best_val",
    }
)


def method_extras(rows: list[dict[str, Any]], info: dict[str, Any]) -> dict[str, Any]:
    """The run's method's own summary fields (its registry hooks' ``summary_extras``, e.g. FedMerge's
    ``cluster_recovery``); a field that would replace one of the summary's own is refused in one line."""
    name = info.get("algorithm")
    extras = ALGORITHMS.hooks(name).extras(rows, info)
    taken = sorted(set(extras) & (OWN_FIELDS | set(info)))
    if taken:
        raise ValueError(f"summary_extras of {name}: {', '.join(taken)} is a field the summary already has")
    return extras


def named_clients(per_client: dict[Any, dict[str, float]], names: list[str]) -> list[dict[str, Any]]:
    """The evaluated clients in id order, each with its name and headline metrics."""
    out = []
    for cid in sorted(per_client, key=int):
        metrics = per_client[cid]
        shown = {k: metrics[k] for k in (*HEADLINE, "test_n") if k in metrics}
        out.append({"cid": int(cid), "name": names[int(cid)] if int(cid) < len(names) else str(cid), **shown})
    return out


NAMED_ROWS = 40  # summary.md lists every named client up to this many, else the best and worst half of it


def named_clients_markdown(rows: list[dict[str, Any]], total: int) -> list[str]:
    key = next((k for k in ("test_acc", "test_rouge1", "test_nll") if rows and k in rows[0]), None)
    lines = ["", f"clients ({total}, named by the data; last evaluation):", ""]
    lines += [f"| cid | client | {key or 'metric'} | test samples |", "|---|---|---|---|"]
    shown = rows
    if len(rows) > NAMED_ROWS and key is not None:
        ranked = sorted(rows, key=lambda r: (r[key], r["cid"]), reverse=not _lower_is_better(key))
        shown = ranked[: NAMED_ROWS // 2] + ranked[-(NAMED_ROWS // 2) :]
        lines[1] = f"clients ({total}, named by the data; last evaluation, the best and worst {NAMED_ROWS // 2}):"
    for r in shown:
        value = f"{r[key]:.4f}" if key is not None and key in r else "-"
        lines.append(f"| {r['cid']} | {r['name']} | {value} | {int(r.get('test_n', 0))} |")
    return lines


def unseen_part(row: RoundRecord) -> dict[str, Any]:
    """The clients that never trained at an evaluated round: their summary and the participation gap (the
    participants' mean of each headline metric minus theirs: positive when newcomers do worse on a metric where
    higher is better); empty without such clients. Each further budget (``unseen.also_adapt_epochs``) adds
    ``unseen_adaptN`` and ``participation_gap_adaptN``."""
    out: dict[str, Any] = {}
    participants = row.summary or {}
    for name, unseen in row.unseen_summaries().items():
        shared = [key for key in HEADLINE if key in unseen and key in participants]
        gap = {key: participants[key].mean - unseen[key].mean for key in shared}
        out |= {name: plain(unseen), "participation_gap" + name.removeprefix("unseen"): gap}
    return out


# a classifier's training loss this many times a uniform guess's ln(C) means it did not train but blew up
DIVERGED_FACTOR = 10.0


def divergence(rows: Sequence[RoundRecord | dict[str, Any]], num_classes: int | None) -> str | None:
    """One line when the last round's mean training loss is not finite or more than
    [`DIVERGED_FACTOR`][fedmerge.run.summary.DIVERGED_FACTOR] times ``ln(num_classes)``, the loss of predicting every
    class equally (a run
    with too large a learning rate ends "done" at chance accuracy); None otherwise, and for models with
    their own task loss (``num_classes`` None)."""
    rounds = round_records(rows)
    if not rounds or not num_classes or num_classes < 2 or not rounds[-1].has("train_loss"):
        return None
    loss, what = float(rounds[-1].train_loss), "the last round's training loss"  # type: ignore[arg-type]
    if math.isnan(loss) and not any(r.train_loss is not None and math.isfinite(r.train_loss) for r in rounds):
        # no client ever reported a training loss (DP withholds it): judge by the evaluated validation loss
        evaluated = [m for r in rounds if (m := r.mean("val_nll")) is not None]
        if not evaluated:
            return None
        loss, what = float(evaluated[-1]), "the last evaluation's mean validation loss"
    uniform = math.log(num_classes)
    if math.isfinite(loss) and loss <= DIVERGED_FACTOR * uniform:
        return None
    return (
        f"diverged: {what} is {loss:.3g}, more than {DIVERGED_FACTOR:g} x ln({num_classes}) "
        f"= {DIVERGED_FACTOR * uniform:.3g} (a uniform guess); use a smaller algorithm.lr"
    )


def parameter_budget(params: dict[str, float], comm: dict[str, float]) -> dict[str, float]:
    """Float values stored on the server, communicated per client per round, stored and optimised
    per client (the paper's Appendix A accounting).

    A client stores what it keeps between rounds plus what it receives (the model it trains), so
    Local (no download, its model as state), FedAvg and FedMerge (one received model, no state) all
    store one model. Optimised = the trainable parameters of the model a client trains, unless the
    runner reports ``client_optimized`` itself (methods training several models per client).
    """
    return {
        "server_stored": float(params.get("server_state", float("nan"))),
        "down_per_client_round": float(comm["down"]),
        "up_per_client_round": float(comm["up"]),
        "client_stored": float(params.get("client_state_mean", 0.0)) + float(comm["down"]),
        "client_optimized": float(params.get("client_optimized", params.get("model", float("nan")))),
    }


def local_gap_summary(rows: Sequence[RoundRecord | dict[str, Any]]) -> dict[str, float]:
    """Local-global gap (training loss on the received model minus after local training, mean over
    the round's clients): its mean over all rounds, over the second half, and at the last round."""
    gaps = [g for r in round_records(rows) if (g := r.local_gap) is not None and math.isfinite(g.gap)]
    if not gaps:
        return {}
    second = gaps[len(gaps) // 2 :]
    return {
        "mean": sum(g.gap for g in gaps) / len(gaps),
        "mean_second_half": sum(g.gap for g in second) / len(second),
        "last": gaps[-1].gap,
        "last_received": gaps[-1].received,
        "last_trained": gaps[-1].trained,
    }


def privacy_lines(privacy: dict[str, Any] | None) -> list[str]:
    """summary.md's lines on the guarantees spent (none without a privacy section)."""
    if not privacy:
        return []
    lines = [""]
    if privacy.get("private") is False:
        lines.append(f"**{privacy.get('not_private', 'NOT private')}**")
    if "dp_sgd" in privacy:
        d = privacy["dp_sgd"]
        prv = d.get("epsilon_max_prv")
        prv_text = f", {prv:.3g} (PRV)" if isinstance(prv, float) else ""
        lines.append(
            f"DP-SGD: epsilon {d['epsilon_max']:.3g} (RDP){prv_text}, largest over the clients, at delta {d['delta']:g}"
        )
    if "central" in privacy:
        c = privacy["central"]
        prv = c.get("epsilon_prv")
        prv_text = f", {prv:.3g} (PRV)" if isinstance(prv, float) else ""
        lines.append(f"central DP: epsilon {c['epsilon']:.3g} (RDP){prv_text} at delta {c['delta']:g}")
    return lines


def summary_markdown(summary: RunSummary | dict[str, Any]) -> str:
    typed = as_summary(summary)
    lines = [
        f"# {typed.name if typed.has('name') else 'run'}: {typed.algorithm} on {typed.dataset}",
        "",
        f"rounds completed: {typed.rounds_completed}",
        *(["", f"**warning: {typed.diverged}**"] if typed.diverged else []),
        *privacy_lines(typed.privacy),
        "",
        "| selection | round | metric | mean | weighted mean | std | worst 10% |",
        "|---|---|---|---|---|---|---|",
    ]
    for label in ("last", "best_val"):
        part = typed.selection(label)
        if part is not None:
            lines += selection_markdown(label, part)
    if typed.parameters:
        lines += ["", "| parameters | count |", "|---|---|"]
        lines += [f"| {k} | {v:,.0f} |" for k, v in typed.parameters.items()]
    if typed.parameter_budget is not None:
        lines += ["", "| parameter budget (float values) | count |", "|---|---|"]
        lines += [f"| {k} | {v:,.0f} |" for k, v in typed.parameter_budget.to_dict().items()]
    gap = typed.local_gap
    if gap is not None:
        lines += [
            "",
            f"local-global gap (train loss received - trained): mean {gap.mean:.4f}, "
            f"second half {gap.mean_second_half:.4f}, last {gap.last:.4f}",
        ]
    named = typed.last.by_client if typed.last is not None else None
    if named is not None:
        lines += named_clients_markdown(named, len(typed.client_names or named))
    # a method's lines (e.g. FedMerge's cluster recovery) read the summary's JSON object
    lines += ALGORITHMS.hooks(typed.algorithm).lines(summary if isinstance(summary, dict) else typed.to_dict())
    return "\n".join(lines) + "\n"


def selection_markdown(label: str, part: Selection) -> list[str]:
    """summary.md's rows of one selection (``last``, ``best_val``)."""

    def row(what: str, key: str, s: Stats) -> str:
        return (
            f"| {what} | {part.round} | {key} | {s.mean:.4f} | {s.weighted_mean:.4f} | {s.std:.4f} | {s.worst10:.4f} |"
        )

    clients, unseen = part.clients or {}, part.unseen or {}
    lines = [row(label, key, clients[key]) for key in HEADLINE if key in clients]
    lines += [row(f"{label} (clients that never trained)", key, unseen[key]) for key in HEADLINE if key in unseen]
    gap = (part.participation_gap or {}).get("test_acc")
    if gap is not None:
        lines.append(f"| {label} (participation gap: seen - unseen) | {part.round} | test_acc | {gap:.4f} | | | |")
    if part.pooled:
        lines.append(
            f"| {label} (global model, pooled test) | {part.round} | test_acc | {part.pooled['test_acc']:.4f} | | | |"
        )
    return lines
