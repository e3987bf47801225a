"""docs/reproductions/: the generated index matches what the generator writes, the layout holds, links resolve."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "reproductions"
HAND_WRITTEN = {"HISTORY.md", "READING.md"}
TOP_LEVEL = {"README.md", "TABLES.md", "verdicts.md", "MOVED.md"}


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the script loads
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def index():
    return load_script("reproductions_index")


def test_running_the_generator_writes_the_committed_readme_and_tables(index, tmp_path):
    # Everything the generator reads (JSON files, verdicts.md, HISTORY.md and READING.md), none of its output.
    docs = tmp_path / "reproductions"
    shutil.copytree(DOCS, docs, ignore=shutil.ignore_patterns("*.png", "archive", "README.md", "TABLES.md"))
    assert index.main(["--docs", str(docs)]) == 0
    for name in ("README.md", "TABLES.md"):
        assert (docs / name).read_text() == (DOCS / name).read_text(), f"{name}: run scripts/reproductions_index.py"
    assert index.main(["--docs", str(docs), "--check"]) == 0
    (docs / "TABLES.md").write_text("edited by hand\n")
    assert index.main(["--docs", str(docs), "--check"]) == 1


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
    claims = [{"verdict": v} for v in ("reproduced", "not reproduced", "reproduced", "level", None)]
    data |= {"seeds": [100, 101, 102, 103, 104], "explored_on": [0, 1, 2], "claims": claims}
    (family / "fedmerge_toy_confirm.json").write_text(json.dumps(data))
    row = (
        "| FedMerge Table 9 | 0-2 | 100-104 | 4 of 5 | [2 reproduced, 1 level, 1 not reproduced, 1 no verdict]"
        "(fedmerge/toy/fedmerge_toy_confirm.md) |"
    )
    assert row in index.outputs(docs)[docs / "README.md"]
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
    assert reports == {p.with_suffix("") for p in DOCS.glob("*/*/*.json")}
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
    check = load_script("check_moved_reproductions")
    moves = {"d/x.md": "d/p/f/x.md", "d/readings/x.md": "d/p/f/READING.md", "d/y.md": "d/p/g/y.md"}
    old = "See [../x.md](../x.md), [y](../y.md#t), [../v.md](../v.md) and [web](https://e.org/x.md)."
    new = check.relink(old, "d/readings/x.md", "d/p/f/READING.md", moves)
    assert new == "See [x.md](x.md), [y](../g/y.md#t), [../../v.md](../../v.md) and [web](https://e.org/x.md)."
    # A bare file name as the label of a moved file keeps its name; a label that was a path follows the path.
    top = check.relink("[x.md](x.md) [readings/x.md](readings/x.md)", "d/v.md", "d/v.md", moves)
    assert top == "[x.md](p/f/x.md) [p/f/READING.md](p/f/READING.md)"
