"""What a FedMerge user sees: the merge-weight plot, parameter accounting, the local-global gap."""

import pytest
from helpers import quick_config, run
from typer.testing import CliRunner

from fedmerge.algorithms.assignments import cluster_recovery
from fedmerge.cli import app
from fedmerge.report.plot_merge_weights import client_groups, pick_rounds
from fedmerge.run.results import RunStore
from fedmerge.run.summary import build_summary, parameter_budget

CLUSTER = [
    "partition.name=cluster",
    "partition.num_groups=3",
    "partition.num_clients=9",
    "algorithm.name=fedmerge",
    "algorithm.num_models=3",
    "rounds=3",
]


def test_plot_merge_weights_command_writes_png(tmp_path):
    res = run(quick_config(*CLUSTER), tmp_path / "run")
    assert client_groups(res.run_dir) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    result = CliRunner().invoke(app, ["plot", "merge-weights", str(res.run_dir)])
    assert result.exit_code == 0, result.output
    png = res.run_dir / "merge_weights.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = tmp_path / "fig.png"
    result = CliRunner().invoke(app, ["plot", "merge-weights", str(res.run_dir), "--out", str(out), "--round", "2"])
    assert result.exit_code == 0 and out.exists()
    result = CliRunner().invoke(app, ["plot", "merge-weights", str(res.run_dir), "--round", "7"])
    assert result.exit_code == 2 and "no merge weights logged at round(s) [7]" in result.output


def test_plot_refuses_a_run_without_merge_weights(tmp_path):
    res = run(quick_config("rounds=1"), tmp_path / "fedavg")
    result = CliRunner().invoke(app, ["plot", "merge-weights", str(res.run_dir)])
    assert result.exit_code == 2 and "no merge weights" in result.output and "Traceback" not in result.output


def test_pick_rounds_spreads_and_keeps_last():
    assert pick_rounds([5, 10, 15, 20, 25, 30], None, 3) == [5, 15, 30]
    assert pick_rounds([5, 10], None, 4) == [5, 10]


@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox", "fedmerge"])
def test_local_gap_is_logged_for_global_model_methods(tmp_path, algorithm):
    res = run(
        quick_config(f"algorithm.name={algorithm}", "rounds=2", "algorithm.gap_samples=512"), tmp_path / algorithm
    )
    gap = res.summary["local_gap"]
    assert gap["last_received"] > gap["last_trained"]  # local training lowers the local loss
    assert gap["last"] == pytest.approx(gap["last_received"] - gap["last_trained"])


def test_local_gap_is_off_by_default(tmp_path):
    res = run(quick_config("rounds=2"), tmp_path / "off")
    assert "local_gap" not in res.summary
    assert all("local_gap" not in r for r in RunStore(res.run_dir).read_metrics())


def test_parameter_budget_rules():
    comm = {"down": 100.0, "up": 100.0}
    fedavg = parameter_budget({"model": 90, "server_state": 100, "client_state_mean": 0}, comm)
    assert fedavg == {
        "server_stored": 100.0,
        "down_per_client_round": 100.0,
        "up_per_client_round": 100.0,
        "client_stored": 100.0,
        "client_optimized": 90.0,
    }
    local = parameter_budget({"model": 90, "server_state": 0, "client_state_mean": 100}, {"down": 0.0, "up": 0.0})
    assert local["client_stored"] == 100.0 and local["server_stored"] == 0.0


def test_cluster_recovery_is_one_for_a_perfect_block_structure():
    rows = [
        {"round": 1, "server": {"merge_weights": [[1 / 3] * 3] * 4}},
        {"round": 2, "server": {"merge_weights": [[0.8, 0.1, 0.1], [0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0, 0.4, 0.6]]}},
    ]
    rec = cluster_recovery(rows, [0, 0, 1, 1])
    assert rec["round"] == 2 and rec["ari"] == pytest.approx(1.0) and rec["ari_by_round"]["1"] == 0.0
    assert cluster_recovery(rows, [0, None, 1, 1]) == {}
    rows = [{"round": 2, "comm_down": 1.0, "comm_up": 1.0, **rows[1]}]
    assert build_summary(rows, {"algorithm": "fedmerge", "client_groups": [1, 1, 0, 0]})["cluster_recovery"][
        "ari"
    ] == pytest.approx(1.0)
