"""How far a study's numbers can be trusted: each row's noise floor and each declared claim's interval.

* Noise floor: the standard error of a row's mean from its clients' test sizes alone
  (``fedmerge.metrics.mean_accuracy_standard_error``), per seed, averaged over seeds.
* A claim ``higher > lower`` (``claims:`` in the study file) is judged on the paired difference of the
  two rows at their chosen points, on the seeds both finished. Where every seed's run folders hold
  per-client metrics and a seed has at least ``MIN_BOOTSTRAP_CLIENTS`` clients, a two-level bootstrap
  over seeds and the clients within them; otherwise a paired t over the seeds' means (clients too few
  to resample, or no per-client metrics, or the server model's metric). The verdict is
  ``fedmerge.metrics.intervals.verdict`` of that interval.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from fedmerge.metrics.intervals import bootstrap_interval, paired_t_interval, verdict
from fedmerge.metrics.noise import mean_accuracy_standard_error
from fedmerge.run.run_records import as_summary
from fedmerge.study.protocol import client_scores, score_on_test, summary_of
from fedmerge.study.spec import Claim, Study, run_key

MIN_BOOTSTRAP_CLIENTS = 10  # fewer clients per seed: a paired t over seeds
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0  # the report is a function of the run folders: the resampling is seeded
BINOMIAL_METRICS = {"acc", "top5"}  # a per-client value that is a proportion of test samples


def noise_floor(study: Study, runs: Path, label: str, point: int) -> float | None:
    """The standard error (a fraction) of the row's mean from test sampling alone, mean over its seeds;
    None where the metric is not a proportion or no run folder holds the clients' test sizes."""
    if study.metric.name not in BINOMIAL_METRICS:
        return None
    errors = []
    for seed in study.seeds:
        key = run_key(label, point, seed)
        summary = summary_of(runs, key)
        if summary is None:
            continue
        accuracy = min(max(score_on_test(study, summary), 0.0), 1.0)
        best = as_summary(summary).best_val
        pooled = ((best.pooled if best is not None else None) or {}).get("test_n")
        if study.metric.scope == "global" and pooled:
            errors.append(mean_accuracy_standard_error([int(pooled)], accuracy, "samples"))
            continue
        clients = client_scores(runs, key, study)
        if clients:
            errors.append(mean_accuracy_standard_error([n for _, n in clients.values()], accuracy))
    return statistics.mean(errors) if errors else None


def judge(study: Study, runs: Path, chosen: dict[str, int], claim: Claim) -> dict[str, Any]:
    """The claim's paired difference (in points), its 95% interval, the method and why, and the verdict."""
    keys = {label: [run_key(label, chosen[label], s) for s in study.seeds] for label in (claim.higher, claim.lower)}
    seeds, diffs, per_client = [], [], []
    for i, seed in enumerate(study.seeds):
        high, low = (summary_of(runs, keys[label][i]) for label in (claim.higher, claim.lower))
        if high is None or low is None:
            continue
        seeds.append(seed)
        diffs.append(score_on_test(study, high) - score_on_test(study, low))
        a, b = (client_scores(runs, keys[label][i], study) for label in (claim.higher, claim.lower))
        per_client.append([a[c][0] - b[c][0] for c in sorted(a, key=_client_order) if c in b] if a and b else [])
    out: dict[str, Any] = {**claim.model_dump(), "seeds": seeds}
    if not seeds:
        return {**out, "method": None, "why": "no seed on which both rows finished", "verdict": None}
    few, n = min(len(d) for d in per_client), len(seeds)
    per_client_metric = study.metric.scope in ("clients", "unseen")  # the participants' or the newcomers'
    if per_client_metric and few >= MIN_BOOTSTRAP_CLIENTS:
        estimate, low, high = bootstrap_interval(per_client, resamples=BOOTSTRAP_RESAMPLES, seed=BOOTSTRAP_SEED)
        method = "bootstrap"
        many = few if all(len(d) == few for d in per_client) else f"{few}+"
        why = f"{n} seeds x {many} clients"
    elif n >= 2:
        estimate, low, high = paired_t_interval(diffs)
        method = "paired t"
        if not per_client_metric:
            why = f"{n} seeds; the server model's metric"
        elif few == 0:
            why = f"{n} seeds; no per-client metrics in the run folders"
        else:
            why = f"{n} seeds; {few} clients in a seed, too few to resample"
    else:
        return {**out, "method": None, "why": "one seed, too few clients to resample", "verdict": None}
    scale = 100.0  # points
    return {
        **out,
        "difference": scale * estimate,
        "low": scale * low,
        "high": scale * high,
        "per_seed": [scale * d for d in diffs],
        "method": method,
        "why": why,
        "verdict": verdict(low, high),
    }


def _client_order(cid: str) -> tuple[int, str]:
    """Client ids in numeric order ("2" before "10"): the bootstrap's draws are tied to positions."""
    return len(cid), cid
