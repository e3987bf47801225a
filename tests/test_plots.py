"""Plots: the budget figure groups runs by dataset and setting with one legend and readable ticks; the
partition plot has integer client ticks and group separators; merge weights are logged every round."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import yaml
from helpers import quick_config, run

from fedmerge.report.plot_budget import budget_figure, budget_point, group_points, log_ticks
from fedmerge.report.plot_merge_weights import merge_weight_snapshots, pick_rounds, plot_merge_weights
from fedmerge.run.prepare import load_data


def fake_run(root: Path, name: str, algorithm: str, dataset: str, partition: dict, server: float, acc: float) -> Path:
    """A finished run folder as the runner writes it, reduced to what plot budget reads."""
    run_dir = root / name
    run_dir.mkdir(parents=True)
    summary = {
        "algorithm": algorithm,
        "dataset": dataset,
        "last": {"clients": {"test_acc": {"mean": acc}}},
        "parameters": {"server_state": server, "client_state_mean": 0.0},
        "communication_per_client_per_round": {"down": 15_000.0, "up": 15_000.0 if algorithm != "local" else 0.0},
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"partition": partition, "noise": {"kind": "none"}}))
    return run_dir


def test_budget_runs_are_grouped_by_dataset_and_setting(tmp_path):
    dirichlet = {"name": "dirichlet", "num_clients": 10, "alpha": 0.1}
    runs = [
        fake_run(tmp_path, "a", "fedmerge", "digits", dirichlet, 30_000, 0.8),
        fake_run(tmp_path, "b", "fedmerge", "digits", dirichlet, 60_000, 0.85),
        fake_run(tmp_path, "c", "fedmerge", "digits", {**dirichlet, "alpha": 1.0}, 30_000, 0.7),
        fake_run(tmp_path, "d", "fedmerge", "npz", {"name": "cluster", "num_groups": 3}, 30_000, 0.6),
        fake_run(tmp_path, "e", "fedavg", "npz", {"name": "cluster", "num_groups": 3}, 15_000, 0.5),
        fake_run(tmp_path, "f", "local", "npz", {"name": "cluster", "num_groups": 3}, 0, 0.55),
    ]
    points = [budget_point(r) for r in runs]
    groups = group_points(points)
    assert [key for key, _ in groups] == [
        ("digits", "dirichlet, alpha=0.1"),
        ("digits", "dirichlet, alpha=1.0"),
        ("npz", "cluster"),
    ]
    assert [len(members) for _, members in groups] == [2, 1, 3]

    fig = budget_figure(points)
    assert len(fig.axes) == 3 * 3
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in fig.axes)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["fedavg", "fedmerge", "local"]
    # fedmerge's line never leaves its group: the first row joins two runs, the others hold one each
    fedmerge_lines = [[len(line.get_xdata()) for line in ax.get_lines() if line.get_color() == "C1"] for ax in fig.axes]
    assert [lines[0] for lines in fedmerge_lines[::3]] == [2, 1, 1]
    assert all(ax.get_title(loc="left") for ax in fig.axes[::3])


def test_budget_tick_labels_do_not_overlap(tmp_path):
    runs = [
        fake_run(tmp_path, f"r{i}", alg, "digits", {"name": "iid"}, server, 0.5 + i / 20)
        for i, (alg, server) in enumerate([("local", 0), ("fedavg", 15_010), ("fedmerge", 75_050), ("ifca", 45_030)])
    ]
    fig = budget_figure([budget_point(r) for r in runs])
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    for ax in fig.axes:
        labels = [t for t in ax.get_xticklabels() if t.get_text() and t.get_visible()]
        assert 2 <= len(labels) <= 6, [t.get_text() for t in labels]
        boxes = [t.get_window_extent(renderer) for t in labels]
        for a, b in itertools.combinations(boxes, 2):
            assert not a.overlaps(b), [t.get_text() for t in labels]


def test_log_ticks_are_few_round_values_spanning_the_range():
    for lo, hi in [(15_000, 15_000), (15_000, 60_000), (84, 5_000_000), (3, 7)]:
        ticks = log_ticks(lo, hi)
        assert 1 <= len(ticks) <= 5
        for t in ticks:
            mantissa = t / 10 ** math.floor(math.log10(t))
            assert any(math.isclose(mantissa, m) for m in (1, 1.5, 2, 3, 5, 7)), t
            assert lo / 1.6 <= t <= hi * 1.6


def test_partition_plot_has_integer_client_ticks_and_group_separators():
    data = load_data(quick_config("partition.name=cluster", "partition.num_groups=3", "partition.num_clients=9"))
    ax = data.summary_figure().axes[0]
    groups = [c.group for c in data.clients]
    order = sorted(range(9), key=lambda c: groups[c])
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(c) for c in order]
    assert list(ax.get_xticks()) == list(range(9))
    separators = [line.get_xdata()[0] for line in ax.get_lines() if line.get_linestyle() == "--"]
    boundaries = [i - 0.5 for i in range(1, 9) if groups[order[i]] != groups[order[i - 1]]]
    assert separators == boundaries and len(separators) == 2
    assert sorted(t.get_text() for t in ax.texts) == ["group 0", "group 1", "group 2"]


def test_partition_plot_without_groups_and_with_many_clients_has_integer_ticks():
    few = load_data(quick_config("partition.num_clients=5")).summary_figure().axes[0]
    assert [t.get_text() for t in few.get_xticklabels()] == ["0", "1", "2", "3", "4"]
    assert not [line for line in few.get_lines() if line.get_linestyle() == "--"]
    many = load_data(quick_config("partition.num_clients=60", "partition.alpha=5")).summary_figure()
    many.canvas.draw()
    ticks = many.axes[0].get_xticks()
    assert len(ticks) >= 3 and all(float(t).is_integer() for t in ticks)


def test_merge_weights_are_logged_every_round_so_the_default_plot_has_four_panels(tmp_path):
    cfg = quick_config("algorithm.name=fedmerge", "algorithm.num_models=2", "rounds=5", "eval_every=5", "threads=1")
    result = run(cfg, tmp_path / "fm")
    snapshots = merge_weight_snapshots(result.run_dir)
    assert [r for r, _ in snapshots] == [1, 2, 3, 4, 5]
    assert all(w.shape == (6, 2) for _, w in snapshots)
    assert pick_rounds([r for r, _ in snapshots], None, 4) == [1, 2, 4, 5]
    assert plot_merge_weights(result.run_dir).stat().st_size > 1000
