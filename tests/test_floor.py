"""``benchmarks/floor.py``: the floor's arithmetic against a hand computation, and its ``--smoke`` run end to end
(no timed assertion: the figures depend on the machine)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import floor  # noqa: E402


def test_floor_seconds_by_hand() -> None:
    # issue 56's figures: 52,500 training rows at 2,900 samples/s per process on 2 processes, 17,500 rows
    # evaluated at 4,600 rows/s per process, and 20 updates of 1.66M values read at 1e9 values/s
    work = floor.Work(train_samples=52_500, eval_rows=17_500, server_values=20 * 1_660_000)
    rates = floor.Rates(train=2_900, forward=4_600, read=1e9, processes=2)
    got = floor.floor_seconds(work, rates)
    train, evaluation, server = 52_500 / 5_800, 17_500 / 9_200, 0.0332
    assert got["train"] == pytest.approx(train)  # 9.0517 s
    assert got["eval"] == pytest.approx(evaluation)  # 1.9022 s
    assert got["server"] == pytest.approx(server)
    assert got["round"] == pytest.approx(train + evaluation + server)  # 10.987 s
    assert got["round"] == pytest.approx(10.98713, abs=1e-4)
    assert got["pull"] == 0  # no proximal pull


def test_a_proximal_pull_is_one_pass_per_step() -> None:
    # 5,250 steps of 1.66M weights at 0.4e9 values/s per process on 2 processes
    work = floor.Work(train_samples=52_500, eval_rows=0, server_values=0, pull_values=5_250 * 1_660_000)
    got = floor.floor_seconds(work, floor.Rates(train=2_900, forward=1, read=1e9, processes=2, pull=0.4e9))
    assert got["pull"] == pytest.approx(5_250 * 1_660_000 / 0.8e9)  # 10.894 s
    assert got["round"] == pytest.approx(52_500 / 5_800 + 10.89375)


def test_round_work_counts_each_method() -> None:
    train, val, test = [100, 300], [10, 30], [20, 40]
    fedavg = floor.round_work(floor.METHODS["fedavg"], train, val, test, epochs=2, params=1000)
    assert (fedavg.train_samples, fedavg.eval_rows, fedavg.server_values) == (800, 100, 2000)
    # Ditto trains two models on each sample and its global model's pooled test is a pass of its own
    ditto = floor.round_work(floor.METHODS["ditto"], train, val, test, epochs=1, params=1000)
    assert (ditto.train_samples, ditto.eval_rows, ditto.server_values) == (800, 160, 2000)
    # FedMerge has no global model (no pooled test); its server also reads its d models
    fedmerge = floor.round_work(floor.METHODS["fedmerge"], train, val, test, epochs=1, params=1000, pulled=40 * 900)
    assert (fedmerge.train_samples, fedmerge.eval_rows, fedmerge.server_values) == (400, 100, 7000)
    assert fedmerge.pull_values == 36_000 and fedavg.pull_values == 0


@pytest.mark.slow
def test_smoke_writes_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "floor.json"
    floor.main(["--smoke", "--json", str(out)])
    report = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert set(report["methods"]) == {"fedavg", "ditto", "fedmerge"}
    assert report["rates"]["train"] > 0 and report["rates"]["forward"] > 0 and report["rates"]["read"] > 0
    assert report["rates"]["pull"] > 0
    # FedMerge (prox_mu 0.01) and Ditto (lam 1) pull their models on every step; FedAvg does not
    assert report["methods"]["fedavg"]["work"]["pull_values"] == 0
    assert report["methods"]["fedmerge"]["work"]["pull_values"] > 0 and report["methods"]["ditto"]["floor"]["pull"] > 0
    assert len(report["per_process"]) == report["processes"]
    for name, figures in report["methods"].items():
        assert figures["floor"]["round"] > 0 and figures["run"]["round"] > 0
        assert figures["ratios"]["round"] > 0 and figures["ratios"]["eval"] > 0
        assert f"{name:<9} round/floor: {figures['ratios']['round']:.2f}x" in printed
        assert f"eval/floor: {figures['ratios']['eval']:.2f}x" in printed
