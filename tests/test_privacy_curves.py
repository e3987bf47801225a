"""Privacy-utility curves (``fedmerge plot privacy``, the HTML report's privacy section), from run folders.

Tiny run folders are written here with chosen numbers (config.yaml and summary.json as a run writes them), so
every point, interval and reference line of the figure and its table is known by hand; a few real tiny runs
check that the summary a run writes is read as it is.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import yaml
from helpers import quick_config, run
from typer.testing import CliRunner

from fedmerge.cli import app
from fedmerge.report.data import find_runs
from fedmerge.report.html import build_report
from fedmerge.report.plot_privacy import (
    curves,
    family_labels,
    plot_privacy,
    privacy_figure,
    privacy_table,
    read_curves,
    read_run,
)

BASE = {  # small and quick to load: the HTML report draws the partition of the first run
    "rounds": 50,
    "dataset": {"name": "digits"},
    "partition": {"name": "dirichlet", "num_clients": 10, "alpha": 0.5},
    "model": {"name": "mlp", "hidden": [50]},
}


def dp_sgd(z: float, delta: float = 1e-5) -> dict:
    return {"dp_sgd": {"noise_multiplier": z, "target_epsilon": None, "delta": delta, "clip": 1.0}, "central": None}


def central(z: float) -> dict:
    return {"dp_sgd": None, "central": {"noise_multiplier": z, "target_epsilon": None, "delta": 1e-5, "clip": 2.0}}


def write_run(
    root: Path,
    key: str,
    seed: int,
    algorithm: dict,
    privacy: dict | None,
    last: float,
    epsilons: dict[str, float] | float | None = None,
    best: float | None = None,
    finished: bool = True,
) -> Path:
    """A run folder as a study leaves it (RUNS/KEY/KEY-stamp) with the numbers given."""
    folder = root / key / f"{key}-20260101-000000"
    folder.mkdir(parents=True)
    config = {"name": key, "seed": seed, "output_dir": str(root / key), **BASE, "algorithm": algorithm}
    if privacy is not None:
        config["privacy"] = privacy
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    if not finished:
        return folder
    acc = lambda v: {"clients": {"test_acc": {"mean": v, "std": 0.1, "worst10": v - 0.2}, "val_acc": {"mean": v}}}  # noqa: E731
    summary: dict = {"algorithm": algorithm["name"], "seed": seed, "last": acc(last), "best_val": acc(best or last)}
    if privacy and privacy.get("dp_sgd"):
        eps = epsilons if isinstance(epsilons, dict) else {"0": epsilons}
        summary["privacy"] = {"dp_sgd": {"delta": privacy["dp_sgd"]["delta"], "clip": 1.0, "epsilon": eps}}
        summary["privacy"]["dp_sgd"] |= {
            "epsilon_max": max(eps.values()),
            "epsilon_mean": statistics.mean(eps.values()),
        }
    if privacy and privacy.get("central"):
        summary["privacy"] = {"central": {"delta": 1e-5, "epsilon": epsilons, "noise_multiplier": 0.3, "rounds": 50}}
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


FEDAVG = {"name": "fedavg", "lr": 0.8}
DITTO = {"name": "ditto", "lr": 0.8, "lam": 1.0}
LOCAL = {"name": "local", "lr": 0.05}


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    """FedAvg without DP and at DP-SGD z=1 and z=4; Ditto without DP and at central z=0.3; Local; two seeds each.
    Per-client epsilons differ (the figure takes the largest); a few runs that must not be drawn."""
    root = tmp_path / "runs"
    for seed, (a, b, c, d, e, f) in {
        0: (0.70, 0.62, 0.40, 0.75, 0.50, 0.60),
        1: (0.74, 0.58, 0.30, 0.77, 0.46, 0.62),
    }.items():
        write_run(root, f"fedavg-s{seed}", seed, FEDAVG, None, a, best=a + 0.01)
        write_run(root, f"fedavg-z1-s{seed}", seed, FEDAVG, dp_sgd(1), b, {"0": 80.0 + seed, "1": 88.0 + seed})
        write_run(root, f"fedavg-z4-s{seed}", seed, FEDAVG, dp_sgd(4), c, {"0": 12.0, "1": 11.0 + 2 * seed})
        write_run(root, f"ditto-s{seed}", seed, DITTO, None, d)
        write_run(root, f"ditto-c03-s{seed}", seed, DITTO, central(0.3), e, 388.0)
        write_run(root, f"local-s{seed}", seed, LOCAL, None, f)
    write_run(root, "fedavg-z1-s2", 2, FEDAVG, dp_sgd(1), 0.6, finished=False)  # unfinished
    write_run(root, "fedavg-z0-s0", 0, FEDAVG, dp_sgd(0), 0.7, math.inf)  # no noise: epsilon infinite
    return root


def run_dirs(root: Path) -> list[Path]:
    return [r.run_dir for r in find_runs([root])]


def point(data, label: str, noise: str):
    return next(p for p in data.points if p.label == label and p.noise == noise)


def test_points_are_the_seeds_means_with_the_largest_clients_epsilon(runs):
    data = read_curves(run_dirs(runs))
    z1, z4 = point(data, "fedavg", "z=1"), point(data, "fedavg", "z=4")
    assert sorted(z1.seeds) == [0, 1] and sorted(z1.epsilons) == [88.0, 89.0]  # the largest client's, per seed
    assert (
        z1.epsilon == 88.5 and z1.accuracy == pytest.approx(0.60) and z1.accuracy_std == pytest.approx(0.02**0.5 * 0.2)
    )
    assert sorted(z4.epsilons) == [12.0, 13.0] and z4.accuracy == pytest.approx(0.35)
    assert z4.accuracy_std == pytest.approx(statistics.stdev([0.40, 0.30]))
    # one curve per method and mechanism (methods as found: folders in order), in order of epsilon
    assert [(p.label, p.mechanism, p.noise) for p in data.points] == [
        ("ditto", "central", "z=0.3"),
        ("fedavg", "dp_sgd", "z=4"),
        ("fedavg", "dp_sgd", "z=1"),
    ]
    refs = {r.label: r for r in data.references}
    assert set(refs) == {"fedavg", "ditto", "local"}
    assert refs["fedavg"].accuracy == pytest.approx(0.72) and refs["fedavg"].epsilons == []
    assert refs["ditto"].accuracy == pytest.approx(0.76) and refs["local"].accuracy == pytest.approx(0.61)
    assert data.mechanisms() == ["dp_sgd", "central"]
    # never drawn, and said why: the unfinished run and the noiseless one
    assert len(data.left_out) == 2
    assert any("fedavg-z1-s2" in why and "unfinished" in why for why in data.left_out)
    assert any("fedavg-z0-s0" in why and "infinite" in why for why in data.left_out)


def test_the_best_validation_round_is_read_when_asked(runs):
    data = read_curves(run_dirs(runs), selection="best_val")
    assert next(r for r in data.references if r.label == "fedavg").accuracy == pytest.approx(0.73)


def test_families_of_one_algorithm_are_told_apart_by_what_differs(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "a", 0, {"name": "fedavg", "lr": 0.8}, dp_sgd(1), 0.5, 10.0)
    write_run(root, "b", 0, {"name": "fedavg", "lr": 0.4}, dp_sgd(1), 0.6, 10.0)
    write_run(root, "c", 0, {"name": "ditto", "lr": 0.4}, dp_sgd(1), 0.6, 10.0)
    runs = [read_run(d) for d in run_dirs(root)]
    assert sorted(family_labels(runs).values()) == ["ditto", "fedavg, lr=0.4", "fedavg, lr=0.8"]
    assert len(curves(runs).points) == 3  # never joined into one curve


def test_a_second_copy_of_a_seed_and_a_run_with_both_mechanisms_are_left_out(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "a", 0, FEDAVG, dp_sgd(1), 0.5, 10.0)
    write_run(root, "b", 0, FEDAVG, dp_sgd(1), 0.9, 10.0)  # the same run again (another folder)
    both = {**dp_sgd(1), "central": central(0.3)["central"]}
    write_run(root, "c", 0, FEDAVG, both, 0.4, 10.0)
    data = read_curves(run_dirs(root))
    assert [p.accuracies for p in data.points] == [[0.5]]
    assert len(data.left_out) == 2 and any("both DP-SGD and central DP" in w for w in data.left_out)


def test_the_figure_draws_each_point_with_its_interval_and_the_references(runs):
    data = read_curves(run_dirs(runs))
    fig = privacy_figure(data)
    dp_ax, central_ax = fig.axes
    assert dp_ax.get_title(loc="left") == "DP-SGD (sample-level)" and dp_ax.get_xscale() == "log"
    assert central_ax.get_title(loc="left") == "central DP (user-level)"
    assert "δ=1e-05" in dp_ax.get_xlabel() and "3 seeds" not in dp_ax.get_ylabel() and "2 seeds" in dp_ax.get_ylabel()
    lines = {line.get_label(): line for line in dp_ax.get_lines()}
    bars = next(c for c in dp_ax.containers if c.get_label() == "fedavg")  # the curve and its seeds' intervals
    assert list(bars.lines[0].get_xdata()) == [12.5, 88.5]
    assert list(bars.lines[0].get_ydata()) == pytest.approx([0.35, 0.60])
    segments = bars.lines[2][0].get_segments()
    assert [s[0][1] for s in segments] == pytest.approx([0.35 - statistics.stdev([0.4, 0.3]), 0.60 - 0.02**0.5 * 0.2])
    assert [s[1][1] for s in segments] == pytest.approx([0.35 + statistics.stdev([0.4, 0.3]), 0.60 + 0.02**0.5 * 0.2])
    # its reference without DP, and Local (no private run) in every panel; Ditto's only where Ditto is
    assert list(lines["fedavg, no DP"].get_ydata()) == pytest.approx([0.72, 0.72])
    assert "local (no DP run)" in lines and "ditto, no DP" not in lines
    assert [c.get_label() for c in dp_ax.containers] == ["fedavg"]
    central_lines = {line.get_label(): line for line in central_ax.get_lines()}
    (ditto,) = central_ax.containers
    assert ditto.get_label() == "ditto" and list(ditto.lines[0].get_xdata()) == [388.0]
    assert {"ditto, no DP", "local (no DP run)"} <= set(central_lines) and "fedavg, no DP" not in central_lines
    assert [t.get_text() for t in dp_ax.texts] == ["z=4", "z=1"]  # each point names its noise


def test_the_table_holds_the_figures_numbers(runs):
    table = privacy_table(read_curves(run_dirs(runs)))
    assert "| fedavg | none | - | - | - | ∞ (no DP) | - | 2 | 72.0 ± 2.8 |" in table
    # the clients' mean epsilon: (80 + 88) / 2 and (81 + 89) / 2, averaged over the seeds
    assert "| fedavg | DP-SGD (sample-level) | z=1 | 1 | 1e-05 | 88.5 (88-89) | 84.5 | 2 | 60.0 ± 2.8 |" in table
    assert "| ditto | central DP (user-level) | z=0.3 | 2 | 1e-05 | 388 | - | 2 | 48.0 ± 2.8 |" in table
    assert "Not drawn:" in table and "unfinished" in table


def test_plot_privacy_command_writes_the_png_and_the_table(runs, tmp_path):
    out, table = tmp_path / "fig" / "privacy.png", tmp_path / "fig" / "privacy.md"
    result = CliRunner().invoke(app, ["plot", "privacy", str(runs), "--out", str(out), "--table", str(table)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert table.read_text() == privacy_table(read_curves(run_dirs(runs)))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--round", "first"], "error: --round first: one of last, best_val"),
        ([], "no run with differential privacy (a privacy: section) to draw"),
    ],
)
def test_plot_privacy_refuses_in_one_line(tmp_path, args, message):
    write_run(tmp_path / "runs", "a", 0, FEDAVG, None, 0.7)
    result = CliRunner().invoke(
        app, ["plot", "privacy", str(tmp_path / "runs"), "--out", str(tmp_path / "x.png"), *args]
    )
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert message in result.output


def test_the_html_report_has_the_privacy_section_and_keeps_privacy_settings_apart(runs, tmp_path):
    page = build_report([runs], tmp_path / "report.html")
    text = page.read_text()
    assert '<section id="privacy">' in text and 'href="#privacy"' in text
    section = text.split('<section id="privacy">')[1].split("</section>")[0]
    assert section.count('src="data:image/png;base64,') == 1 and "not drawn" not in section
    # the comparison table: one row per method and privacy setting, not one per algorithm
    methods = {r.method for r in find_runs([runs])}
    assert methods == {"fedavg", "fedavg (DP-SGD z=1)", "fedavg (DP-SGD z=4)", "fedavg (DP-SGD z=0)", "ditto"} | {
        "ditto (central DP z=0.3)",
        "local",
    }


def test_a_report_without_private_runs_has_no_privacy_section(tmp_path):
    write_run(tmp_path / "runs", "a", 0, FEDAVG, None, 0.7)
    assert '<section id="privacy">' not in build_report([tmp_path / "runs"], tmp_path / "r.html").read_text()


# --- real runs: what a run writes is what the curves read --------------------------------------
SMALL = ["rounds=2", "partition.num_clients=4", "participation=0.5"]


def test_curves_from_real_runs_read_the_accountants_epsilon(tmp_path):
    pytest.importorskip("opacus", reason="privacy needs Opacus: pip install -e '.[privacy]'")
    from fedmerge.core.privacy import Ledger

    root = tmp_path / "runs"
    central_dp = ["privacy.central.noise_multiplier=0.5", "privacy.central.clip=1.0"]
    results = {}
    for seed in (0, 1):
        for name, extra in (("plain", []), ("central", central_dp), ("dpsgd", ["privacy.dp_sgd.noise_multiplier=2"])):
            key = f"{name}-s{seed}"
            results[key] = run(quick_config(*SMALL, f"seed={seed}", *extra, output_dir=root / key), root / key / key)
    data = read_curves(run_dirs(root))
    c = next(p for p in data.points if p.mechanism == "central")
    # 2 rounds of half the clients: the server's ledger is [(z, q=2/4, 2 steps)]
    assert c.epsilons == [Ledger([[0.5, 0.5, 2]]).epsilon(1e-5)] * 2
    got = {(p.mechanism, s): a for p in [*data.points, *data.references] for s, a in zip(p.seeds, p.accuracies)}
    for seed in (0, 1):
        for name, mechanism in (("plain", "none"), ("central", "central"), ("dpsgd", "dp_sgd")):
            summary = results[f"{name}-s{seed}"].summary
            assert got[(mechanism, seed)] == summary["last"]["clients"]["test_acc"]["mean"]
    d = next(p for p in data.points if p.mechanism == "dp_sgd")
    want = [results[f"dpsgd-s{s}"].summary["privacy"]["dp_sgd"]["epsilon_max"] for s in d.seeds]
    assert d.epsilons == want and all(e > 0 for e in want)
    assert data.left_out == [] and {r.label for r in data.references} == {"fedavg"}
    png = plot_privacy(run_dirs(root), tmp_path / "p.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
