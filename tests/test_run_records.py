"""The typed run records (fedmerge.run.run_records): a real run folder's summary.json and metrics.jsonl read and
written back byte for byte, files older than versioning read as version 1, newer ones refused in one line, a
method's own fields kept, and the readers converted to them giving the figures read straight from the JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import quick_config, run

from fedmerge.report.data import client_accuracies, learning_curve, loose_records
from fedmerge.report.plot_budget import budget_point
from fedmerge.run.results import METRICS_FILE, SUMMARY_FILE, RunStore
from fedmerge.run.run_records import (
    SCHEMA_VERSION,
    RoundRecord,
    RunSummary,
    read_summary,
    summary_or_none,
    write_summary,
)
from fedmerge.study.protocol import score_on_test, val_score
from fedmerge.study.spec import Metric


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("records") / "run"
    run(quick_config("rounds=3", "eval_every=1", output_dir=folder.parent), folder)
    return folder


def test_a_real_runs_summary_and_round_lines_are_written_back_byte_for_byte(run_dir, tmp_path):
    text = (run_dir / SUMMARY_FILE).read_text()
    summary = read_summary(run_dir / SUMMARY_FILE)
    write_summary(tmp_path / SUMMARY_FILE, summary)
    assert (tmp_path / SUMMARY_FILE).read_text() == text
    lines = (run_dir / METRICS_FILE).read_text().splitlines(keepends=True)
    assert len(lines) == 3
    assert [RoundRecord.from_json(line).to_json() + "\n" for line in lines] == lines
    # the typed fields hold what the JSON holds (read here without the module)
    raw = json.loads(text)
    assert summary.schema_version == 1 and raw.get("schema_version") is None
    assert summary.best_val.clients["test_acc"].mean == raw["best_val"]["clients"]["test_acc"]["mean"]
    assert summary.last.pooled == raw["last"]["global"]
    assert summary.parameter_budget.client_stored == raw["parameter_budget"]["client_stored"]
    assert summary.communication_per_client_per_round.up == raw["communication_per_client_per_round"]["up"]
    assert summary.client_groups is None and summary.has("client_groups")  # a null stays a null
    first = RoundRecord.from_json(lines[0])
    assert first.round == 1 and first.mean("val_nll") == json.loads(lines[0])["summary"]["val_nll"]["mean"]


def test_unknown_keys_are_kept_as_extras_and_written_back():
    data = {
        "algorithm": "fedmerge",
        "cluster_recovery": {"ari": 0.5, "purity": 1.0},  # a method's summary_extras
        "best_val": {"round": 2, "clients": {}, "global": None, "unseen_adapt2": {"test_acc": {"mean": 0.4}}},
    }
    summary = RunSummary.from_dict(data)
    assert summary.extras == {"cluster_recovery": {"ari": 0.5, "purity": 1.0}}
    assert list(summary.to_dict()) == ["algorithm", "cluster_recovery", "best_val"]  # the order read, in memory too
    assert list(summary.to_dict()["best_val"]) == ["round", "clients", "global", "unseen_adapt2"]
    assert summary.best_val.part("unseen_adapt2")["test_acc"].mean == 0.4
    assert summary.best_val.pooled is None
    assert summary.to_dict() == data
    row = {"round": 1, "merge_weights": [[0.5, 0.5]], "eval_unseen": {"clients": {"7": {"test_acc": 0.25}}}}
    record = RoundRecord.from_dict(row)
    assert record.extras["merge_weights"] == [[0.5, 0.5]]
    assert record.evaluation("eval_unseen").clients == {"7": {"test_acc": 0.25}}
    assert record.to_dict() == row


def test_round_rows_go_through_the_typed_record_on_their_way_to_disk(tmp_path):
    store = RunStore(tmp_path)
    store.append_metrics({"round": 1, "train_loss": 0.5, "lambda_line": [0.1]})
    assert (tmp_path / METRICS_FILE).read_text() == '{"lambda_line": [0.1], "round": 1, "train_loss": 0.5}\n'
    assert store.read_rounds()[0].train_loss == 0.5


def test_an_older_file_without_a_version_is_version_one_and_a_named_version_is_kept(tmp_path):
    path = tmp_path / SUMMARY_FILE
    path.write_text(json.dumps({"algorithm": "fedavg", "rounds_completed": 3}))
    old = read_summary(path)
    assert (old.schema_version, old.algorithm, old.rounds_completed) == (1, "fedavg", 3)
    named = RunSummary.from_json('{"schema_version": 1, "seed": 0}')
    assert named.schema_version == 1 and named.to_json() == json.dumps({"schema_version": 1, "seed": 0}, indent=1)


@pytest.mark.parametrize("version", [SCHEMA_VERSION + 1, 99])
def test_a_newer_layout_is_refused_in_one_line(tmp_path, version):
    (tmp_path / SUMMARY_FILE).write_text(json.dumps({"schema_version": version, "algorithm": "fedavg"}))
    for read in (read_summary, summary_or_none, lambda p: RunStore(p.parent).read_summary()):
        with pytest.raises(ValueError, match=f"schema_version {version} is newer than this fedmerge reads") as err:
            read(tmp_path / SUMMARY_FILE)
        assert "\n" not in str(err.value) and str(tmp_path) in str(err.value)
    with pytest.raises(ValueError, match="metrics.jsonl: schema_version"):
        RoundRecord.from_json(json.dumps({"schema_version": version, "round": 1}))
    with pytest.raises(ValueError, match="not a layout version"):
        RunSummary.from_dict({"schema_version": "two"})


def test_the_converted_readers_give_the_figures_in_the_json(run_dir):
    raw = json.loads((run_dir / SUMMARY_FILE).read_text())
    rows = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    curve = learning_curve(run_dir)
    assert curve["eval_rounds"] == [1, 2, 3]
    assert curve["test_acc"] == [r["summary"]["test_acc"]["mean"] for r in rows]
    assert curve["train_loss"] == [r["train_loss"] for r in rows]
    (record,) = loose_records([run_dir])
    best = next(r for r in rows if r["round"] == raw["best_val"]["round"])
    assert client_accuracies(record) == [m["test_acc"] for m in best["eval"]["clients"].values()]
    point = budget_point(run_dir)
    assert point["accuracy"] == raw["last"]["clients"]["test_acc"]["mean"]
    assert point["communicated"] == sum(raw["communication_per_client_per_round"].values())
    assert point["client"] == raw["parameter_budget"]["client_stored"]

    class Scored:  # the two fields of a study that the scores read
        metric, select = Metric(), "val_metric"

    assert score_on_test(Scored, raw) == raw["best_val"]["clients"]["test_acc"]["mean"]
    assert score_on_test(Scored, raw, "last") == raw["last"]["clients"]["test_acc"]["mean"]
    assert val_score(read_summary(run_dir / SUMMARY_FILE), Scored) == raw["best_val"]["clients"]["val_acc"]["mean"]
    Scored.metric = Metric(scope="global")
    assert score_on_test(Scored, raw) == raw["best_val"]["global"]["test_acc"]


def test_the_comparison_reads_each_selection_of_the_typed_summary():
    from fedmerge.report.compare import DONE, RunRecord, budget_of, compare

    def summary(best: float, last: float, unseen: float) -> dict:
        stats = {"mean": best, "worst10": best - 0.2}
        return {
            "best_val": {"clients": {"test_acc": stats}, "unseen": {"test_acc": {"mean": unseen}}},
            "last": {"clients": {"test_acc": {"mean": last, "worst10": 0.0}}},
            "parameter_budget": {"client_optimized": 7.0, "down_per_client_round": 2.0, "up_per_client_round": 3.0},
        }

    records = [
        RunRecord("a-0", "a", "s", 0, DONE, None, summary(0.8, 0.6, 0.5)),
        RunRecord("a-1", "a", "s", 1, DONE, None, summary(0.6, 0.4, 0.3)),
    ]
    (table,) = compare(records)
    (row,) = table.rows
    assert row.best_val.mean == pytest.approx(0.7) and row.last.mean == pytest.approx(0.5)
    assert row.worst10.mean == pytest.approx(0.5) and row.unseen.mean == pytest.approx(0.4)
    assert budget_of(records) == {"client_optimized": 7.0, "communicated": 5.0, "server_stored": None}


# every branch of summary.md; the text is what the dict-based writer before the typed records printed for it
FULL_SUMMARY = {
    "name": "x",
    "algorithm": "fedmerge",
    "dataset": "d",
    "rounds_completed": 3,
    "diverged": "diverged: boom",
    "privacy": {"private": False, "dp_sgd": {"epsilon_max": 1.5, "delta": 1e-5, "epsilon_max_prv": 1.25}},
    "parameters": {"model": 1234.0, "server_state": 99.0},
    "parameter_budget": {
        "server_stored": 1.0,
        "down_per_client_round": 2.0,
        "up_per_client_round": 3.0,
        "client_stored": 4.0,
        "client_optimized": 5.0,
    },
    "local_gap": {"mean": 0.1, "mean_second_half": 0.2, "last": 0.3, "last_received": 1.0, "last_trained": 0.7},
    "client_names": ["A", "B"],
    "cluster_recovery": {"round": 3, "ari": 0.5, "nmi": 0.25, "purity": 1.0, "groups": 2, "models_used": 2},
    "last": {
        "round": 3,
        "clients": {
            "test_acc": {"mean": 0.5, "weighted_mean": 0.6, "std": 0.1, "worst10": 0.2, "min": 0.1, "max": 0.9}
        },
        "global": {"test_acc": 0.55},
        "unseen": {"test_acc": {"mean": 0.4, "weighted_mean": 0.41, "std": 0.05, "worst10": 0.3, "min": 0, "max": 1}},
        "participation_gap": {"test_acc": 0.1},
        "by_client": [
            {"cid": 0, "name": "A", "test_acc": 0.5, "test_n": 10},
            {"cid": 1, "name": "B", "test_acc": 0.25, "test_n": 4},
        ],
    },
}


def test_summary_markdown_reads_the_typed_summary_and_prints_what_it_printed_before():
    from fedmerge.run.summary import summary_markdown

    expected = """\
# x: fedmerge on d

rounds completed: 3

**warning: diverged: boom**

**NOT private**
DP-SGD: epsilon 1.5 (RDP), 1.25 (PRV), largest over the clients, at delta 1e-05

| selection | round | metric | mean | weighted mean | std | worst 10% |
|---|---|---|---|---|---|---|
| last | 3 | test_acc | 0.5000 | 0.6000 | 0.1000 | 0.2000 |
| last (clients that never trained) | 3 | test_acc | 0.4000 | 0.4100 | 0.0500 | 0.3000 |
| last (participation gap: seen - unseen) | 3 | test_acc | 0.1000 | | | |
| last (global model, pooled test) | 3 | test_acc | 0.5500 | | | |

| parameters | count |
|---|---|
| model | 1,234 |
| server_state | 99 |

| parameter budget (float values) | count |
|---|---|
| server_stored | 1 |
| down_per_client_round | 2 |
| up_per_client_round | 3 |
| client_stored | 4 |
| client_optimized | 5 |

local-global gap (train loss received - trained): mean 0.1000, second half 0.2000, last 0.3000

clients (2, named by the data; last evaluation):

| cid | client | test_acc | test samples |
|---|---|---|---|
| 0 | A | 0.5000 | 10 |
| 1 | B | 0.2500 | 4 |

cluster recovery (ARI of argmax merge weight vs. true group) at round 3: 0.5000
"""
    assert summary_markdown(FULL_SUMMARY) == expected
    assert summary_markdown(RunSummary.from_dict(FULL_SUMMARY)) == expected
