"""``python -m fedmerge.study.recompute``: every interval of a report recomputed from its published per-client
values alone (``REPORT.clients.json``, written by ``fedmerge study`` with the report), checked on hand-made
values against hand-computed intervals, and on a small real study against its report; a tampered value is
caught."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedmerge.cli import app
from fedmerge.study.recompute import main

DATA = Path(__file__).resolve().parent / "data" / "study_recompute"
T2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)  # t(0.975) with 2 degrees of freedom, in closed form


def hand_made(tmp_path: Path) -> Path:
    """Two rows on three seeds, two clients each, and the report figures computed by hand."""
    local = {"0": [0.4, 0.45, 0.65], "1": [0.5] * 3, "2": [0.5, 0.55, 0.75]}  # means 0.5, 0.5, 0.6 (not medians)
    fedavg = {"0": [0.6, 0.65, 0.85], "1": [0.6] * 3, "2": [0.8] * 3}  # means 0.7, 0.6, 0.8
    rows = {
        label: {seed: {"clients": ["0", "1", "2"], "values": v, "test_n": [100] * 3} for seed, v in values.items()}
        for label, values in (("Local", local), ("FedAvg", fedavg))
    }
    clients = {
        "metric": {"scope": "clients", "name": "acc", "round": "best_val"},
        "decimals": 6,
        "bootstrap": {"resamples": 1000, "seed": 0, "min_clients": 10},
        "rows": rows,
    }
    # Local: mean 0.5333, sd 0.057735; FedAvg: mean 0.7, sd 0.1; differences 0.2, 0.1, 0.2: mean 0.16667,
    # sd 0.057735
    sd = math.sqrt(((0.5 - 1.6 / 3) ** 2 * 2 + (0.6 - 1.6 / 3) ** 2) / 2)
    local_half, fedavg_half = T2 * sd / math.sqrt(3), T2 * 0.1 / math.sqrt(3)
    claim_half = T2 * sd / math.sqrt(3)
    report = {
        "rows": {
            "Local": {
                "seeds": [0, 1, 2],
                "best_val": [0.5, 0.5, 0.6],
                "interval": [1.6 / 3 - local_half, 1.6 / 3 + local_half],
            },
            "FedAvg": {
                "seeds": [0, 1, 2],
                "best_val": [0.7, 0.6, 0.8],
                "interval": [0.7 - fedavg_half, 0.7 + fedavg_half],
            },
        },
        "claims": [
            {
                "higher": "FedAvg",
                "lower": "Local",
                "seeds": [0, 1, 2],
                "difference": 100 * 0.5 / 3,
                "low": 100 * (0.5 / 3 - claim_half),
                "high": 100 * (0.5 / 3 + claim_half),
                "per_seed": [20.0, 10.0, 20.0],
                "method": "paired t",
                "verdict": "reproduced",
            }
        ],
    }
    (tmp_path / "r.json").write_text(json.dumps(report))
    (tmp_path / "r.clients.json").write_text(json.dumps(clients))
    return tmp_path / "r.json"


def test_recompute_gives_the_hand_computed_t_intervals(tmp_path, capsys):
    path = hand_made(tmp_path)
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "17 of 17 figures equal the report" in out  # rows 2 x (3 means, 2 ends); claim 3 + 3 seeds + verdict
    assert "DIFFERS" not in out


def test_a_report_figure_off_by_more_than_rounding_is_named(tmp_path, capsys):
    path = hand_made(tmp_path)
    report = json.loads(path.read_text())
    report["claims"][0]["low"] += 0.01  # a hundredth of a point
    report["rows"]["FedAvg"]["interval"][1] -= 0.0001
    path.write_text(json.dumps(report))
    assert main([str(path)]) == 1
    out = capsys.readouterr().out
    assert "DIFFERS  claim FedAvg > Local, low" in out and "DIFFERS  row FedAvg, 95% interval high" in out
    assert "15 of 17 figures equal the report; 2 differ" in out


def test_an_unreadable_clients_file_is_refused_in_one_line(tmp_path, capsys):
    path = hand_made(tmp_path)
    (tmp_path / "r.clients.json").unlink()
    assert main([str(path)]) == 2
    assert capsys.readouterr().err.startswith("error: cannot read")


@pytest.mark.slow
def test_a_real_studys_published_clients_recompute_its_report_and_a_tampered_value_is_caught(
    tmp_path, monkeypatch, capsys
):
    """Four runs of 12 clients (2 rows x 2 seeds) and their central references: ``fedmerge study`` writes
    r.md, r.json and r.clients.json; recomputing from the clients file alone gives every figure of r.json."""
    for name in ("base.yaml", "study.yaml"):
        shutil.copy(DATA / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["study", "study.yaml", "--runs", "runs", "--out", "r.md"])
    assert result.exit_code == 0, result.output
    published = json.loads((tmp_path / "r.clients.json").read_text())
    report = json.loads((tmp_path / "r.json").read_text())
    # The published values are the run folder's own (read here from metrics.jsonl, at the best-val round).
    folder = next((tmp_path / "runs" / "local-g0-s0").iterdir())
    at = json.loads((folder / "summary.json").read_text())["best_val"]["round"]
    row = next(
        json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if json.loads(x)["round"] == at
    )
    clients = row["eval"]["clients"]
    entry = published["rows"]["Local"]["0"]
    assert entry["clients"] == sorted(clients, key=int) and len(entry["clients"]) == 12
    assert entry["values"] == [round(clients[c]["test_acc"], 6) for c in entry["clients"]]
    assert sum(entry["values"]) / 12 == pytest.approx(report["rows"]["Local"]["best_val"][0], abs=1e-6)
    claim = report["claims"][0]
    assert claim["method"] == "paired t" and "bootstrap_low" in claim  # 12 clients: the detail is there

    assert main(["r.json"]) == 0
    out = capsys.readouterr().out
    assert "18 of 18 figures equal the report" in out, out

    # One client's value moved by one test sample: its seed's mean, the row's interval and the claim move.
    n = entry["test_n"][3]
    entry["values"][3] = round(entry["values"][3] + 1 / n, 6)
    (tmp_path / "tampered.json").write_text(json.dumps(published))
    assert main(["r.json", "--clients", "tampered.json", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "DIFFERS  row Local, seed 0, mean" in out and "DIFFERS  claim FedAvg > Local, seed 0 difference" in out
    assert "ok  " not in out  # --quiet: only what differs
