"""docs/reproductions/: the generated index matches what the generator writes, the layout holds, links resolve."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fedmerge.study import moved_reproductions
from fedmerge.study import reproductions_index as index_module

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "reproductions"
HAND_WRITTEN = {"HISTORY.md", "READING.md"}
TOP_LEVEL = {"README.md", "TABLES.md", "verdicts.md", "MOVED.md"}


@pytest.fixture(scope="module")
def index():
    return index_module


def full_history() -> None:
    """The late-declaration marks are read from git history (when each claim was committed): a shallow clone
    or a copy without .git cannot regenerate them."""
    root = DOCS.parents[1]
    ask = ["git", "-C", str(root), "rev-parse", "--is-shallow-repository"]
    shallow = subprocess.run(ask, capture_output=True, text=True)
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("needs the repository's full git history (a git clone without --depth)")


def test_running_the_generator_writes_the_committed_readme_and_tables(index, tmp_path):
    full_history()
    # Everything the generator reads (JSON files, verdicts.md, HISTORY.md and READING.md), none of its output.
    docs = tmp_path / "reproductions"
    shutil.copytree(DOCS, docs, ignore=shutil.ignore_patterns("*.png", "archive", "README.md", "TABLES.md"))
    assert index.main(["--docs", str(docs)], root=ROOT) == 0
    for name in ("README.md", "TABLES.md"):
        assert (docs / name).read_text() == (DOCS / name).read_text(), f"{name}: run scripts/reproductions_index.py"
    assert index.main(["--docs", str(docs), "--check"], root=ROOT) == 0
    (docs / "TABLES.md").write_text("edited by hand\n")
    assert index.main(["--docs", str(docs), "--check"], root=ROOT) == 1


def test_the_script_at_its_old_path_checks_this_checkout_from_any_folder(tmp_path):
    """scripts/reproductions_index.py, named by the docs and the index itself, runs the package's command on
    its own checkout wherever it is called from."""
    full_history()
    script = ROOT / "scripts" / "reproductions_index.py"
    proc = subprocess.run([sys.executable, str(script), "--check"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


def test_the_readme_is_short_and_starts_with_the_study_of_record_table():
    lines = (DOCS / "README.md").read_text().splitlines()
    assert len(lines) < 200
    assert lines.index("## Study of record, per paper table") < 10
    assert "| LIVAR Table 4, ablation |" in "\n".join(lines)


def test_revisions_sort_in_the_order_they_were_made(index):
    shuffled = ["x_y_knobs_wide", "x_y_wide", "x_y", "x_y_knobs"]
    assert index.revision_order(shuffled) == ["x_y", "x_y_wide", "x_y_knobs", "x_y_knobs_wide"]
    assert index.revision_order(["r_widest", "r", "r_wider", "r_wide"]) == ["r", "r_wide", "r_wider", "r_widest"]
    assert index.revision_order(["l_b05_budget", "l_b05_ablation"]) == ["l_b05_ablation", "l_b05_budget"]


def write_study(folder: Path, name: str, both: list[bool], local: list[bool] | None = None) -> None:
    """A study JSON whose seeds meet both bars where ``both`` says, Local's bar where ``local`` says."""
    local = local or [True] * len(both)
    checks = [
        {"seed": i, "local_gap": 20.0, "fedavg_gap": 12.0 if b else 5.0, "local_starved": lo, "fedavg_hurt": b}
        | {"passes": b and lo}
        for i, (b, lo) in enumerate(zip(both, local, strict=True))
    ]
    rows = {"Local": {"seeds": [0, 1], "best_val": [0.5, 0.7], "last": [0.25, 0.25]}}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps({"title": name, "regime": checks, "rows": rows}))
    (folder / f"{name}.md").write_text(f"# {name}\n")


def toy_docs(tmp_path: Path, record: str, verdict: str) -> Path:
    docs = tmp_path / "docs"
    family = docs / "fedmerge" / "toy"
    write_study(family, "fedmerge_toy", [True, True, True])
    write_study(family, "fedmerge_toy_wide", [True, False, True])
    (family / "HISTORY.md").write_text("# History\n")
    (docs / "verdicts.md").write_text(
        "## Verdicts\n\n| paper table | study of record | regime kept | verdicts |\n|---|---|---|---|\n"
        f"| FedMerge Table 9 | [{record}.md](fedmerge/toy/{record}.md) | by hand | {verdict} |\n\nMore.\n"
    )
    return docs


def test_the_record_table_takes_its_regime_from_the_json(index, tmp_path):
    readme = index.outputs(toy_docs(tmp_path, "fedmerge_toy", "evidence"))[tmp_path / "docs" / "README.md"]
    row = (
        "| FedMerge Table 9 | [fedmerge_toy.md](fedmerge/toy/fedmerge_toy.md) | 3 of 3 | evidence "
        "| [toy](fedmerge/toy/HISTORY.md) |"
    )
    assert row in readme
    family = (
        "| [toy](fedmerge/toy/HISTORY.md) | [first](fedmerge/toy/fedmerge_toy.md) 3 of 3 → "
        "[wide](fedmerge/toy/fedmerge_toy_wide.md) 2 of 3 | - |"
    )
    assert family in readme
    tables = index.outputs(toy_docs(tmp_path, "fedmerge_toy", "evidence"))[tmp_path / "docs" / "TABLES.md"]
    # mean and sample std of 50 and 70; one last-round value per seed, 25 each.
    assert "| Local | 2 | 60.0 ± 14.1 | 25.0 ± 0.0 |" in tables
    assert "Regime **NOT kept**: both bars met on 2 of 3 seeds (mean gaps: Local 20.0, FedAvg 9.7 points)." in tables


def test_a_study_whose_json_gives_row_intervals_shows_them_in_its_own_column(index, tmp_path):
    docs = toy_docs(tmp_path, "fedmerge_toy", "evidence")
    path = docs / "fedmerge" / "toy" / "fedmerge_toy_wide.json"
    data = json.loads(path.read_text())
    for row in data["rows"].values():
        row["interval"] = [0.4, 0.8]  # as a report since #55 writes it (fractions)
    path.write_text(json.dumps(data))
    tables = index.outputs(docs)[docs / "TABLES.md"]
    assert "| Local | 2 | 60.0 ± 14.1 | [40.0, 80.0] | 25.0 ± 0.0 |" in tables
    assert "| method | seeds | at best val (%) | 95% interval over seeds (%) | last round (%) |" in tables
    assert "| Local | 2 | 60.0 ± 14.1 | 25.0 ± 0.0 |" in tables  # the first revision's JSON has none


def test_a_reports_per_client_values_are_not_read_as_a_study(index, tmp_path):
    docs = toy_docs(tmp_path, "fedmerge_toy", "evidence")
    before = index.outputs(docs)
    (docs / "fedmerge" / "toy" / "fedmerge_toy_wide.clients.json").write_text('{"rows": {}}')
    assert index.outputs(docs) == before


def test_the_confirmation_table_gives_seeds_regime_and_claim_verdicts_per_paper_table(index, tmp_path):
    docs = toy_docs(tmp_path, "fedmerge_toy", "evidence")
    readme = index.outputs(docs)[docs / "README.md"]
    assert "| FedMerge Table 9 | 0-2 | none yet | - | not confirmed (exploration: evidence) |" in readme
    weak = index.outputs(toy_docs(tmp_path, "fedmerge_toy", "provisional"))[docs / "README.md"]
    assert (
        "| FedMerge Table 9 | 0-2 | none: the regime is not kept on the exploration seeds, so no setting is there "
        "to confirm | - | provisional only |"
    ) in weak
    family = docs / "fedmerge" / "toy"
    write_study(family, "fedmerge_toy_confirm", [True, True, False, True, True])
    data = json.loads((family / "fedmerge_toy_confirm.json").read_text())
    for check in data["regime"]:
        check["split"] = "val"
    verdicts = [("P1", "reproduced"), ("P1", "not reproduced"), ("P2", "reproduced"), ("P3", "level"), ("P3", None)]
    claims = [{"paper": p, "higher": f"R{i}", "lower": "Local", "verdict": v} for i, (p, v) in enumerate(verdicts)]
    data |= {"seeds": [100, 101, 102, 103, 104], "explored_on": [0, 1, 2], "claims": claims}
    (family / "fedmerge_toy_confirm.json").write_text(json.dumps(data))
    # By hand: P1 has a comparison not reproduced, P3 one level and one without a verdict; only P2 holds.
    row = (
        "| FedMerge Table 9 | 0-2 | 100-104 | 4 of 5 | [1 of 3 paper claims reproduced]"
        "(fedmerge/toy/fedmerge_toy_confirm.md); not reproduced: P1; P3 "
        "(comparisons: 2 reproduced, 1 level, 1 not reproduced, 1 no verdict) |"
    )
    assert row in index.outputs(docs)[docs / "README.md"]
    # with intervals (bootstrap, se 1), by hand: R1 (z -3.0) and R2 (z 3.0), p 0.0027 each, pass Holm's 0.05/5 and
    # 0.05/4; R0 (z 2.2, p 0.028) fails 0.05/3 and Holm stops: only R2 is kept, so P2 holds: 1 of 3
    for claim, z in zip(claims, (2.2, -3.0, 3.0, 0.5, 0.0), strict=True):
        claim |= {"difference": z, "low": z - 1.959964, "high": z + 1.959964, "method": "bootstrap"}
    (family / "fedmerge_toy_confirm.json").write_text(json.dumps(data))
    holm = "1 no verdict; family-wise (Holm over the study's 5 comparisons): 1 of 3 paper claims reproduced) |"
    assert holm in index.outputs(docs)[docs / "README.md"]
    claims[2] |= {
        "difference": 2.2,
        "low": 2.2 - 1.959964,
        "high": 2.2 + 1.959964,
    }  # P2's pair now p 0.028 > 0.05/4: none kept
    (family / "fedmerge_toy_confirm.json").write_text(json.dumps(data))
    holm = "1 no verdict; family-wise (Holm over the study's 5 comparisons): 0 of 3 paper claims reproduced) |"
    assert holm in index.outputs(docs)[docs / "README.md"]
    for claim in claims:
        for key in ("difference", "low", "high", "method"):
            claim.pop(key)
    del data["regime"][2]["split"]  # a check from before the split was recorded read test
    (family / "fedmerge_toy_confirm.json").write_text(json.dumps(data))
    assert "| 100-104 | 4 of 5 (read test) |" in index.outputs(docs)[docs / "README.md"]


def test_each_bar_is_counted_where_the_regime_is_not_kept(index, tmp_path):
    folder = tmp_path / "livar" / "fam"
    write_study(folder, "livar_fam", [True, True, False], local=[False, True, True])
    study = index.load_families(tmp_path)[0].studies[0]
    assert study.regime() == "1 of 3"
    assert study.regime(detail=True) == "1 of 3 (Local bar on 2, FedAvg bar on 2)"


def test_evidence_from_a_study_whose_regime_is_not_kept_is_refused(index, tmp_path):
    with pytest.raises(ValueError, match="fedmerge_toy_wide is not kept on every seed"):
        index.outputs(toy_docs(tmp_path, "fedmerge_toy_wide", "evidence"))
    index.outputs(toy_docs(tmp_path, "fedmerge_toy_wide", "provisional"))  # provisional: fine


def test_a_study_of_record_without_a_report_is_refused(index, tmp_path):
    with pytest.raises(ValueError, match="names no study report here"):
        index.outputs(toy_docs(tmp_path, "fedmerge_gone", "provisional"))
    docs = toy_docs(tmp_path, "fedmerge_toy", "evidence")
    (docs / "verdicts.md").write_text("## Verdicts\n\nNo table.\n")
    with pytest.raises(ValueError, match="no 'At a glance' table"):
        index.outputs(docs)
    assert index.main(["--docs", str(docs), "--check"]) == 1  # one line on stderr, no traceback


def test_every_report_sits_in_a_paper_and_family_folder_with_its_json_and_a_history():
    assert {p.name for p in DOCS.glob("*.md")} == TOP_LEVEL
    assert not list(DOCS.glob("*.json"))
    reports = {p.with_suffix("") for p in DOCS.glob("*/*/*.md") if p.name not in HAND_WRITTEN}
    clients = {p for p in DOCS.glob("*/*/*.json") if p.name.endswith(".clients.json")}
    assert reports == {p.with_suffix("") for p in DOCS.glob("*/*/*.json") if p not in clients}
    # per-client values (#55) sit beside their report's JSON: STUDY.clients.json next to STUDY.json
    assert all(p.with_name(p.name.removesuffix(".clients.json") + ".json").exists() for p in clients)
    assert len(reports) >= 39  # the 39 moved with their folders, and the studies run since
    for family in {p.parent for p in reports}:
        assert (family / "HISTORY.md").exists(), family
        assert family.parent.name in {"fedmerge", "superfed", "livar"}
        assert all(p.stem.startswith(family.parent.name + "_") for p in family.glob("*.json"))


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize(
    "page", [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))], ids=lambda p: str(p.relative_to(ROOT))
)
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        path = target.split("#")[0]
        if not path or re.match(r"^[a-z]+:", path):
            continue
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_relinking_repoints_a_moved_files_links_and_only_those(tmp_path):
    check = moved_reproductions
    moves = {"d/x.md": "d/p/f/x.md", "d/readings/x.md": "d/p/f/READING.md", "d/y.md": "d/p/g/y.md"}
    old = "See [../x.md](../x.md), [y](../y.md#t), [../v.md](../v.md) and [web](https://e.org/x.md)."
    new = check.relink(old, "d/readings/x.md", "d/p/f/READING.md", moves)
    assert new == "See [x.md](x.md), [y](../g/y.md#t), [../../v.md](../../v.md) and [web](https://e.org/x.md)."
    # A bare file name as the label of a moved file keeps its name; a label that was a path follows the path.
    top = check.relink("[x.md](x.md) [readings/x.md](readings/x.md)", "d/v.md", "d/v.md", moves)
    assert top == "[x.md](p/f/x.md) [p/f/READING.md](p/f/READING.md)"


# --- paper claims: counted per claim, each comparison once, late declarations marked --------------------


def comparison(paper: str, higher: str, lower: str, verdict: str | None) -> dict:
    return {"paper": paper, "higher": higher, "lower": lower, "verdict": verdict}


def confirm_study(index, name: str, claims: list[dict], rows: dict | None = None):
    rows = rows or {}
    data = {"title": name, "regime": [], "rows": rows, "explored_on": [0], "seeds": [100], "claims": claims}
    return index.Study(Path(f"/nowhere/fedmerge/toy/{name}.json"), data)


def test_a_claim_needing_three_comparisons_with_one_failing_counts_0_of_1(index):
    claims = [
        comparison("A", "X", "L", "reproduced"),
        comparison("A", "X", "F", "level"),
        comparison("A", "X", "G", "reproduced"),
    ]
    grouped = index.count_paper_claims(confirm_study(index, "s", claims), {}, "T", {})
    assert [(c.text, len(c.comparisons), c.reproduced) for c in grouped] == [("A", 3, False)]
    text = index.paper_claims_text(grouped, "s.md")
    assert text == "[0 of 1 paper claims reproduced](s.md); not reproduced: A"


def test_two_claims_sharing_nothing_count_separately_and_an_empty_text_is_a_claim_of_its_own(index):
    claims = [
        comparison("A", "X", "L", "reproduced"),
        comparison("A", "X", "F", "reproduced"),
        comparison("B", "F", "L", "not reproduced"),
        comparison("", "G", "L", "reproduced"),
        comparison("", "G", "F", "reproduced"),
    ]
    grouped = index.count_paper_claims(confirm_study(index, "s", claims), {}, "T", {})
    # By hand: A holds (2 of 2), B fails, and each of the two comparisons without a text is its own claim.
    assert [c.text for c in grouped] == ["A", "B", "G above L", "G above F"]
    assert index.paper_claims_text(grouped, "s.md") == "[3 of 4 paper claims reproduced](s.md); not reproduced: B"


def test_a_comparison_listed_under_two_claims_is_refused_with_a_one_line_error(index, tmp_path):
    claims = [comparison("A", "X", "L", "reproduced"), comparison("B", "X", "L", "reproduced")]
    with pytest.raises(ValueError, match="listed under 'A' and 'B'") as err:
        index.paper_claims(claims)
    assert "\n" not in str(err.value)
    docs = toy_docs(tmp_path, "fedmerge_toy", "evidence")
    write_study(docs / "fedmerge" / "toy", "fedmerge_toy_confirm", [True])
    path = docs / "fedmerge" / "toy" / "fedmerge_toy_confirm.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"explored_on": [0], "claims": claims}))
    assert index.main(["--docs", str(docs), "--check"]) == 1


def test_a_study_file_listing_a_comparison_twice_is_refused():
    from fedmerge.study.spec import Claim, Row, Study

    rows = [Row(label="Local", overrides=[]), Row(label="FedAvg", overrides=[])]
    claims = [Claim(paper="A", higher="FedAvg", lower="Local"), Claim(paper="B", higher="FedAvg", lower="Local")]
    with pytest.raises(ValueError, match="'FedAvg' > 'Local' is listed twice"):
        Study(title="t", base="b.yaml", seeds=[0], methods=rows, claims=claims)


def test_a_comparison_with_the_figures_of_one_counted_before_is_not_counted_again(index):
    rows = {
        "LIVAR": {"seeds": [100, 101], "best_val": [0.61, 0.62]},
        "FedAvg": {"seeds": [100, 101], "best_val": [0.54, 0.55]},
        "neither": {"seeds": [100, 101], "best_val": [0.54, 0.55]},  # FedAvg bit for bit
        "alpha": {"seeds": [100, 101], "best_val": [0.50, 0.52]},
    }
    table1 = confirm_study(index, "t1", [comparison("T1: above FedAvg", "LIVAR", "FedAvg", "reproduced")], rows)
    table4 = confirm_study(
        index,
        "t4",
        [
            comparison("T4: full is best", "LIVAR", "neither", "reproduced"),
            comparison("T4: full is best", "LIVAR", "alpha", "reproduced"),
            comparison("T1: above FedAvg", "LIVAR", "FedAvg", "reproduced"),
        ],
        rows,
    )
    counted: dict = {}
    assert index.paper_claims_text(index.count_paper_claims(table1, counted, "Table 1", {}), "t1.md") == (
        "[1 of 1 paper claims reproduced](t1.md)"
    )
    grouped = index.count_paper_claims(table4, counted, "Table 4", {})
    # By hand: "full is best" needs LIVAR > neither (the Table 1 comparison) and LIVAR > alpha (new), so it
    # counts here; Table 1's claim repeated here compares the same figures and counts under Table 1 only.
    assert index.paper_claims_text(grouped, "t4.md") == (
        "[1 of 1 paper claims reproduced](t4.md); not counted again: T1: above FedAvg (counted under Table 1)"
    )


def test_a_claim_declared_after_its_runs_is_marked_in_the_count(index):
    claims = [comparison("A", "X", "L", "reproduced"), comparison("B", "F", "L", "level")]
    late = {("F", "L"): "declared after its runs: 2026-01-02 10:00 UTC (bbbbbbbb); runs from aaaaaaaa (2026-01-01)"}
    grouped = index.count_paper_claims(confirm_study(index, "s", claims), {}, "T", late)
    assert index.paper_claims_text(grouped, "s.md") == (
        "[1 of 2 paper claims reproduced](s.md); not reproduced: B; **declared after its runs (B): "
        "2026-01-02 10:00 UTC (bbbbbbbb); runs from aaaaaaaa (2026-01-01)**"
    )


def test_the_runs_commits_are_read_from_the_reports_results_table(index, tmp_path):
    report = tmp_path / "r.md"
    report.write_text(
        "# r\n\n## Results\n\n| method | chosen | seeds | commits |\n|---|---|---|---|\n"
        "| Local | lr=0.2 | 5 | 070bce24, 07ee2a66 (mixed) |\n| FedAvg | lr=0.2 | 5 | 327fd503+dirty |\n\n"
        "## Claims\n\n| a | b |\n|---|---|\n| x | deadbeef |\n"
    )
    assert index.run_commits(report) == ["070bce24", "07ee2a66", "327fd503"]


def test_the_published_index_counts_paper_claims_and_marks_the_late_ones():
    readme = (DOCS / "README.md").read_text()
    domain = next(line for line in readme.splitlines() if line.startswith("| FedMerge Tables 2-4, domain | 0-2 | 100"))
    assert "2 of 5 paper claims reproduced" in domain and "declared after its runs (all 5)" in domain
    beta10 = next(line for line in readme.splitlines() if line.startswith("| LIVAR Table 1, beta 1.0 | 0-2 | 100"))
    assert "2 of 4 paper claims reproduced" in beta10
    assert "declared after its runs (Table 1: the merging rules" in beta10


def test_a_hand_written_paper_claim_count_that_drifts_from_the_json_is_refused(index, tmp_path):
    docs = toy_docs(tmp_path, "fedmerge_toy", "evidence: 1 of 1 paper claims reproduced")
    write_study(docs / "fedmerge" / "toy", "fedmerge_toy_confirm", [True])
    path = docs / "fedmerge" / "toy" / "fedmerge_toy_confirm.json"
    claims = [comparison("A", "X", "L", "reproduced"), comparison("A", "X", "F", "level")]  # by hand: 0 of 1
    path.write_text(json.dumps(json.loads(path.read_text()) | {"explored_on": [0], "claims": claims}))
    with pytest.raises(ValueError, match="says 1 of 1 paper claims reproduced .*the JSON: 0 of 1"):
        index.outputs(docs)
