"""fedmerge report: one self-contained HTML page, checked in headless Chromium."""

from __future__ import annotations

import json
import re

import pytest
from headless_chromium import open_page, unavailable
from typer.testing import CliRunner

from fedmerge.cli import app
from fedmerge.run.runner import run_experiment
from fedmerge.sweep.runner import STATUS_FILE, prepare
from fedmerge.sweep.spec import spec_from_args

SECTIONS = ["comparison", "curves", "clients", "partition", "budget", "merge-weights", "lambda", "failures", "runs"]
# the ids of the sections, and every image that did not decode
PROBE = (
    "({sections: [...document.querySelectorAll('section[id]')].map(s => s.id),"
    " broken: [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.alt),"
    " images: document.images.length, text: document.body.innerText})"
)


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    """A sweep of FedAvg, FedMerge and SuPerFed over two seeds, run in-process; one run failed."""
    out = tmp_path_factory.mktemp("report") / "sweep"
    spec = spec_from_args(
        [
            "rounds=2",
            "partition.num_clients=4",
            "algorithm.local_epochs=1",
            "threads=1",
            "algorithm.name=[fedavg,fedmerge,superfed_mm]",
            "seed=[0,1]",
        ]
    )
    for p in prepare(spec, out):
        if p.key == "superfed_mm__s1":  # recorded as a sweep records a failed run
            line = {"key": p.key, "status": "failed", "returncode": 1, "error": "diverged (exit 1)"}
            (out / STATUS_FILE).write_text(json.dumps(line) + "\n")
            continue
        run_experiment(p.config, out / "runs" / p.key, show_progress=False)
    return out


def test_report_is_one_self_contained_page(sweep_dir, tmp_path):
    page = tmp_path / "report.html"
    result = CliRunner().invoke(app, ["report", str(sweep_dir), "-o", str(page)])
    assert result.exit_code == 0, result.output
    text = page.read_text()
    for section in SECTIONS:
        assert f'<section id="{section}">' in text
    # nothing is fetched: no URL in src/href other than data: and in-page anchors, no script
    assert re.findall(r'(?:src|href)="(?!data:image/png;base64,|#)[^"]*"', text) == []
    assert "<script" not in text and "url(" not in text
    # one setting: learning curves, clients, partition, budget, FedMerge's weights, SuPerFed's lambda line
    assert text.count('src="data:image/png;base64,') == 6 and "not drawn" not in text
    assert "| superfed_mm" not in text and "1 (1 failed)" in text and "diverged (exit 1)" in text
    # the command that made each run, from its provenance
    assert "rounds: 2" in text and text.count("<pre>") == 5 * 2  # config and command of each started run
    assert text.count("<details>") == 6


def test_report_in_headless_chromium(sweep_dir, tmp_path):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    page = tmp_path / "report.html"
    assert CliRunner().invoke(app, ["report", str(sweep_dir), "-o", str(page)]).exit_code == 0
    shot = tmp_path / "report.png"
    result = open_page(page, PROBE, shot)
    assert result.errors == []
    assert result.value["sections"] == SECTIONS
    assert result.value["broken"] == [] and result.value["images"] == 6
    for heading in ("Comparison", "Learning curves", "Merge weights", "Lambda curves", "Failures and unfinished"):
        assert heading in result.value["text"]
    assert shot.stat().st_size > 50_000  # a real full-page screenshot
    print(f"screenshot: {shot}")


def test_report_on_a_folder_without_runs_says_so_in_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("nothing here")
    result = CliRunner().invoke(app, ["report", str(tmp_path), "-o", str(tmp_path / "r.html")])
    assert result.exit_code == 2
    assert (
        result.output.strip()
        == f"error: {tmp_path} holds no runs (no run folder with config.yaml and no sweep with index.json)"
    )
    assert not (tmp_path / "r.html").exists()
