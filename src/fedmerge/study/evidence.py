"""How far a study's numbers can be trusted: each row's interval and noise floor, each declared claim's
interval, and the per-client values a reader needs to recompute them (docs/guide/studies.md, "The interval
rule").

The rule, one for every claim and row:

* A row's mean: 95% Student's t interval over the seeds' means (``row_interval``). The seed is the unit
  that is repeated (partition, initial weights, training randomness, the test clients drawn); each
  seed's mean already carries its clients' test-sampling noise, so this interval holds both.
* A claim ``higher > lower`` (``claims:`` in the study file), on two or more seeds: 95% paired t over the
  seeds' differences of the two rows' means, at their chosen points, on the seeds both finished. Its
  verdict is ``fedmerge.metrics.intervals.verdict`` of that interval.
* The two-level bootstrap (seeds, then clients within each drawn seed) is kept as a detail where every
  seed has at least ``MIN_BOOTSTRAP_CLIENTS`` per-client values; it never decides a verdict. With 5
  seeds it is too narrow: its percentile interval uses the plug-in variance of the seeds ((n-1)/n of
  the unbiased one) and normal rather than t(n-1) quantiles, so it reads about 0.63x the t's width
  where the seed spread dominates (the published tables: median 0.74x), and a nominal 95% bootstrap
  covered the true difference in about 90% of simulated 5-seed tables (the t: 95%).
* On one seed there is no seed spread to measure: the claim is judged by the bootstrap over that
  seed's clients where it has at least ``MIN_BOOTSTRAP_CLIENTS`` of them (said in the report: the
  interval leaves the seed-to-seed spread out), and otherwise gets no verdict.
* Noise floor: the standard error of a row's mean from its clients' test sizes alone
  (``fedmerge.metrics.mean_accuracy_standard_error``), per seed, averaged over seeds: one seed's
  test-sampling error, shown beside the row's interval for scale, never used as its uncertainty.
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

MIN_BOOTSTRAP_CLIENTS = 10  # fewer clients in a seed: no bootstrap (the detail; on one seed, the verdict)
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


def row_interval(values: list[float]) -> tuple[float, float] | None:
    """The 95% interval of a row's mean over its seeds' values: Student's t with n - 1 degrees of freedom
    (the seed-to-seed spread included); None on fewer than 2 seeds with a value (NaN: none)."""
    values = [v for v in values if v == v]
    if len(values) < 2:
        return None
    _, low, high = paired_t_interval(values)
    return low, high


def per_client_differences(high: dict[str, tuple[float, int]], low: dict[str, tuple[float, int]]) -> list[float]:
    """One seed's per-client differences ``high - low`` over the clients both rows scored, in client order
    (the bootstrap's draws are tied to positions, so a reader must keep this order)."""
    return [high[c][0] - low[c][0] for c in sorted(high, key=client_order) if c in low]


def judge(study: Study, runs: Path, chosen: dict[str, int], claim: Claim) -> dict[str, Any]:
    """The claim's paired difference (in points), its 95% interval by the rule above, the method and why, the
    verdict, and the two-level bootstrap as a detail where there are clients enough."""
    keys = {label: [run_key(label, chosen[label], s) for s in study.seeds] for label in (claim.higher, claim.lower)}
    seeds, diffs, per_client = [], [], []
    for i, seed in enumerate(study.seeds):
        high, low = (summary_of(runs, keys[label][i]) for label in (claim.higher, claim.lower))
        if high is None or low is None:
            continue
        seeds.append(seed)
        diffs.append(score_on_test(study, high) - score_on_test(study, low))
        a, b = (client_scores(runs, keys[label][i], study) for label in (claim.higher, claim.lower))
        per_client.append(per_client_differences(a, b) if a and b else [])
    out: dict[str, Any] = {**claim.model_dump(), "seeds": seeds}
    if not seeds:
        return {**out, "method": None, "why": "no seed on which both rows finished", "verdict": None}
    few, n = min(len(d) for d in per_client), len(seeds)
    per_client_metric = study.metric.scope in ("clients", "unseen")  # the participants' or the newcomers'
    resampled = per_client_metric and few >= MIN_BOOTSTRAP_CLIENTS
    many = few if all(len(d) == few for d in per_client) else f"{few}+"
    scale = 100.0  # points
    detail: dict[str, Any] = {}
    if resampled:
        _, b_low, b_high = bootstrap_interval(per_client, resamples=BOOTSTRAP_RESAMPLES, seed=BOOTSTRAP_SEED)
        detail = {"bootstrap_low": scale * b_low, "bootstrap_high": scale * b_high}
    if n >= 2:
        estimate, low, high = paired_t_interval(diffs)
        method = "paired t"
        why = f"{n} seeds" + (f" x {many} clients" if few else "")
        if not per_client_metric:
            why += "; the server model's metric"
        elif few == 0:
            why += "; no per-client metrics in the run folders"
    elif resampled:
        estimate, low, high = bootstrap_interval(per_client, resamples=BOOTSTRAP_RESAMPLES, seed=BOOTSTRAP_SEED)
        method = "bootstrap over clients"
        why = f"one seed x {many} clients: no seed-to-seed spread in it"
        detail = {}
    else:
        return {**out, "method": None, "why": "one seed, too few clients to resample", "verdict": None}
    return {
        **out,
        "difference": scale * estimate,
        "low": scale * low,
        "high": scale * high,
        "per_seed": [scale * d for d in diffs],
        "method": method,
        "why": why,
        "verdict": verdict(low, high),
        **detail,
    }


def client_order(cid: str) -> tuple[int, str]:
    """Client ids in numeric order ("2" before "10"): the bootstrap's draws are tied to positions."""
    return len(cid), cid


CLIENT_DECIMALS = 6  # per-client values as published: the file stays small and every interval moves < 1e-4 points


def client_values(study: Study, runs: Path, chosen: dict[str, int]) -> dict[str, Any]:
    """What a reader needs to recompute every row interval and claim of the report without the run folders
    (``fedmerge.study.recompute``): per row and finished seed, each client's test value at the best-validation
    round (rounded to ``CLIENT_DECIMALS``), its test size and id, in client order; where a seed holds no
    per-client values (or the metric is the server model's), the seed's value itself."""
    per_client_metric = study.metric.scope in ("clients", "unseen")
    rows: dict[str, dict[str, Any]] = {}
    for m in study.methods:
        seeds: dict[str, Any] = {}
        for seed in study.seeds:
            key = run_key(m.label, chosen[m.label], seed)
            summary = summary_of(runs, key)
            if summary is None:
                continue
            clients = client_scores(runs, key, study) if per_client_metric else None
            if clients:
                ids = sorted(clients, key=client_order)
                seeds[str(seed)] = {
                    "clients": ids,
                    "values": [round(clients[c][0], CLIENT_DECIMALS) for c in ids],
                    "test_n": [clients[c][1] for c in ids],
                }
            else:
                seeds[str(seed)] = {"value": score_on_test(study, summary)}
        rows[m.label] = seeds
    return {
        "metric": {"scope": study.metric.scope, "name": study.metric.name, "round": "best_val"},
        "decimals": CLIENT_DECIMALS,
        "bootstrap": {
            "resamples": BOOTSTRAP_RESAMPLES,
            "seed": BOOTSTRAP_SEED,
            "min_clients": MIN_BOOTSTRAP_CLIENTS,
        },
        "rows": rows,
    }
