"""Paper claims (#55): a study's comparisons counted per paper claim, and the claims declared after their
runs marked with the times, in the report as in the index. Expected values are worked out by hand."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from fedmerge.study.claims import count_text, late_declarations, mark_late, paper_claims
from fedmerge.study.protocol import Conducted
from fedmerge.study.report import report, results_json
from fedmerge.study.spec import Claim, Study, run_key


def comparison(paper: str, higher: str, lower: str, verdict: str | None) -> dict:
    return {"paper": paper, "higher": higher, "lower": lower, "verdict": verdict}


def test_a_claim_is_reproduced_only_if_every_comparison_it_needs_is():
    grouped = paper_claims(
        [
            comparison("A", "X", "L", "reproduced"),
            comparison("A", "X", "F", "reproduced"),
            comparison("A", "X", "G", "not reproduced"),
            comparison("B", "F", "L", "reproduced"),
        ]
    )
    assert [(c.text, len(c.comparisons), c.reproduced) for c in grouped] == [("A", 3, False), ("B", 1, True)]
    assert count_text(grouped) == "1 of 2 paper claims reproduced; not reproduced: A"


def test_a_comparison_listed_under_two_claims_is_refused_in_one_line():
    with pytest.raises(ValueError) as err:
        paper_claims([comparison("A", "X", "L", "reproduced"), comparison("B", "X", "L", "level")])
    assert str(err.value) == (
        "comparison 'X' > 'L' is listed under 'A' and 'B': a comparison belongs to one paper claim"
    )


def test_late_notes_name_all_claims_when_every_one_is_late():
    grouped = paper_claims([comparison("A", "X", "L", "reproduced"), comparison("B", "F", "L", "reproduced")])
    note = "declared after its runs: T1 (c1); runs from c0 (T0)"
    text = count_text(mark_late(grouped, {("X", "L"): note, ("F", "L"): note}))
    assert text == "2 of 2 paper claims reproduced; **declared after its runs (all 2): T1 (c1); runs from c0 (T0)**"


# --- declarations read from git ------------------------------------------------------------------------


def git(repo: Path, *args: str, date: str | None = None) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env |= {"GIT_COMMITTER_EMAIL": "t@t"}
    if date:
        env |= {"GIT_COMMITTER_DATE": date, "GIT_AUTHOR_DATE": date}
    return subprocess.run(["git", "-C", str(repo), *args], env=env, check=True, capture_output=True, text=True).stdout


def commit_file(repo: Path, name: str, text: str, date: str) -> str:
    (repo / name).write_text(text)
    git(repo, "add", name)
    git(repo, "commit", "-q", "-m", f"at {date}", date=date)
    return git(repo, "rev-parse", "HEAD").strip()


STUDY_HEAD = """title: t
base: base.yaml
seeds: [0, 1, 2]
methods:
- {label: Local, grid: {algorithm.lr: [0.1]}}
- {label: FedAvg, grid: {algorithm.lr: [0.1]}}
"""
EARLY = "claims:\n- {paper: A, higher: FedAvg, lower: Local}\n"
LATE = EARLY + "- {paper: B, higher: Local, lower: FedAvg}\n"


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    first = commit_file(repo, "s.yaml", STUDY_HEAD + EARLY, "2026-01-01T10:00:00+00:00")
    second = commit_file(repo, "s.yaml", STUDY_HEAD + LATE, "2026-01-01T12:30:00+00:00")
    return repo, first, second


def test_a_comparison_missing_from_the_study_file_at_the_runs_commit_is_declared_after_them(repo):
    root, first, second = repo
    pairs = [("FedAvg", "Local"), ("Local", "FedAvg")]
    late = late_declarations(root, ["s.yaml"], [first], pairs)
    # By hand: A was in the file at the runs' commit (10:00); B first appears in the 12:30 commit.
    runs = f"runs from {first[:8]} (2026-01-01 10:00 UTC)"
    assert late == {("Local", "FedAvg"): f"declared after its runs: 2026-01-01 12:30 UTC ({second[:8]}); {runs}"}
    assert late_declarations(root, ["s.yaml"], [second], pairs) == {}  # runs made once both were declared
    assert late_declarations(root, ["s.yaml"], ["0" * 40], pairs) == {}  # an unknown commit: nothing claimed


# --- the report ----------------------------------------------------------------------------------------


def write_run(runs: Path, key: str, acc: float, commit: str) -> None:
    """A finished run, four clients at ``acc`` at its best-validation round, made at ``commit``."""
    folder = runs / key / f"{key}-20260101-000000"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("name: x\n")
    part = {"clients": {"test_acc": {"mean": acc}, "val_acc": {"mean": acc}}}
    (folder / "summary.json").write_text(json.dumps({"best_val": {**part, "round": 2}, "last": {**part, "round": 3}}))
    segment = {"command": "fedmerge run x", "commit": commit, "dirty": False, "started": "2026-01-01T11:00:00+0000"}
    (folder / "provenance.jsonl").write_text(json.dumps(segment) + "\n")


def test_the_report_counts_paper_claims_and_marks_the_late_one_in_its_row_and_count(repo):
    root, first, second = repo
    study = Study(
        title="t",
        base="base.yaml",
        seeds=[0, 1, 2],
        methods=[
            {"label": "Local", "grid": {"algorithm.lr": [0.1]}},
            {"label": "FedAvg", "grid": {"algorithm.lr": [0.1]}},
        ],
        claims=[Claim(paper="A", higher="FedAvg", lower="Local"), Claim(paper="B", higher="Local", lower="FedAvg")],
    )
    runs = root / "runs"
    for seed, fedavg in zip((0, 1, 2), (0.8, 0.7, 0.8), strict=True):
        write_run(runs, run_key("Local", 0, seed), 0.5, first)
        write_run(runs, run_key("FedAvg", 0, seed), fedavg, first)
    reference = {"scope": "group", "mean": 0.95, "mean_prior": 0.96, "val_mean": 0.9, "val_mean_prior": 0.91}
    refs = {seed: reference for seed in (0, 1, 2)}
    done = Conducted(study, [study], runs, {"Local": 0, "FedAvg": 0}, refs, root / "s.yaml")
    text = report(done)
    # By hand: FedAvg - Local = +30, +20, +30 points; mean 26.7, sd 5.77, t(2) 4.30: [+12.3, +41.0], so A is
    # reproduced and B (its mirror) is not; B was not in s.yaml at the runs' commit.
    late = f"declared after its runs: 2026-01-01 12:30 UTC ({second[:8]}); runs from {first[:8]} (2026-01-01 10:00 UTC)"
    assert f"1 of 2 paper claims reproduced; not reproduced: B; **{late.replace(': ', ' (B): ', 1)}**." in text
    assert f"| B (**{late}**) | Local > FedAvg | -26.7 | [-41.0, -12.3] |" in text
    claims = results_json(done)["claims"]
    assert [c.get("declared_after") for c in claims] == [None, late]
    assert "declared_after" not in claims[0]  # a claim declared in time keeps its JSON as published


def _bootstrap_pair(higher: str, z: float, verdict: str = "reproduced") -> dict:
    """A comparison whose 95% bootstrap interval has standard error 1 and difference z (so its p is 2(1-Phi(z)))."""
    return {"higher": higher, "lower": "B", "difference": z, "low": z - 1.959964, "high": z + 1.959964,
            "method": "bootstrap", "seeds": [0, 1, 2], "verdict": verdict}  # fmt: skip


def test_interval_p_values_by_hand():
    from fedmerge.study.claims import interval_p_value

    # bootstrap: se 1, difference 2 -> p = 2 (1 - Phi(2)) = 0.0455003
    assert interval_p_value(_bootstrap_pair("A", 2.0)) == pytest.approx(0.0455003, abs=1e-6)
    # paired t over 5 seeds: half-width t(0.975, 4) = 2.776445 x se 1, difference 2 -> p = 2 P(T4 > 2) = 0.116117
    # (Student t, 4 df, closed form: P(T <= 2) = 1/2 + 3/8 sqrt(2) (1 - 1/6) = 0.941942)
    paired = {
        "difference": 2.0,
        "low": 2 - 2.776445,
        "high": 2 + 2.776445,
        "method": "paired t",
        "seeds": [0, 1, 2, 3, 4],
    }
    assert interval_p_value(paired) == pytest.approx(0.116117, abs=1e-5)


def test_holm_keeps_the_pairs_a_hand_step_down_keeps():
    from fedmerge.study.claims import holm_reproduced

    # z 2.5758 / 2.3263 / 2.0537 give p 0.010 / 0.020 / 0.040: thresholds 0.05/3, 0.05/2, 0.05 -> all pass
    passing = [_bootstrap_pair("A", 2.5758), _bootstrap_pair("C", 2.3263), _bootstrap_pair("D", 2.0537)]
    assert holm_reproduced(passing) == {("A", "B"), ("C", "B"), ("D", "B")}
    # p 0.010 / 0.030 (z 2.1701) / 0.040: the second fails 0.025, and Holm stops there: D is not kept either
    stopping = [_bootstrap_pair("A", 2.5758), _bootstrap_pair("C", 2.1701), _bootstrap_pair("D", 2.0537)]
    assert holm_reproduced(stopping) == {("A", "B")}
    # a pair level on its own interval is never kept, whatever its rank
    assert holm_reproduced([_bootstrap_pair("A", 2.5758, "level")]) == set()
