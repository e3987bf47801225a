"""Paper studies that ship with the package and run from any folder, the preflight that refuses a study before any
run folder exists, the paper's values beside ours in the report, and the dry run's GPU-hour arithmetic (#53)."""

from __future__ import annotations

import json
import re
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fedmerge.cli import app
from fedmerge.study import preflight
from fedmerge.study.packaged import find_study, packaged_studies
from fedmerge.study.preflight import plan
from fedmerge.study.protocol import Conducted
from fedmerge.study.report import report, results_json
from fedmerge.study.spec import Study, load_study_file, run_key, run_overrides

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "study_tiny"


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def refused_in_one_line(result, folder: Path) -> str:
    """The refusal's one line: exit 2, one line of output, and no run folder made."""
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert not (folder / "runs").exists()
    return lines[0]


# --- shipped, found by name -------------------------------------------------------------------------------


def test_every_paper_study_ships_and_is_found_by_name_from_an_empty_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shipped = packaged_studies()
    assert sorted(shipped) == sorted(p.stem for p in (ROOT / "studies" / "paper").glob("*.yaml"))
    path, revision = find_study(Path("fedmerge_t2_cluster"))
    assert (path.name, revision) == ("fedmerge_t2_cluster.yaml", None)
    assert find_study(Path("fedmerge_t2_cluster.yaml"))[0] == path
    study = load_study_file(path).at()
    # the base is the one next to the packaged study, not configs/paper/ under the (empty) working folder
    assert (
        Path(study.base).is_absolute()
        and Path(study.base).read_text() == (ROOT / "configs" / "paper" / "fedmerge_cifar100_cluster.yaml").read_text()
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_the_wheel_holds_every_paper_study_and_base_config(tmp_path):
    """A non-editable install gets the files themselves (the package's links to studies/paper and configs/paper
    are followed when the wheel is built)."""
    import subprocess
    import sys
    import zipfile

    tree = tmp_path / "tree"  # a copy: an in-tree build leaves build/ and *.egg-info behind
    tree.mkdir()
    for part in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / part, tree / part)
    for part in ("src", "studies/paper", "configs/paper"):
        ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
        shutil.copytree(ROOT / part, tree / part, symlinks=True, ignore=ignore)  # the package's links stay links
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(tree), "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(tmp_path)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("fedmerge-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    studies = {p.name for p in (ROOT / "studies" / "paper").glob("*.yaml")}
    configs = {p.name for p in (ROOT / "configs" / "paper").glob("*.yaml")}
    assert {n.rpartition("/")[2] for n in names if n.startswith("fedmerge/paper/studies/")} == studies
    assert {n.rpartition("/")[2] for n in names if n.startswith("fedmerge/paper/configs/paper/")} == configs


def test_a_path_wins_over_a_packaged_name_and_an_unknown_name_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copy(TINY / "base.yaml", tmp_path / "base.yaml")
    shutil.copy(TINY / "study_tiny.yaml", tmp_path / "fedmerge_t2_cluster.yaml")  # a local file of the same name
    assert find_study(Path("fedmerge_t2_cluster.yaml"))[0] == Path("fedmerge_t2_cluster.yaml")
    line = refused_in_one_line(cli("study", "no_such_study", "--dry-run"), tmp_path)
    assert line == (
        "error: no study file no_such_study and no packaged study is named 'no_such_study' "
        "(the packaged ones: fedmerge list study)"
    )


def test_the_base_is_found_next_to_the_study_file_from_any_working_folder(tmp_path, monkeypatch):
    (tmp_path / "repo" / "studies").mkdir(parents=True)
    (tmp_path / "repo" / "configs").mkdir()
    shutil.copy(TINY / "base.yaml", tmp_path / "repo" / "configs" / "b.yaml")
    spec = yaml.safe_load((TINY / "study_tiny.yaml").read_text())
    (tmp_path / "repo" / "studies" / "s.yaml").write_text(yaml.safe_dump({**spec, "base": "configs/b.yaml"}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    study = load_study_file(tmp_path / "repo" / "studies" / "s.yaml").at()
    assert study.base == str(tmp_path / "repo" / "configs" / "b.yaml")
    monkeypatch.chdir(tmp_path / "repo")  # inside the tree: the relative path studies always recorded
    assert load_study_file(Path("studies/s.yaml")).at().base == "configs/b.yaml"


def test_list_study_shows_every_packaged_study_with_its_hours_and_downloads():
    result = CliRunner().invoke(app, ["list", "study"], terminal_width=400)
    assert result.exit_code == 0, result.output
    for name in packaged_studies():
        assert name in result.output
    row = next(line for line in result.output.splitlines() if "fedmerge_t5_xnli" in line)
    assert "│ 33 " in row and "XNLI 1.0" in row  # the downloads column (folded to the terminal width)
    assert "together about 2,616 GPU hours" in result.output


# --- the preflight ------------------------------------------------------------------------------------------


def test_a_paper_study_from_an_empty_folder_on_a_machine_without_cuda_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(preflight, "cuda_available", lambda: False)
    line = refused_in_one_line(cli("study", "fedmerge_t2_cluster"), tmp_path)
    head = "error: fedmerge_t2_cluster.yaml: its runs ask for device: cuda, and this machine has no CUDA"
    assert line.startswith(head)


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    shutil.copy(TINY / "study_tiny.yaml", tmp_path / "study_tiny.yaml")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def with_base(folder: Path, **changes) -> None:
    base = yaml.safe_load((TINY / "base.yaml").read_text())
    for key, value in changes.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    (folder / "base.yaml").write_text(yaml.safe_dump(base))


def test_a_dataset_neither_present_nor_downloaded_is_refused_in_one_line(tiny):
    empty = tiny / "data"
    with_base(tiny, dataset={"name": "mnist", "data_dir": str(empty), "download": False})
    line = refused_in_one_line(cli("study", "study_tiny.yaml"), tiny)
    assert line.startswith(f"error: study_tiny.yaml: dataset 'mnist' is not in {empty / 'mnist'} (")
    assert line.endswith("run `fedmerge data fetch mnist` or set dataset.download=true")
    assert not empty.exists()


def test_a_dataset_that_will_be_downloaded_passes_and_its_size_counts_on_the_disk(tiny, monkeypatch):
    with_base(tiny, dataset={"name": "mnist", "data_dir": str(tiny / "data"), "download": True})
    study = load_study_file(Path("study_tiny.yaml")).at()
    problems, download = preflight.missing_datasets(preflight.configs(study))
    from fedmerge.data.catalog import CATALOG

    assert problems == [] and download == sum(f.size for f in CATALOG.get("mnist").files) > 10_000_000


def test_weights_neither_on_disk_nor_in_the_cache_are_refused_offline_in_one_line(tiny, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tiny / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tiny / "hf" / "hub"))
    with_base(tiny, model={"name": "vit_lora", "model": "no-org/no-such-vit"})
    line = refused_in_one_line(cli("study", "study_tiny.yaml"), tiny)
    assert line.startswith("error: study_tiny.yaml: model weights 'no-org/no-such-vit' are neither a local folder")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # online: downloaded on first use, not a preflight problem
    assert preflight.missing_weights(preflight.configs(load_study_file(Path("study_tiny.yaml")).at())) == []


def test_too_little_disk_for_the_runs_is_refused_in_one_line(tiny, monkeypatch):
    with_base(tiny)
    Usage = namedtuple("Usage", "total used free")
    seen = []

    def disk_usage(path):
        seen.append(Path(path))
        return Usage(10 * 2**30, 10 * 2**30 - 2**20, 2**20)  # 1 MiB free

    monkeypatch.setattr(preflight.shutil, "disk_usage", disk_usage)
    line = refused_in_one_line(cli("study", "study_tiny.yaml"), tiny)
    # the latest revision (wide, in its own folder): 4 tuning runs + 2 seed runs = 6, at 256 MiB each = 1.5 GiB
    assert line == (
        f"error: study_tiny.yaml: the disk of {Path('runs/repro/study_tiny_wide')} has 0.0 GiB free; 6 runs need at "
        "least 1.5 GiB (256 MiB each): free some room or give --runs on a larger disk"
    )
    assert seen == [tiny]  # the nearest folder that exists: nothing was created to ask


# --- the dry run's GPU-hour arithmetic ------------------------------------------------------------------------


def test_the_dry_run_prints_the_study_files_arithmetic_with_one_runs_steps_recomputed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["study", "fedmerge_t2_cluster", "--dry-run"], terminal_width=400)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    # by hand: 500 rounds x 90,000 samples / 32 = 1,406,250 steps; 3 x 8.3 MFLOP x 32 at 10 TFLOP/s is 0.08 ms,
    # under the 3 ms floor; 1,406,250 x 3 ms = 4,218.75 s = 1.17 h (the file's 1.19 h adds evaluation)
    assert (
        "  recomputed: 500 rounds x 90,000 samples / batch 32 = 1,406,250 steps x 3 ms (the step floor) = 1.17 h "
        "of training per run, before evaluation"
    ) in lines
    assert "    total: about 41 GPU hours" in lines and lines[-1] == "the study states about 41 GPU hours on one H100"
    assert list(tmp_path.iterdir()) == []


def test_every_paper_studys_recomputed_training_fits_within_its_cheapest_rows_stated_hours():
    """The step floor or FLOP rate each file states accounts for its per-run hours: training alone never exceeds
    the cheapest row's hours (evaluation and decoding come on top), and is most of them where evaluation is light."""
    import re

    from fedmerge.study.cost import block, steps

    for name, path in packaged_studies().items():
        lines = block(path.read_text())
        s = steps(lines)
        assert s is not None, name
        cheapest = min(float(h) for h in re.findall(r"([\d.]+) h x \d+ runs", " ".join(lines)))
        assert s.hours <= cheapest + 0.005, name
        if not name.startswith("fedmerge_t5"):  # the LLM's generated answers dominate its evaluation
            assert s.hours >= 0.85 * cheapest, name


# --- the paper's values -----------------------------------------------------------------------------------------


def test_paper_entries_change_no_run_name_nor_run_config(tmp_path):
    text = (ROOT / "studies" / "paper" / "fedmerge_t4_cluster.yaml").read_text()
    without = "\n".join(line for line in text.splitlines() if not line.strip().startswith("paper: {"))
    assert without != text
    for name, content in (("with.yaml", text), ("without.yaml", without)):
        (tmp_path / name).write_text(content)
    a, b = (load_study_file(tmp_path / n).at() for n in ("with.yaml", "without.yaml"))
    assert any(m.paper for m in a.methods) and not any(m.paper for m in b.methods)
    assert plan(a) == plan(b)
    assert [run_overrides(m, p, 0) for m in a.methods for p in m.points()] == [
        run_overrides(m, p, 0) for m in b.methods for p in m.points()
    ]


PAPER_FILES = sorted((ROOT / "studies" / "paper").glob("*.yaml"))


def without_the_paper(text: str) -> str:
    """The study file with its ``paper:`` values and its ``claims:`` block taken out."""
    lines = [line for line in text.splitlines() if not line.strip().startswith("paper: {")]
    if "claims:" in (keys := [line.split(" ", 1)[0] for line in lines]):
        start = keys.index("claims:")
        end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(("- ", "#"))), len(lines))
        lines = lines[:start] + lines[end:]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("path", PAPER_FILES, ids=lambda p: p.stem)
def test_no_paper_studys_values_or_claims_change_its_runs(path: Path, tmp_path):
    text = path.read_text()
    stripped = without_the_paper(text)
    assert "paper: {" not in stripped and "\nclaims:" not in stripped and stripped != text
    for name, content in (("with.yaml", text), ("without.yaml", stripped)):
        (tmp_path / name).write_text(content)
    a, b = (load_study_file(tmp_path / n).at() for n in ("with.yaml", "without.yaml"))
    assert not b.claims and not any(m.paper for m in b.methods)
    assert [run_overrides(m, p, s) for m in a.methods for p in m.points() for s in a.seeds] == [
        run_overrides(m, p, s) for m in b.methods for p in m.points() for s in b.seeds
    ]
    assert a.model_copy(update={"claims": []}).model_dump(exclude={"methods": {"__all__": {"paper"}}}) == b.model_dump(
        exclude={"methods": {"__all__": {"paper"}}}
    )


def comment_sentences(text: str) -> list[str]:
    """The file's comments, sentence by sentence: a comment's indented lines ("#   ...") continue it."""
    comments: list[str] = []
    for line in text.splitlines():
        if line.startswith("#   ") and comments:
            comments[-1] += " " + line[1:].strip()
        elif line.startswith("#"):
            comments.append(line[1:].strip())
    return [s for c in comments for s in re.split(r"[.;]\s", c)]


@pytest.mark.parametrize("path", PAPER_FILES, ids=lambda p: p.stem)
def test_every_paper_study_gives_the_papers_values_and_claims_its_own_numbers_bear_out(path: Path):
    """Every row the paper reports carries its value, and a row without one says why in a comment (not in the
    paper's table, or no number there); the claims are declared (an empty list where the paper makes none), and
    each is borne out by the paper's own numbers: the higher row's published value above the lower row's (a
    claim the paper's table contradicts is left out, and the comment says so)."""
    text = path.read_text()
    study = load_study_file(path).at()
    assert "claims" in yaml.safe_load(text)
    metric = study.metric.name
    for m in study.methods:
        if m.paper:
            assert metric in m.paper, (path.stem, m.label)
        else:
            why = [s for s in comment_sentences(text) if m.label in s]
            assert any(w in s for s in why for w in ("no value", "not a row", "not in")), (path.stem, m.label)
    value = {m.label: m.paper.get(metric) for m in study.methods}
    for c in study.claims:
        assert value[c.higher] is not None and value[c.lower] is not None, (path.stem, c)
        assert value[c.higher] > value[c.lower], (path.stem, c.higher, c.lower)


def test_a_paper_value_must_name_the_metric_or_a_column(tiny):
    spec = yaml.safe_load((TINY / "study_tiny.yaml").read_text())
    spec["methods"][0]["paper"] = {"top5": 50.0}
    (tiny / "bad.yaml").write_text(yaml.safe_dump(spec))
    with_base(tiny)
    line = refused_in_one_line(cli("study", "bad.yaml", "--dry-run"), tiny)
    assert "row 'Local': paper value 'top5' is neither the metric nor a column (one of: ['acc', 'ece'])" in line


def write_run(runs: Path, key: str, acc: float, top5: float) -> None:
    folder = runs / key / f"{key}-20260101-000000"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("name: x\n")
    part = {"clients": {"test_acc": {"mean": acc}, "val_acc": {"mean": acc}, "test_top5": {"mean": top5}}}
    (folder / "summary.json").write_text(json.dumps({"best_val": {**part, "round": 2}, "last": {**part, "round": 3}}))
    segment = {"command": "fedmerge run x", "commit": "c" * 40, "dirty": False, "started": "2026-01-01T11:00:00+0000"}
    (folder / "provenance.jsonl").write_text(json.dumps(segment) + "\n")


def test_the_report_puts_the_papers_values_beside_ours_with_the_difference_and_its_interval(tmp_path):
    study = Study(
        title="t",
        base="base.yaml",
        seeds=[0, 1, 2],
        columns=["test_top5"],
        methods=[
            {"label": "Local", "grid": {"algorithm.lr": [0.1]}, "paper": {"acc": 50.0}},
            {"label": "FedAvg", "grid": {"algorithm.lr": [0.1]}, "paper": {"acc": 60.0, "top5": 90.0}},
        ],
    )
    runs = tmp_path / "runs"
    for seed, (local, fedavg) in enumerate([(0.50, 0.80), (0.52, 0.70), (0.54, 0.80)]):
        write_run(runs, run_key("Local", 0, seed), local, 0.9)
        write_run(runs, run_key("FedAvg", 0, seed), fedavg, 0.9)
    reference = {"scope": "group", "mean": 0.95, "mean_prior": 0.96, "val_mean": 0.9, "val_mean_prior": 0.91}
    done = Conducted(study, [study], runs, {"Local": 0, "FedAvg": 0}, {s: reference for s in (0, 1, 2)}, None)
    text = report(done)
    # By hand. Local: 50, 52, 54 minus 50 = 0, 2, 4: mean 2, sd 2, t(2)=4.303: 2 +- 4.97 = [-2.97, +6.97].
    # FedAvg: 80, 70, 80 minus 60 = 20, 10, 20: mean 16.67, sd 5.774, half 14.34: [+2.32, +31.01], above.
    # FedAvg top-5: 90 on every seed, the paper's 90: difference 0 with no spread.
    assert "## Against the paper" in text
    assert "| Local | acc | 50.00 | 52.00 | +2.00 | [-2.97, +6.97] | 3 | consistent |" in text
    assert "| FedAvg | acc | 60.00 | 76.67 | +16.67 | [+2.32, +31.01] | 3 | above |" in text
    assert "| FedAvg | top5 | 90.00 | 90.00 | +0.00 | [+0.00, +0.00] | 3 | consistent |" in text
    (local,) = [p for p in results_json(done)["paper"] if p["label"] == "Local"]
    assert (local["paper"], round(local["ours"], 6), round(local["low"], 2)) == (50.0, 52.0, -2.97)
