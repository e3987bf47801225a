"""plot_budget: accuracy against server / communicated / client parameters from run folders."""

import pytest
from helpers import quick_config, run

from fedmerge.report.plot_budget import budget_point, plot_budget

TINY = ["rounds=1", "partition.num_clients=4", "dataset.max_samples=300"]


def test_plot_budget_draws_a_png_from_two_runs(tmp_path):
    fedavg = run(quick_config(*TINY), tmp_path / "fedavg").run_dir
    ifca = run(quick_config(*TINY, "algorithm.name=ifca", "algorithm.num_clusters=2"), tmp_path / "ifca").run_dir
    a, b = budget_point(fedavg), budget_point(ifca)
    assert (a["label"], b["label"]) == ("fedavg", "ifca")
    assert b["server"] == 2 * a["server"]  # two cluster models on the server
    assert b["communicated"] == 1.5 * a["communicated"]  # two models down, one up
    assert b["client"] == 2 * a["client"]  # a client receives (stores) both
    assert 0 <= a["accuracy"] <= 1
    out = plot_budget([fedavg, ifca], tmp_path / "plots" / "budget.png")
    assert out.exists() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_budget_point_refuses_an_unfinished_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="summary.json"):
        budget_point(tmp_path)
