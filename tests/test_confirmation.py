"""``fedmerge.study.confirmation``: the confirmation study of an exploration study, written from the points its
report's JSON says each row chose, on fresh seeds, checked against the tiny study (tests/data/study_tiny/)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedmerge.study.confirmation import main, seeds
from fedmerge.study.spec import load_study_file

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "study_tiny"


def tiny_repository(tmp_path: Path) -> Path:
    """A repository root holding the tiny study, its base config and its ``wide`` revision's report JSON."""
    (tmp_path / "studies").mkdir(parents=True)
    shutil.copy(TINY / "study_tiny.yaml", tmp_path / "studies" / "study_tiny.yaml")
    shutil.copy(TINY / "base.yaml", tmp_path / "base.yaml")
    family = tmp_path / "docs" / "reproductions" / "fedmerge" / "tiny"
    family.mkdir(parents=True)
    shutil.copy(TINY / "expected" / "study_tiny_wide.json", family / "study_tiny_wide.json")
    return tmp_path


def test_seed_ranges_include_both_ends():
    assert seeds("100-104") == [100, 101, 102, 103, 104]
    assert seeds("7") == [7]


def test_the_confirmation_runs_each_row_at_its_chosen_point_on_fresh_seeds(tmp_path, monkeypatch):
    root = tiny_repository(tmp_path)
    monkeypatch.chdir(root)  # the study path is given as the user typed it, from the repository root
    main(["studies/study_tiny.yaml", "--seeds", "100-102", "--set", "split.test_per_client=5"], root=root)

    out = root / "studies" / "confirm" / "study_tiny_wide_confirm.yaml"
    base = root / "configs" / "repro" / "confirm" / "study_tiny_wide_confirm.yaml"
    assert out.read_text().startswith("# Written by scripts/confirmation_study.py; do not tune on these seeds.\n")
    spec = yaml.safe_load(out.read_text())
    # By hand, from study_tiny_wide.json: Local chose lr 0.2, FedAvg its extra point lr 0.8; one point each.
    assert [(m["label"], m["grid"]) for m in spec["methods"]] == [
        ("Local", {"algorithm.lr": [0.2]}),
        ("FedAvg", {"algorithm.lr": [0.8]}),
    ]
    assert spec["methods"][1]["overrides"] == ["algorithm.name=fedavg", "algorithm.local_epochs=1"]
    # The study's seeds 0 and 1 (tuned on 1) explored it; the fresh ones tune on their first.
    assert (spec["seeds"], spec["tune_seed"], spec["explored_on"]) == ([100, 101, 102], 100, [0, 1])
    assert spec["confirms"] == "studies/study_tiny.yaml revision wide"
    assert spec["base"] == "configs/repro/confirm/study_tiny_wide_confirm.yaml"
    written = yaml.safe_load(base.read_text())
    assert written["name"] == "study-tiny-confirm" and written["split"]["test_per_client"] == 5
    assert written["dataset"] == {"name": "digits"}  # the rest of the base as it was
    assert len(load_study_file(out).history()[-1].seeds) == 3  # a valid study file


def test_the_reference_preset_keeps_the_head_rule_it_was_explored_with(tmp_path, monkeypatch):
    root = tiny_repository(tmp_path)
    study = yaml.safe_load((root / "studies" / "study_tiny.yaml").read_text())
    study["methods"][1]["overrides"].append("algorithm.preset=reference")
    study["methods"][1]["overrides"][0] = "algorithm.name=fedmerge"
    (root / "studies" / "study_tiny.yaml").write_text(yaml.safe_dump(study))
    monkeypatch.chdir(root)
    main(["studies/study_tiny.yaml", "--revision", "wide"], root=root)
    spec = yaml.safe_load((root / "studies" / "confirm" / "study_tiny_wide_confirm.yaml").read_text())
    assert spec["methods"][1]["overrides"][-1] == "algorithm.merge_grad=head"
    assert spec["methods"][0]["overrides"] == ["algorithm.name=local"]
    assert spec["seeds"] == [100, 101, 102, 103, 104]
    assert "keep the former head rule" in spec["description"]


def test_a_study_without_its_report_json_is_refused_in_one_line(tmp_path, monkeypatch):
    root = tiny_repository(tmp_path)
    shutil.rmtree(root / "docs")
    monkeypatch.chdir(root)
    with pytest.raises(SystemExit, match=r"expected one report JSON named study_tiny_wide\.json"):
        main(["studies/study_tiny.yaml"], root=root)


def test_the_script_at_its_old_path_writes_into_its_own_checkout(tmp_path):
    """scripts/confirmation_study.py (named by the files it wrote and by HISTORY files) runs the package's
    command with its checkout as the root; here a copy of it in a tiny checkout."""
    root = tiny_repository(tmp_path / "repo")
    (root / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "confirmation_study.py", root / "scripts")
    (root / "src").symlink_to(ROOT / "src")
    proc = subprocess.run(
        [sys.executable, "scripts/confirmation_study.py", "studies/study_tiny.yaml"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = yaml.safe_load((root / "studies" / "confirm" / "study_tiny_wide_confirm.yaml").read_text())
    assert data["methods"][0]["grid"] == {"algorithm.lr": [0.2]}
    assert (root / "configs" / "repro" / "confirm" / "study_tiny_wide_confirm.yaml").exists()


def test_a_second_confirmation_gets_its_own_name_and_must_use_seeds_no_earlier_one_ran(tmp_path, monkeypatch):
    root = tiny_repository(tmp_path)
    monkeypatch.chdir(root)
    main(["studies/study_tiny.yaml", "--seeds", "100-102"], root=root)
    first = root / "studies" / "confirm" / "study_tiny_wide_confirm.yaml"
    before = first.read_text()
    # The same name again is refused: the committed confirmation is never rewritten behind its runs.
    with pytest.raises(SystemExit, match=r"study_tiny_wide_confirm\.yaml exists; give another --name"):
        main(["studies/study_tiny.yaml", "--seeds", "200-202"], root=root)
    assert first.read_text() == before
    # Seeds an earlier confirmation of the same study ran are refused (102 is in both).
    with pytest.raises(SystemExit, match=r"seeds \[102\] already confirmed this study in studies/confirm/study_tiny"):
        main(["studies/study_tiny.yaml", "--seeds", "102-104", "--name", "study_tiny_wide_confirm2"], root=root)
    main(["studies/study_tiny.yaml", "--seeds", "200-202", "--name", "study_tiny_wide_confirm2"], root=root)
    second = yaml.safe_load((root / "studies" / "confirm" / "study_tiny_wide_confirm2.yaml").read_text())
    assert (second["seeds"], second["tune_seed"]) == ([200, 201, 202], 200)
    assert second["base"] == "configs/repro/confirm/study_tiny_wide_confirm2.yaml"
    assert (
        "An earlier confirmation (studies/confirm/study_tiny_wide_confirm.yaml) ran seeds 100, 101, 102"
        in (second["description"])
    )
    # Same rows at the same points, same claims as the first.
    assert second["methods"] == yaml.safe_load(before)["methods"]
    assert second["claims"] == yaml.safe_load(before)["claims"]
    assert first.read_text() == before
