"""A study's evidence (#37): the regime check reads validation only, each claim's 95% interval of the
paired difference and its verdict, the noise floor, and one tuning budget per row across revisions."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from fedmerge.config.schema import ConfigError
from fedmerge.core.training import LocalTraining
from fedmerge.data.federated import ClientData, FederatedDataset
from fedmerge.metrics.intervals import LEVEL, NOT_REPRODUCED, REPRODUCED, bootstrap_interval, paired_t_interval, verdict
from fedmerge.metrics.noise import mean_accuracy_standard_error
from fedmerge.study.evidence import judge, noise_floor, row_interval
from fedmerge.study.protocol import Conducted
from fedmerge.study.regime import TEST, VAL, central_reference
from fedmerge.study.report import _regime_checks, budget_history, budget_text, budget_total, report, results_json
from fedmerge.study.spec import Claim, Study, StudyFile, load_study_file, run_key

TINY = Path(__file__).resolve().parent / "data" / "study_tiny"


# --- intervals ---------------------------------------------------------------------------------


def test_the_paired_t_interval_is_the_hand_computed_one_and_scipys():
    mean, low, high = paired_t_interval([1.0, 2.0, 3.0])
    t = 0.95 / math.sqrt(2 * 0.975 * 0.025)  # t(0.975) with 2 df in closed form: (2p - 1) / sqrt(2p(1 - p))
    half = t * 1.0 / math.sqrt(3)  # x sd 1 / sqrt(3)
    assert (mean, low, high) == pytest.approx((2.0, 2.0 - half, 2.0 + half), abs=1e-12)
    a, b = np.array([0.71, 0.74, 0.69, 0.77, 0.72]), np.array([0.70, 0.70, 0.71, 0.73, 0.69])
    ci = stats.ttest_rel(a, b).confidence_interval(0.95)
    assert paired_t_interval(a - b)[1:] == pytest.approx((ci.low, ci.high), abs=1e-12)
    with pytest.raises(ValueError):
        paired_t_interval([0.1])


def test_the_bootstrap_over_clients_of_one_seed_is_the_exact_known_case():
    # two clients with differences 0 and 1: the resampled mean is 0, 0.5 or 1 with probabilities 1/4, 1/2,
    # 1/4, so the 2.5% and 97.5% points are 0 and 1
    assert bootstrap_interval([[0.0, 1.0]], seed=3) == (0.5, 0.0, 1.0)
    assert bootstrap_interval([[0.02] * 7, [0.02] * 9]) == pytest.approx((0.02, 0.02, 0.02))  # nothing varies


def test_the_bootstrap_keeps_the_seed_to_seed_spread():
    # no spread within a seed, all of it between seeds: resampling clients alone would give [0.5, 0.5]
    assert bootstrap_interval([[0.0] * 20, [1.0] * 20]) == (0.5, 0.0, 1.0)


def test_the_bootstrap_of_many_clients_is_the_normal_interval_and_is_seeded():
    values = np.random.default_rng(1).normal(0.03, 0.1, size=400)
    estimate, low, high = bootstrap_interval([values], seed=0)
    half = 1.96 * values.std(ddof=1) / math.sqrt(len(values))
    assert estimate == pytest.approx(values.mean())
    assert low == pytest.approx(values.mean() - half, abs=0.1 * half)
    assert high == pytest.approx(values.mean() + half, abs=0.1 * half)
    assert bootstrap_interval([values], seed=0) == (estimate, low, high)
    assert bootstrap_interval([values], seed=1) != (estimate, low, high)


def test_the_bootstrap_resamples_the_clients_afresh_for_every_draw_of_a_seed():
    """Seeds whose clients hold the same values: the seed level adds nothing, so each resample's statistic is
    the mean of k * n independent draws from those values, and the interval is, by the central limit theorem,
    mean +- 1.96 sd / sqrt(k n) (sd with ddof 0). A seed drawn twice in a resample must get two independent
    client resamples: one resample shared by its copies would widen the interval by sqrt((2k - 1) / k)."""
    values = np.random.default_rng(4).normal(0.0, 1.0, size=100)
    k = 3
    estimate, low, high = bootstrap_interval([values] * k, seed=0)
    half = 1.96 * values.std() / math.sqrt(k * len(values))
    assert estimate == pytest.approx(values.mean())
    assert low == pytest.approx(values.mean() - half, abs=0.08 * half)
    assert high == pytest.approx(values.mean() + half, abs=0.08 * half)


def reference_bootstrap(groups: list[np.ndarray], resamples: int, seed: int) -> tuple[float, float]:
    """The two-level bootstrap written as its definition, one resample at a time: draw k seeds with
    replacement, then for each drawn seed its clients with replacement; the mean of the seeds' means."""
    rng = np.random.default_rng(seed)
    stats = []
    for _ in range(resamples):
        places = rng.integers(0, len(groups), size=len(groups))
        stats.append(np.mean([rng.choice(groups[s], size=len(groups[s])).mean() for s in places]))
    low, high = np.quantile(stats, [0.025, 0.975])
    return float(low), float(high)


def test_the_bootstrap_agrees_with_a_resample_by_resample_reference():
    rng = np.random.default_rng(5)
    groups = [rng.normal(mu, sd, size=n) for mu, sd, n in ((0.02, 0.1, 30), (0.05, 0.2, 45), (0.0, 0.15, 25),
                                                           (0.03, 0.1, 60))]  # fmt: skip
    _, low, high = bootstrap_interval(groups, seed=0)
    ref_low, ref_high = reference_bootstrap(groups, 20_000, seed=1)
    width = ref_high - ref_low
    assert low == pytest.approx(ref_low, abs=0.05 * width) and high == pytest.approx(ref_high, abs=0.05 * width)


@pytest.mark.parametrize(
    "low, high, word",
    [
        (1e-9, 2.0, REPRODUCED),
        (0.0, 2.0, LEVEL),  # an end at zero: the interval contains it
        (-1.0, 1.0, LEVEL),
        (-2.0, 0.0, LEVEL),
        (-2.0, -1e-9, NOT_REPRODUCED),
    ],
)
def test_the_verdict_words_at_their_boundaries(low, high, word):
    assert verdict(low, high) == word


# --- run folders for a study -------------------------------------------------------------------


def write_run(
    runs: Path, key: str, test: list[float], val: list[float] | None = None, test_n: int = 50, with_metrics=True
) -> None:
    """A finished run whose clients have test (and validation) accuracies ``test`` (``val``) at round 2,
    the best-validation round."""
    folder = runs / key / f"{key}-20260101-000000"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("name: x\n")
    val = val if val is not None else test
    clients = {
        str(c): {"test_acc": t, "test_n": float(test_n), "val_acc": v, "val_n": 8.0}
        for c, (t, v) in enumerate(zip(test, val))
    }
    if with_metrics:
        rows = [{"round": r, "eval": {"clients": clients if r == 2 else {}}} for r in (1, 2, 3)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    part = {"clients": {"test_acc": {"mean": float(np.mean(test))}, "val_acc": {"mean": float(np.mean(val))}}}
    summary = {"best_val": {**part, "round": 2}, "last": {**part, "round": 3}}
    (folder / "summary.json").write_text(json.dumps(summary))


def two_row_study(seeds: list[int], claims: list[Claim] | None = None) -> Study:
    return Study(
        title="t",
        base="base.yaml",
        seeds=seeds,
        methods=[
            {"label": "Local", "grid": {"algorithm.lr": [0.1]}},
            {"label": "FedAvg", "grid": {"algorithm.lr": [0.1]}},
        ],
        claims=claims or [Claim(higher="FedAvg", lower="Local")],
    )


CHOSEN = {"Local": 0, "FedAvg": 0}


def test_a_claim_on_several_seeds_is_judged_by_the_paired_t_with_the_bootstrap_as_its_detail(tmp_path):
    """The rule (docs/guide/studies.md): a paired t over the seeds' differences decides; the two-level
    bootstrap of the per-client differences is shown beside it and decides nothing."""
    rng = np.random.default_rng(0)
    per_client, local_means, fedavg_means = [], [], []
    for seed in (0, 1, 2):
        local = rng.uniform(0.4, 0.6, size=12)
        fedavg = local + rng.normal(0.05, 0.02, size=12)
        write_run(tmp_path, run_key("Local", 0, seed), list(local))
        write_run(tmp_path, run_key("FedAvg", 0, seed), list(fedavg))
        per_client.append(list(fedavg - local))
        local_means.append(local.mean())
        fedavg_means.append(fedavg.mean())
    got = judge(two_row_study([0, 1, 2]), tmp_path, CHOSEN, Claim(higher="FedAvg", lower="Local"))
    ci = stats.ttest_rel(fedavg_means, local_means).confidence_interval(0.95)  # scipy's, not ours
    assert got["method"] == "paired t" and got["why"] == "3 seeds x 12 clients"
    assert (got["low"], got["high"]) == pytest.approx((100 * ci.low, 100 * ci.high), abs=1e-9)
    assert got["difference"] == pytest.approx(100 * (np.mean(fedavg_means) - np.mean(local_means)), abs=1e-9)
    _, b_low, b_high = bootstrap_interval(per_client)
    assert (got["bootstrap_low"], got["bootstrap_high"]) == pytest.approx((100 * b_low, 100 * b_high))
    assert got["high"] - got["low"] > got["bootstrap_high"] - got["bootstrap_low"]  # 3 seeds: the t is wider
    assert got["verdict"] == REPRODUCED and got["low"] > 0
    flipped = judge(two_row_study([0, 1, 2]), tmp_path, CHOSEN, Claim(higher="Local", lower="FedAvg"))
    assert flipped["verdict"] == NOT_REPRODUCED and flipped["high"] == pytest.approx(-got["low"])


def test_the_verdict_follows_the_t_where_the_bootstrap_alone_would_call_it_reproduced(tmp_path):
    """Per-seed differences of 4.0, -1.0, 4.5, 3.5 and 0.5 points, the same for all 40 clients of a seed: the
    bootstrap (seeds drawn with the plug-in spread and no t correction) lies above zero, the t over the 5
    seeds (hand-computed) contains it, and the verdict is level."""
    diffs = [0.040, -0.010, 0.045, 0.035, 0.005]
    for seed, d in enumerate(diffs):
        base = [0.5 + 0.001 * (c % 5) for c in range(40)]
        write_run(tmp_path, run_key("Local", 0, seed), base, test_n=150)
        write_run(tmp_path, run_key("FedAvg", 0, seed), [b + d for b in base], test_n=150)
    got = judge(two_row_study([0, 1, 2, 3, 4]), tmp_path, CHOSEN, Claim(higher="FedAvg", lower="Local"))
    mean = sum(diffs) / 5  # 0.023
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 4)
    half = 2.7764451052 * sd / math.sqrt(5)  # t(0.975, 4 df), from tables
    assert (got["difference"], got["low"], got["high"]) == pytest.approx(
        (100 * mean, 100 * (mean - half), 100 * (mean + half)), abs=1e-9
    )
    assert got["low"] < 0 < got["bootstrap_low"]  # the bootstrap alone would have said reproduced
    assert got["verdict"] == LEVEL


def test_on_one_seed_a_claim_is_judged_by_the_bootstrap_over_its_clients_and_says_it_lacks_the_seed_spread(
    tmp_path,
):
    write_run(tmp_path, run_key("Local", 0, 0), [0.5] * 10)
    write_run(tmp_path, run_key("FedAvg", 0, 0), [0.5] * 5 + [0.6] * 5)
    got = judge(two_row_study([0]), tmp_path, CHOSEN, Claim(higher="FedAvg", lower="Local"))
    assert got["method"] == "bootstrap over clients" and "no seed-to-seed spread" in got["why"]
    # differences 0 and 0.1, five each: the resampled mean is 0.1 * Binomial(10, 1/2) / 10, whose 2.5% and
    # 97.5% points are 0.02 and 0.08 (P(X <= 1) = 11/1024 < 0.025 < P(X <= 2) = 56/1024)
    assert (got["difference"], got["low"], got["high"]) == pytest.approx((5.0, 2.0, 8.0), abs=1e-9)
    assert "bootstrap_low" not in got and got["verdict"] == REPRODUCED


def test_a_rows_interval_is_students_t_over_its_seeds_means():
    # values 0.5, 0.6, 0.7: mean 0.6, sd 0.1; t(0.975, 2 df) = 0.95 / sqrt(2 * 0.975 * 0.025) in closed form
    half = 0.95 / math.sqrt(2 * 0.975 * 0.025) * 0.1 / math.sqrt(3)
    assert row_interval([0.5, 0.6, 0.7]) == pytest.approx((0.6 - half, 0.6 + half), abs=1e-12)
    assert row_interval([0.5]) is None
    assert row_interval([0.5, float("nan"), 0.6, 0.7]) == pytest.approx((0.6 - half, 0.6 + half), abs=1e-12)


def test_a_claim_on_newcomers_is_judged_by_the_newcomers_own_per_client_differences(tmp_path):
    rng = np.random.default_rng(1)
    for seed in (0, 1, 2):
        for label, shift in (("Local", 0.0), ("FedAvg", 0.1)):
            participants = list(rng.uniform(0.4, 0.6, size=12))  # FedAvg's participants are no better
            write_run(tmp_path, run_key(label, 0, seed), participants)
            folder = next((tmp_path / run_key(label, 0, seed)).iterdir())
            newcomers = 0.3 + shift + np.arange(10) / 100
            clients = {str(12 + c): {"test_acc": float(a), "test_n": 100.0} for c, a in enumerate(newcomers)}
            rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
            rows[1]["eval_unseen"] = {"clients": clients}
            (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            summary = json.loads((folder / "summary.json").read_text())
            summary["best_val"]["unseen"] = {"test_acc": {"mean": float(newcomers.mean())}}
            (folder / "summary.json").write_text(json.dumps(summary))
    study = two_row_study([0, 1, 2])
    study = study.model_copy(update={"metric": study.metric.model_copy(update={"scope": "unseen"})})
    got = judge(study, tmp_path, CHOSEN, Claim(higher="FedAvg", lower="Local"))
    assert got["method"] == "paired t" and got["why"] == "3 seeds x 10 clients"
    assert (got["difference"], got["low"], got["high"]) == pytest.approx((10.0, 10.0, 10.0))
    assert (got["bootstrap_low"], got["bootstrap_high"]) == pytest.approx((10.0, 10.0))
    assert got["per_seed"] == pytest.approx([10.0] * 3) and got["verdict"] == REPRODUCED


def test_a_claim_with_few_clients_is_judged_by_a_paired_t_over_seeds(tmp_path):
    means = {0: (0.50, 0.52), 1: (0.60, 0.59), 2: (0.55, 0.58)}  # (Local, FedAvg) per seed, 3 clients each
    for seed, (local, fedavg) in means.items():
        write_run(tmp_path, run_key("Local", 0, seed), [local - 0.1, local, local + 0.1])
        write_run(tmp_path, run_key("FedAvg", 0, seed), [fedavg - 0.1, fedavg, fedavg + 0.1])
    got = judge(two_row_study([0, 1, 2]), tmp_path, CHOSEN, Claim(higher="FedAvg", lower="Local"))
    ci = stats.ttest_rel([f for _, f in means.values()], [lo for lo, _ in means.values()]).confidence_interval()
    assert got["method"] == "paired t" and got["why"] == "3 seeds x 3 clients"
    assert "bootstrap_low" not in got  # too few clients for the detail
    assert (got["low"], got["high"]) == pytest.approx((100 * ci.low, 100 * ci.high))
    assert got["per_seed"] == pytest.approx([2.0, -1.0, 3.0])
    assert got["verdict"] == LEVEL


def test_without_per_client_metrics_a_claim_falls_back_to_the_paired_t(tmp_path):
    for seed, shift in ((0, 0.1), (1, 0.12)):
        write_run(tmp_path, run_key("Local", 0, seed), [0.5] * 20, with_metrics=False)
        write_run(tmp_path, run_key("FedAvg", 0, seed), [0.5 + shift] * 20, with_metrics=False)
    got = judge(two_row_study([0, 1]), tmp_path, CHOSEN, Claim(higher="FedAvg", lower="Local"))
    assert got["method"] == "paired t" and "no per-client metrics" in got["why"]
    one = judge(two_row_study([0]), tmp_path, CHOSEN, Claim(higher="FedAvg", lower="Local"))
    assert one["verdict"] is None and one["method"] is None


def test_the_noise_floor_is_the_binomial_standard_error_at_the_rows_test_sizes(tmp_path):
    for seed in (0, 1):
        write_run(tmp_path, run_key("Local", 0, seed), [0.6, 0.8] * 10, test_n=150)  # mean 0.7
    got = noise_floor(two_row_study([0, 1]), tmp_path, "Local", 0)
    assert got == pytest.approx(math.sqrt(20 * 0.7 * 0.3 / 150) / 20)
    assert got == pytest.approx(mean_accuracy_standard_error([150] * 20, 0.7))


# --- the regime check reads validation -----------------------------------------------------------


def regime_reference(val: bool) -> dict:
    ref = {"scope": "group", "mean": 0.95, "mean_prior": 0.96, "client_acc": [0.95]}
    return {**ref, "val_mean": 0.90, "val_mean_prior": 0.91} if val else ref


def conducted(tmp_path: Path, reference: dict, seeds=(0,)) -> Conducted:
    study = two_row_study(list(seeds))
    for seed in seeds:  # test accuracies 0.50 / 0.80, validation 0.70 / 0.78
        write_run(tmp_path, run_key("Local", 0, seed), [0.5] * 4, val=[0.7] * 4)
        write_run(tmp_path, run_key("FedAvg", 0, seed), [0.8] * 4, val=[0.78] * 4)
    return Conducted(study, [study], tmp_path, CHOSEN, {s: reference for s in seeds})


def test_the_regime_check_reads_validation_accuracies_only(tmp_path):
    (check,) = _regime_checks(conducted(tmp_path, regime_reference(val=True)))
    assert check["split"] == VAL
    assert (check["reference"], check["local"], check["fedavg"]) == pytest.approx((0.90, 0.70, 0.78))
    assert check["local_gap"] == pytest.approx(20.0) and check["fedavg_gap"] == pytest.approx(12.0)
    assert check["passes"]  # on test (0.95 vs 0.50 / 0.80) FedAvg's gap would be 15, Local's 45: other numbers


def test_a_reference_stored_without_validation_is_read_on_test_and_the_report_says_so(tmp_path):
    done = conducted(tmp_path, regime_reference(val=False))
    (check,) = _regime_checks(done)
    assert check["split"] == TEST
    assert (check["reference"], check["local"], check["fedavg"]) == pytest.approx((0.95, 0.50, 0.80))
    assert "**The check read the test split** on seeds [0]" in report(done)
    assert results_json(done)["regime"][0]["split"] == TEST


def test_verdicts_are_provisional_where_the_regime_is_kept_on_fewer_than_three_seeds(tmp_path):
    """Verdicts count as evidence only where both bars are met on at least 3 seeds (docs/guide/studies.md):
    seed 1's reference is 0.85 on validation, FedAvg (0.78) within 10 points of it, so 2 of 3 seeds keep it;
    with 5 seeds, 4 keep it and the verdicts count."""
    study = two_row_study([0, 1, 2])
    for seed in (0, 1, 2):
        write_run(tmp_path, run_key("Local", 0, seed), [0.5] * 4, val=[0.7] * 4)
        write_run(tmp_path, run_key("FedAvg", 0, seed), [0.8] * 4, val=[0.78] * 4)
    references = {s: regime_reference(val=True) for s in (0, 2)}
    references[1] = {**regime_reference(val=True), "val_mean": 0.85}
    text = report(Conducted(study, [study], tmp_path, CHOSEN, references))
    (row,) = [line for line in text.splitlines() if line.startswith("| - | FedAvg > Local")]
    assert row.endswith("| **reproduced** (provisional) |"), row
    assert "Every verdict is **provisional**: the regime is kept on 2 of 3 seeds" in text
    kept = report(Conducted(study, [study], tmp_path, CHOSEN, {s: regime_reference(val=True) for s in (0, 1, 2)}))
    assert "| **reproduced** |" in kept and "(provisional)" not in kept and "**provisional**" not in kept
    study5 = two_row_study([0, 1, 2, 3, 4])
    for seed in (3, 4):
        write_run(tmp_path, run_key("Local", 0, seed), [0.5] * 4, val=[0.7] * 4)
        write_run(tmp_path, run_key("FedAvg", 0, seed), [0.8] * 4, val=[0.78] * 4)
    four = report(Conducted(study5, [study5], tmp_path, CHOSEN, {**references, 3: references[0], 4: references[0]}))
    assert "4 of 5 seeds" in four and "| **reproduced** |" in four
    assert "(provisional)" not in four and "**provisional**" not in four


def test_the_central_reference_scores_each_clients_validation_split():
    gen = torch.Generator().manual_seed(0)
    clients = []
    for cid in range(2):
        x = [torch.randn(80, 2, generator=gen) for _ in range(3)]
        y = [(xi[:, 0] > 0).long() for xi in x]
        y[1] = 1 - y[1] if cid == 1 else y[1]  # client 1's validation labels are the opposite rule
        clients.append(ClientData(cid, x[0], y[0], x[1], y[1], x[2], y[2], group=0))
    data = FederatedDataset(clients, 2, (2,), "synthetic")
    ref = central_reference(data, {"name": "mlp", "hidden": []}, LocalTraining(lr=0.5), seed=0, max_epochs=5)
    assert min(ref.client_acc) > 0.9  # both clients' test splits follow the training rule
    assert ref.client_val_acc[0] > 0.9 and ref.client_val_acc[1] < 0.1
    js = ref.to_json()
    assert js["val_mean"] == pytest.approx(sum(ref.client_val_acc) / 2)
    assert js["val_mean"] != pytest.approx(js["mean"])


# --- claims in the study file; budgets ---------------------------------------------------------


def test_a_claim_naming_no_row_is_refused():
    with pytest.raises(ValueError, match="no row 'FedMerge'"):
        two_row_study([0], [Claim(higher="FedMerge", lower="Local")])


def test_a_confirmation_counts_the_budgets_its_exploration_spent_in_every_revision(tmp_path, monkeypatch):
    for name in ("base.yaml", "study_tiny.yaml"):
        shutil.copy(TINY / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    explored = load_study_file(Path("study_tiny.yaml")).at("wide")
    spec = StudyFile(
        **{
            **explored.model_dump(exclude={"revision", "tune_seed"}),
            "seeds": [100, 101],
            "explored_on": [0, 1],
            "confirms": "study_tiny.yaml revision wide",
            "methods": [
                {**m.model_dump(), "grid": {"algorithm.lr": [0.2]}, "extra_points": []} for m in explored.methods
            ],
        }
    )
    confirm = spec.at()
    done = Conducted(confirm, [confirm], tmp_path / "runs", {"Local": 0, "FedAvg": 0}, {})
    history, note = budget_history(done)
    assert note is None and budget_total(history) == {"Local": 2, "FedAvg": 3}  # not its own 1 and 1
    assert budget_total([confirm]) == {"Local": 1, "FedAvg": 1}
    gone = Conducted(confirm.model_copy(update={"confirms": "missing.yaml"}), [confirm], tmp_path, {}, {})
    assert "could not be read" in budget_history(gone)[1]
    text = budget_text({"Local": 2, "FedAvg": 3}, None, confirmation=True)
    assert "Local 2, FedAvg 3" in text and "from 2 to 3 settings (1.5x)" in text
    assert (
        budget_text({"Local": 4, "FedAvg": 4}, None, False)
        == "every row tried 4 settings over all its revisions: equal budgets."
    )


def test_a_missing_exploration_is_a_config_error(tmp_path, monkeypatch):
    from fedmerge.study.spec import explored_history

    monkeypatch.chdir(tmp_path)
    study = two_row_study([5]).model_copy(update={"confirms": "nowhere.yaml revision wide"})
    with pytest.raises(ConfigError):
        explored_history(study)


def test_a_stored_reference_without_validation_is_computed_again_unless_report_only(tmp_path, monkeypatch):
    from fedmerge.run.data_plan import DataPlan
    from fedmerge.study import protocol
    from fedmerge.study.regime import CentralReference

    shutil.copy(TINY / "base.yaml", tmp_path / "base.yaml")
    monkeypatch.chdir(tmp_path)
    fresh = CentralReference("all", [2], [0.1], [0.9], [0.9], [0.8], [0.85])
    calls = []
    monkeypatch.setattr(protocol, "plan_data", lambda cfg: DataPlan(cfg, torch.device("cpu"), None))
    monkeypatch.setattr(protocol, "central_reference", lambda *a, **k: calls.append(a[3]) or fresh)
    runs = tmp_path / "runs"
    runs.mkdir()
    old = json.dumps(regime_reference(val=False))
    (runs / "regime-seed0.json").write_text(old)
    study = two_row_study([0])
    assert protocol.regime(study, runs, report_only=True)[0] == json.loads(old) and calls == []  # read as it is
    notices = []
    assert protocol.regime(study, runs, notify=notices.append)[0]["val_mean"] == pytest.approx(0.8) and calls == [0]
    assert notices[0].startswith("1 central references to compute (") and len(notices) == 2
    assert notices[1].startswith("[1/1] central reference, seed 0: done")  # minutes each: progress is shown
    assert (runs / "regime-seed0.test-only.json").read_text() == old  # nothing lost
    protocol.regime(study, runs, notify=notices.append)
    assert calls == [0] and len(notices) == 2  # a reference with validation accuracies is read, not computed again
